"""What a resumed 2-rank job gets back besides the weights: the epoch's training loss so far, each
rank's own state of its callbacks and of the script's extra_state; and a restarted worker resumes
under resume=False."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit.testing import read_records, run_job, run_on_ranks
from tests.jobs.scripts.train_job import train, train_on_ranks
from tests.jobs.snapshot import memory_jobs
from tests.trainer_checks import bitwise_equal


def epoch_losses(run_dir: Path) -> dict[int, float]:
    """Epoch -> its train/epoch_loss, over every run of ``run_dir`` (each epoch is recorded
    once)."""
    found = {}
    for rec in read_records(run_dir):
        if rec["kind"] == "epoch":
            assert rec["epoch"] not in found, f"epoch {rec['epoch']} recorded twice"
            found[rec["epoch"]] = rec["train/epoch_loss"]
    return found


def test_the_epoch_loss_of_a_run_resumed_inside_an_epoch_is_the_uninterrupted_runs(tmp_path):
    # 10 steps an epoch, snapshots every 3 steps, the loss agreed every 20 steps and at epoch ends.
    reference = train_on_ranks(2, tmp_path / "whole")
    whole = epoch_losses(tmp_path / "whole")
    # Stopped at step 13 (the stop agrees the loss of steps 11-13 first), resumed there.
    first = train_on_ranks(2, tmp_path / "stopped", max_steps=13)
    final = train_on_ranks(2, tmp_path / "stopped")
    assert first["step"] == 13 and final["resumed_from"] == 13
    stopped = epoch_losses(tmp_path / "stopped")
    print(f"epoch 2: uninterrupted {whole[2]!r}, resumed at step 13 {stopped[2]!r}")
    assert stopped[1] == whole[1] and stopped[3] == whole[3]
    # agreed as 11-13 + 14-20 instead of 11-20
    assert abs(stopped[2] - whole[2]) <= 1e-12 * abs(whole[2])
    # Resumed from step 12's snapshot, taken between two agreements (as after a crash at step
    # 13): each rank's losses of steps 11-12 come back, and the agreement at step 20 sums the same
    # values: bitwise.
    train_on_ranks(2, tmp_path / "crashed", max_steps=13)
    shutil.rmtree(tmp_path / "crashed" / "snapshots" / "step-00000013")
    final = train_on_ranks(2, tmp_path / "crashed")
    assert final["resumed_from"] == 12 and bitwise_equal(final, reference)
    crashed = epoch_losses(tmp_path / "crashed")
    print(f"epoch 2 resumed at step 12: {crashed[2]!r}")
    assert crashed == whole


class _RankBest:
    """A callback that keeps a rank-dependent best-so-far, and reports what it started with."""

    def __init__(self, keep_state: bool) -> None:
        self.best = float("inf")
        self.started_with: float | None = None
        if keep_state:
            self.state_dict = lambda: {"best": self.best}
            self.load_state_dict = lambda state: setattr(self, "best", state["best"])

    def on_fit_start(self, trainer) -> None:
        self.started_with = self.best

    def on_step_end(self, trainer, taken: bool, output) -> None:
        # decreasing, and each rank's own
        value = 1000.0 * trainer.runtime.rank + 100.0 / trainer.step
        self.best = min(self.best, value)


class _Hidden:
    """A truncated-BPTT hidden state the script carries from step to step, each rank its own."""

    def __init__(self) -> None:
        self.h = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"h": self.h}

    def load_state_dict(self, state: dict) -> None:
        self.h = state["h"].clone()


def _with_state(run_dir: str, keep_state: bool, max_steps: int | None) -> dict:
    callback, hidden = _RankBest(keep_state), _Hidden()

    def carry(trainer) -> None:
        if keep_state:
            # as extra_state={"hidden": ...} does
            trainer.snapshots.states["rng"].own["extra:hidden"] = hidden

    class Step:
        def on_step_end(self, trainer, taken: bool, output) -> None:
            hidden.h = hidden.h + (trainer.runtime.rank + 1)  # rank r adds r + 1 each step

    started: dict = {}

    class Start:
        def on_fit_start(self, trainer) -> None:
            started["h"] = hidden.h.clone()

    train(run_dir, max_steps=max_steps, callbacks=[callback, Step(), Start()], trainer_hook=carry)
    return {
        "best": callback.best,
        "started_with": callback.started_with,
        "h": hidden.h,
        "h0": started["h"],
    }


def test_each_rank_gets_its_own_callback_and_extra_state_back_on_resume(tmp_path):
    stopped = run_on_ranks(functools.partial(_with_state, str(tmp_path / "run"), True, 13), 2)
    assert [s["best"] for s in stopped] == [100.0 / 13, 1000.0 + 100.0 / 13]
    assert [s["h"].tolist() for s in stopped] == [[13.0] * 3, [26.0] * 3]
    resumed = run_on_ranks(functools.partial(_with_state, str(tmp_path / "run"), True, None), 2)
    for rank in (0, 1):
        assert resumed[rank]["started_with"] == stopped[rank]["best"]  # its own, not rank 0's
        assert torch.equal(resumed[rank]["h0"], stopped[rank]["h"])
        assert torch.equal(resumed[rank]["h"], torch.full((3,), 30.0 * (rank + 1)))
    # Control: without the route, the callback starts afresh and the hidden state from zero.
    run_on_ranks(functools.partial(_with_state, str(tmp_path / "control"), False, 13), 2)
    lost = run_on_ranks(functools.partial(_with_state, str(tmp_path / "control"), False, None), 2)
    assert [s["started_with"] for s in lost] == [float("inf")] * 2
    assert all(torch.equal(s["h0"], torch.zeros(3)) for s in lost)


def test_extra_state_and_stateful_callbacks_are_named_and_checked(tmp_path):
    from ddpkit._errors import ConfigError
    from ddpkit.training._config import LoggingConfig
    from ddpkit.training._trainer import TrainerConfig

    model = torch.nn.Linear(3, 2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.zeros(8, dtype=torch.long))
    config = TrainerConfig(
        run_dir=str(tmp_path), batch_size=4, num_workers=0, logging=LoggingConfig(progress=False)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(
        ConfigError, match=r"extra_state\['h'\] is a Tensor, which has no state_dict\(\)"
    ):
        ddpkit.Trainer(model, optimizer, data, config, extra_state={"h": torch.zeros(2)})
    twins = [_RankBest(True), _RankBest(True)]
    with pytest.raises(
        ConfigError, match="two callbacks keep their state under 'callback:_RankBest'"
    ):
        ddpkit.Trainer(model, optimizer, data, config, callbacks=twins)
    twins[1].state_key = "second"
    trainer = ddpkit.Trainer(
        model, optimizer, data, config, callbacks=twins, extra_state={"h": _Hidden()}
    )
    assert set(trainer.snapshots.states["rng"].own) == {
        "loss_window",
        "callback:_RankBest",
        "callback:second",
        "extra:h",
    }


JOB = Path(__file__).parents[1] / "scripts" / "train_job.py"
REPO = Path(__file__).parents[3]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_restarted_worker_resumes_its_own_run_under_resume_false(tmp_path, user_env):
    # The job asks for a fresh start (resume=False); rank 0 is SIGKILLed at step 7 of its first
    # attempt, and the restarted workers must go on from the snapshot at step 6, not move it aside
    # and train from step 0.
    script = tmp_path / "fresh_job.py"
    script.write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\nimport ddpkit\nfrom "
        f"tests.jobs.scripts.train_job import train\ntrain({str(tmp_path / 'run')!r}, "
        "resume=False, kill_rank=0, kill_step=7, kill_after_write=True, "
        f"out={str(tmp_path / 'out.pt')!r})\nddpkit.shutdown()\n"
    )
    # the launcher's own choice of threads
    proc = run_job(
        script, nproc=2, launcher_args=("--max-restarts", "1"), env=user_env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = torch.load(tmp_path / "out.pt", weights_only=False)
    assert final["attempt"] == 1 and final["resumed_from"] == 6, (
        final["attempt"],
        final["resumed_from"],
    )
    assert bitwise_equal(final, train_on_ranks(2, tmp_path / "reference"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_epoch_loss_after_a_resume_from_memory_is_the_uninterrupted_runs(
    tmp_path, memory_env, memory_reference
):
    # Copies in memory after every step, none on disk: rank 1 is SIGKILLed just after step 13 (in
    # step 14, or in a copy); the copy resumed from holds each rank's losses since step 10's
    # agreement (not yet agreed on), and the agreement at step 20 sums the same values.
    kill = ("--kill-rank", "1", "--kill-after-step", "13")
    final, _ = memory_jobs.run(tmp_path, "killed", *kill, env=memory_env)
    assert final["attempt"] == 1 and 10 < final["resumed_from"] < 20, final["resumed_from"]
    whole = epoch_losses(memory_reference / "reference")
    killed = epoch_losses(tmp_path / "killed")
    print(
        f"epoch 2: uninterrupted {whole[2]!r}, resumed at step {final['resumed_from']} "
        f"{killed[2]!r}"
    )
    assert killed == whole


class _Generator(torch.nn.Linear):
    """A second model kept in ``extra_state`` (a GAN's generator): stepped by a callback, alike on
    every rank."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        torch.nn.init.zeros_(self.weight)


def _second_model(run_dir: str, max_steps: int | None, new_rank_state: str) -> dict:
    from ddpkit._errors import ConfigError
    from ddpkit.training._config import LoggingConfig, SnapshotConfig, TrainerConfig

    ddpkit.init()
    torch.manual_seed(0)
    model, g = torch.nn.Linear(3, 2), _Generator()
    data = torch.utils.data.TensorDataset(torch.randn(24, 3), torch.zeros(24, dtype=torch.long))
    started: dict = {}

    class StepG:
        def on_fit_start(self, trainer) -> None:
            started["g"] = g.weight.detach().clone()

        def on_step_end(self, trainer, taken: bool, output) -> None:
            with torch.no_grad():
                g.weight += 1.0

    config = TrainerConfig(
        run_dir=run_dir, global_batch_size=6, num_workers=0, epochs=2, max_steps=max_steps,
        new_rank_state=new_rank_state, snapshot=SnapshotConfig(every_steps=1, async_write=False),
        logging=LoggingConfig(progress=False),
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = ddpkit.Trainer(
        model, optimizer, data, config, callbacks=[StepG()], extra_state={"g": g}
    )
    try:
        trainer.fit()
    except ConfigError as err:
        return {"refused": str(err)}
    return {"started": started["g"], "fresh": trainer.snapshots.states["rng"].fresh_parts}


def _stop_at_two_then(tmp_path: Path, policy: str) -> list[dict]:
    """Resume at 3 ranks, under ``policy``, a copy of a run stopped at step 3 on 2 ranks."""
    stopped = tmp_path / "stopped"
    if not stopped.exists():
        first = run_on_ranks(functools.partial(_second_model, str(stopped), 3, "refuse"), 2)
        assert all(torch.equal(s["started"], torch.zeros(2, 2)) for s in first)
    shutil.copytree(stopped, tmp_path / policy)
    return run_on_ranks(functools.partial(_second_model, str(tmp_path / policy), None, policy), 3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resume_at_more_ranks_refuses_copies_or_freshens_a_ranks_own_state_never_silently(
    tmp_path,
):
    # Refused by default, on every rank alike (a refusal on the new rank alone would leave the
    # others waiting).
    refused = _stop_at_two_then(tmp_path, "refuse")
    assert all(
        "ranks 2..2 have no state of their own for ['extra:g']" in r["refused"] for r in refused
    ), refused
    assert all("new_rank_state='copy'" in r["refused"] for r in refused)
    # copy: the new rank starts from rank 0's generator, as ranks 0 and 1 start from their own (3
    # steps).
    copied = _stop_at_two_then(tmp_path, "copy")
    assert all(torch.equal(c["started"], torch.full((2, 2), 3.0)) for c in copied)
    # fresh: the new rank keeps the generator as built, and says so.
    fresh = _stop_at_two_then(tmp_path, "fresh")
    assert [f["fresh"] for f in fresh] == [[], [], ["extra:g"]]
    assert torch.equal(fresh[2]["started"], torch.zeros(2, 2)) and torch.equal(
        fresh[0]["started"], torch.full((2, 2), 3.0)
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_control_without_the_policy_the_new_rank_trains_another_generator_silently(
    tmp_path, monkeypatch
):
    # The resume as it was: a rank beyond the old world started its part afresh and nobody was told.
    from ddpkit.snapshot._state import RankStreams

    monkeypatch.setattr(RankStreams, "_policy", lambda self, part: "fresh")
    monkeypatch.setattr(RankStreams, "__init__", _silent(RankStreams.__init__))
    resumed = _stop_at_two_then(tmp_path, "refuse")
    assert "refused" not in resumed[2]
    # two generators from here on
    assert not torch.equal(resumed[2]["started"], resumed[0]["started"])


def _silent(init):
    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.warn = lambda message: None

    return patched
