"""``ddpkit.Snapshots`` in a hand-written loop on 2 real ranks: a run stopped after a step and
resumed ends bit for bit where an uninterrupted run ends, every rank's weights, BatchNorm statistics
and optimizer state, having numbered its batches as that run did; a resume that leaves out the
random streams or the loader's position, or a snapshot taken at an epoch's last batch, is caught by
the same comparison."""

from __future__ import annotations

import pytest
import torch

import ddpkit
from ddpkit._errors import ConfigError
from ddpkit.testing import run_on_ranks
from tests.jobs.scripts.hand_loop_job import GLOBAL_BATCH, dataset, train
from tests.trainer_checks import same_bits


def interrupted(
    folder: str, stop_after: int, every_steps: int | None, control: str | None = None
) -> tuple:
    """Every rank: an uninterrupted run, then a run stopped after ``stop_after`` and one resumed
    from its newest snapshot; (whether the ends are the same bits, the step resumed from, whether
    the batches resumed match the uninterrupted run's)."""
    batch = GLOBAL_BATCH // ddpkit.get_runtime().world_size
    reference = train(f"{folder}/reference", batch_size=batch, every_steps=every_steps)
    train(
        f"{folder}/run",
        batch_size=batch,
        every_steps=every_steps,
        control=control,
        stop_after=stop_after,
    )
    resumed = train(f"{folder}/run", batch_size=batch, every_steps=every_steps, control=control)
    ends_same = same_bits(resumed["model"], reference["model"]) and same_bits(
        resumed["optim"], reference["optim"]
    )
    batches_same = resumed["batches"] == reference["batches"][-len(resumed["batches"]) :]
    return ends_same, resumed["resumed_from"], batches_same, resumed["batches"][0]


@pytest.mark.parametrize(
    ("stop_after", "every_steps", "resumed_from"),
    # 4 steps an epoch. Saved at 3, 6: resumed mid-epoch (epoch 1, batch 2). Due at 4 (epoch 0's
    # last batch):
    # saved after step 5 instead, past the scheduler's step at the epoch's end.
    [(7, 3, 6), (6, 4, 5)],
    ids=["mid-epoch", "due-at-an-epochs-end"],
)
def test_a_resumed_loop_ends_bitwise_where_an_uninterrupted_one_does(
    tmp_path, stop_after, every_steps, resumed_from
):
    results = run_on_ranks(interrupted, 2, (str(tmp_path), stop_after, every_steps), timeout=300)
    for rank, (ends_same, step, batches_same, first) in enumerate(results):
        assert step == resumed_from, rank
        assert ends_same, f"rank {rank}: the resumed run ends elsewhere"
        # The index in the epoch of the first batch after the resume is the uninterrupted run's,
        # not 0.
        assert batches_same and first == (resumed_from // 4, resumed_from % 4, resumed_from + 1), (
            rank,
            first,
        )


@pytest.mark.parametrize("control", ["streams", "loader"])
def test_control_a_resume_without_the_streams_or_the_loader_position_ends_elsewhere(
    tmp_path, control
):
    results = run_on_ranks(interrupted, 2, (str(tmp_path), 7, 3, control), timeout=300)
    assert not any(ends_same for ends_same, *_ in results), (
        f"leaving out the {control} went unnoticed"
    )


def epoch_end_save(folder: str) -> bool:
    """Control for the deferral: a snapshot taken at epoch 0's last batch by save() (before the
    scheduler's step after the loop) resumes into epoch 1 with the scheduler not stepped."""
    batch = GLOBAL_BATCH // ddpkit.get_runtime().world_size
    reference = train(f"{folder}/reference", batch_size=batch, every_steps=None)
    # The same loop saving by hand at step 4, the epoch's last batch: what step() defers.
    original = ddpkit.Snapshots.step

    def step_saving_at_4(self):
        saved = original(self)
        if self.steps == 4:
            self.save(wait=True)
        return saved

    ddpkit.Snapshots.step = step_saving_at_4  # type: ignore[method-assign]
    try:
        train(f"{folder}/run", batch_size=batch, every_steps=None, stop_after=6)
    finally:
        ddpkit.Snapshots.step = original  # type: ignore[method-assign]
    resumed = train(f"{folder}/run", batch_size=batch, every_steps=None)
    return resumed["resumed_from"] == 4 and not same_bits(resumed["model"], reference["model"])


def test_control_a_snapshot_at_an_epochs_last_batch_skips_the_epochs_end(tmp_path):
    assert run_on_ranks(epoch_end_save, 2, (str(tmp_path),), timeout=300) == [True, True]


def stop_signal(folder: str) -> tuple[int, int | None]:
    """Rank 1 gets SIGUSR1 during step 5: every rank saves after step 10 (the agreement) and raises
    Preempted."""
    import os
    import signal

    rt = ddpkit.get_runtime()
    model = ddpkit.prepare_model(torch.nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ddpkit.build_loader(dataset(), batch_size=6, num_workers=0)
    snapshots = ddpkit.Snapshots(
        folder, model=model, optimizer=optimizer, loader=loader, signals_every_steps=10
    )
    try:
        for _ in range(5):
            for x, y in loader:
                torch.nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                if rt.rank == 1 and snapshots.steps == 4:
                    os.kill(os.getpid(), signal.SIGUSR1)
                snapshots.step()
    except ddpkit.Preempted as stopped:
        found = snapshots.disk.latest()
        return stopped.step, None if found is None else found.step
    return -1, None


def test_a_stop_signal_on_one_rank_saves_every_rank_after_the_same_step_and_raises_preempted(
    tmp_path,
):
    assert run_on_ranks(stop_signal, 2, (str(tmp_path),), timeout=120) == [(10, 10), (10, 10)]


def refusals(folder: str) -> list[str]:
    loader = ddpkit.build_loader(dataset(), batch_size=6, num_workers=0)
    model = ddpkit.prepare_model(torch.nn.Linear(8, 3))
    snapshots = ddpkit.Snapshots(folder, model=model, loader=loader, async_write=False)
    snapshots.step()
    snapshots.save()
    snapshots.close()
    errors = []
    for other in (torch.nn.Linear(8, 4), torch.nn.Linear(8, 3)):
        again = ddpkit.Snapshots(
            folder,
            model=ddpkit.prepare_model(other),
            loader=ddpkit.build_loader(dataset(), batch_size=6, num_workers=0, seed=7),
        )
        try:
            again.resume()
        except ConfigError as err:
            errors.append(str(err))
        again.close()
    return errors


def test_a_resume_of_another_model_or_other_data_is_refused_by_name(tmp_path):
    errors = run_on_ranks(refusals, 2, (str(tmp_path),))[0]
    assert len(errors) == 2
    assert "another loop's snapshots" in errors[0] and "weight" in errors[0]
    assert "seed: 0 -> 7" in errors[1], errors[1]


def two_models_or_a_strategy(folder: str, kind: str) -> bool:
    """A DCGAN-like loop (two models, two optimizers, two schedulers, by name) or one on a ``zero``
    strategy, stopped after step 5 and resumed: True if it ends bitwise where an uninterrupted run
    does."""
    from ddpkit.strategies import build_strategy

    def run(run_dir: str, stop_after: int | None = None) -> dict | None:
        ddpkit.seed_everything(0)
        loader = ddpkit.build_loader(dataset(), batch_size=6, num_workers=0)
        if kind == "two models":
            g, d = (
                ddpkit.prepare_model(torch.nn.Linear(8, 8)),
                ddpkit.prepare_model(torch.nn.Linear(8, 3)),
            )
            optimizers = [
                torch.optim.Adam(g.parameters(), lr=1e-2),
                torch.optim.SGD(d.parameters(), lr=0.1),
            ]
            models: dict = {"G": g, "D": d}
            forward = lambda x: d(torch.nn.functional.dropout(g(x), 0.3))  # noqa: E731
            given = {"model": models, "optimizer": optimizers}
        else:
            net = torch.nn.Linear(8, 3)
            strategy = build_strategy("zero", net, torch.optim.Adam(net.parameters(), lr=1e-2))
            optimizers, forward, given = [strategy.optimizer], strategy.model, {"model": strategy}
        schedulers = [
            torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in optimizers
        ]
        snapshots = ddpkit.Snapshots(
            run_dir,
            **given,
            scheduler=schedulers if kind == "two models" else None,
            loader=loader,
            every_steps=2,
        )
        snapshots.resume()
        for _ in range(loader.epoch, 3):
            for x, y in loader:
                torch.nn.functional.cross_entropy(forward(x), y).backward()
                for o in optimizers:
                    o.step()
                    o.zero_grad()
                snapshots.step()
                if snapshots.steps == stop_after:
                    snapshots.close()
                    return None
            for s in schedulers:
                s.step()
        snapshots.close()
        return {"model": snapshots.strategy.state_dict()}

    reference = run(f"{folder}/reference")
    run(f"{folder}/run", stop_after=5)
    return same_bits(run(f"{folder}/run"), reference)


@pytest.mark.parametrize("kind", ["two models", "zero"])
def test_two_models_with_their_optimizers_or_a_strategy_resume_bitwise(tmp_path, kind):
    assert run_on_ranks(two_models_or_a_strategy, 2, (str(tmp_path), kind), timeout=300) == [
        True,
        True,
    ]


class Counter:
    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def extra_and_own(folder: str) -> tuple[int, int]:
    """``extra``: rank 0's value comes back on every rank; ``own``: each rank's own."""
    rank = ddpkit.get_runtime().rank
    model = ddpkit.prepare_model(torch.nn.Linear(2, 2))
    saved = ddpkit.Snapshots(
        folder, model=model, extra={"c": Counter(100 + rank)}, own={"r": Counter(10 * rank)}
    )
    saved.step()
    saved.save()
    saved.close()
    shared, mine = Counter(0), Counter(0)
    resumed = ddpkit.Snapshots(folder, model=model, extra={"c": shared}, own={"r": mine})
    assert resumed.resume() == 1
    resumed.close()
    return shared.value, mine.value


def test_extra_objects_come_back_as_rank_0s_and_own_objects_as_each_ranks(tmp_path):
    assert run_on_ranks(extra_and_own, 2, (str(tmp_path),)) == [(100, 0), (100, 10)]
