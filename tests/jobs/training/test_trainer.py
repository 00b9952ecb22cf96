"""The Trainer in real gloo jobs: N ranks equal one process, exact resume, and the controls that
must fail."""

from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit.strategies._ddp import stepped_parameters as _stepped_parameters
from ddpkit.testing import read_records, run_on_ranks
from tests.jobs.scripts.train_job import N_SAMPLES, train, train_on_ranks
from tests.trainer_checks import (
    assert_each_sample_once,
    bitwise_equal,
    max_rel_diff,
    samples_per_epoch,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """An uninterrupted 2-rank run, with the same sample log as the runs compared against it
    (``ddp_reference``: the same with global-batch dropout)."""
    base = tmp_path_factory.mktemp("reference")
    (base / "log").mkdir()
    return {
        "plain": train_on_ranks(2, base / "plain", sample_log=str(base / "log")),
        "log": base / "log",
    }


def test_n_ranks_train_the_same_model_as_one_process(tmp_path):
    # SyncBatchNorm and global-batch dropout make every rank's share of the work the same as one
    # process's.
    one = train_on_ranks(1, tmp_path / "w1", global_dropout=True)
    for world in (2, 3):
        diff = max_rel_diff(train_on_ranks(world, tmp_path / f"w{world}", global_dropout=True), one)
        print(f"{world} ranks vs 1 process: largest relative weight difference {diff:.2e}")
        assert diff < 1e-5
    # Controls: BatchNorm over each rank's slice, or dropout masks drawn per rank, give another
    # model.
    assert (
        max_rel_diff(
            train_on_ranks(2, tmp_path / "no_sync", global_dropout=True, sync_batchnorm=False), one
        )
        > 1e-2
    )
    assert max_rel_diff(train_on_ranks(2, tmp_path / "rank_dropout"), one) > 1e-2


def _equal_rank_weights(trainer) -> None:
    # The control: every rank's mean counted alike in the last, uneven batch (what DDP alone does).
    # (One micro-batch a step: the divisor of a full step, 1.)
    ddpkit.training._step.loss_divisor = lambda count, world, total: 1.0


def test_an_uneven_last_batch_trains_the_same_model_as_one_process(tmp_path):
    # 229 samples in global batches of 24: the last one has 13, split 7/6 on 2 ranks and 5/4/4 on 3.
    uneven = dict(n_samples=229, drop_last=False, global_dropout=True)
    one = train_on_ranks(1, tmp_path / "w1", **uneven)
    assert one["step"] == 3 * 10
    for world in (2, 3):
        diff = max_rel_diff(train_on_ranks(world, tmp_path / f"w{world}", **uneven), one)
        print(
            f"{world} ranks vs 1 process, uneven last batch: largest relative weight difference "
            f"{diff:.2e}"
        )
        assert diff < 1e-5
    control = max_rel_diff(
        train_on_ranks(2, tmp_path / "equal", trainer_hook=_equal_rank_weights, **uneven), one
    )
    print(f"control, each rank's mean counted alike: {control:.2e}")
    assert control > 1e-3
    # Two micro-batches a step: 235 samples make micro-batches of 12 and a last one of 7 (4/3,
    # 3/2/2), so the epoch's last step weighs a full micro-batch against a short one.
    accum = dict(n_samples=235, drop_last=False, global_dropout=True, grad_accum=2)
    one = train_on_ranks(1, tmp_path / "a1", **accum)
    for world in (2, 3):
        diff = max_rel_diff(train_on_ranks(world, tmp_path / f"a{world}", **accum), one)
        print(f"{world} ranks vs 1 process, uneven last micro-batch of two: {diff:.2e}")
        assert diff < 1e-5


def test_stop_and_resume_is_bitwise_and_trains_each_sample_once(tmp_path, reference):
    log = tmp_path / "log"
    log.mkdir()
    first = train_on_ranks(2, tmp_path / "run", max_steps=13, sample_log=str(log))
    assert first["step"] == 13 and first["stopped_by"] == "max_steps"
    final = train_on_ranks(2, tmp_path / "run", sample_log=str(log))
    assert final["resumed_from"] == 13
    assert bitwise_equal(final, reference["plain"])
    # Both runs are attempt 0: the first stopped cleanly at step 13 and the second took over there.
    assert_each_sample_once(samples_per_epoch(log, {0: 0}), N_SAMPLES, 3)


@pytest.mark.parametrize("drop", ["rng", "cursor", "scheduler"])
def test_controls_a_resume_missing_state_is_caught(tmp_path, reference, drop):
    log = tmp_path / "log"
    log.mkdir()
    train_on_ranks(2, tmp_path / "run", max_steps=13, sample_log=str(log))
    final = train_on_ranks(2, tmp_path / "run", drop=drop, sample_log=str(log))
    assert final["resumed_from"] == 13
    assert not bitwise_equal(final, reference["plain"]), f"leaving out {drop} went unnoticed"
    if drop == "cursor":  # the epoch restarts: its first steps' samples are trained on twice
        with pytest.raises(AssertionError, match="samples twice"):
            assert_each_sample_once(samples_per_epoch(log, {0: 0}), N_SAMPLES, 3)


@pytest.mark.parametrize("world", [1, 3])
def test_resume_at_another_world_size(tmp_path, ddp_reference, world):
    train_on_ranks(2, tmp_path / "run", max_steps=13, global_dropout=True)
    final = train_on_ranks(world, tmp_path / "run", global_dropout=True)
    assert final["resumed_from"] == 13 and final["step"] == ddp_reference["step"]
    diff = max_rel_diff(final, ddp_reference)
    print(f"stopped at 2 ranks, resumed at {world}: largest relative weight difference {diff:.2e}")
    assert diff < 1e-5


def test_rerun_with_the_same_max_steps_trains_no_further(tmp_path):
    first = train_on_ranks(2, tmp_path / "run", max_steps=4)
    again = train_on_ranks(2, tmp_path / "run", max_steps=4)
    assert again["resumed_from"] == 4 and again["step"] == 4 and bitwise_equal(again, first)
    assert sorted(
        p.parent.name for p in (tmp_path / "run" / "snapshots").glob("*/complete.json")
    ) == [
        "step-00000003",
        "step-00000004",
    ]


def test_resume_refuses_another_global_batch(tmp_path):
    train_on_ranks(2, tmp_path / "run", max_steps=4)
    with pytest.raises(Exception, match="global_batch_size"):
        train_on_ranks(2, tmp_path / "run", global_batch=12)


def _error_of(run_dir: str, **kwargs) -> str:
    try:
        train(run_dir, **kwargs)
    except FloatingPointError as err:
        return str(err)
    return "trained to the end"


@pytest.mark.parametrize(
    "what, options",
    [
        ("nan", {}),
        ("inf", {}),  # rank 1's loss is infinite but its gradients are finite
        ("ignored", {}),  # NaN loss, zero gradients: the NaN cannot travel down through the graph
        # the GradScaler sees inf/NaN at every overflow: no overflow, this
        ("nan", {"precision": "fp16"}),
        ("nan", {"grad_accum": 2}),  # in the first of two micro-batches, under no_sync
        ("inf", {"clip_grad_norm": 1.0}),  # the check reads the norm that clipping computes
    ],
)
def test_nonfinite_loss_stops_every_rank_at_the_same_step(tmp_path, what, options):
    errors = run_on_ranks(
        functools.partial(_error_of, str(tmp_path / "stop"), event=(what, 1, 5), **options), 2
    )
    for error in errors:  # both ranks raise, at the same step, knowing that it was rank 1's loss
        assert "non-finite loss on 1 rank(s) at optimizer step 5" in error


@pytest.mark.parametrize("what", ["inf", "ignored"])
def test_control_a_nonfinite_loss_with_finite_gradients_needs_the_nan_gradient(
    tmp_path, monkeypatch, what
):
    # Without the NaN put into a gradient, the all-reduced gradients look healthy and every rank
    # trains on through rank 1's non-finite loss. (run_on_ranks forks, so the children see the
    # patch.)
    monkeypatch.setattr(
        ddpkit.strategies._ddp, "nan_gradient_if_nonfinite", lambda loss, anchor, on_host: loss
    )
    out = train_on_ranks(2, tmp_path / "run", event=(what, 1, 5), epochs=1)
    assert out["step"] == 10 and out["skipped_steps"] == 0


def test_nonfinite_loss_skip_skips_the_step_everywhere(tmp_path):
    out = run_on_ranks(
        functools.partial(train, str(tmp_path / "skip"), event=("nan", 1, 5), on_nonfinite="skip"),
        2,
    )
    for rank_out in out:  # the same decision on both ranks
        assert rank_out["skipped_steps"] == 1 and rank_out["step"] == 29
        assert all(torch.isfinite(v).all() for v in rank_out["model"].values())
    assert bitwise_equal(out[0], out[1])


def test_signal_on_one_rank_saves_and_stops_all_then_resumes_bitwise(tmp_path, reference):
    # Rank 1 gets SIGUSR1 during step 6; ranks agree every 4 steps, so both save and stop after
    # step 8.
    job = functools.partial(train, str(tmp_path / "run"), event=("signal", 1, 5), log_every_steps=4)
    stopped = run_on_ranks(job, 2)
    assert [o["stopped_by"] for o in stopped] == ["signal", "signal"]
    # fit() raised ddpkit.Preempted on both ranks
    assert [o["preempted"] for o in stopped] == [75, 75]
    assert [o["step"] for o in stopped] == [8, 8]
    assert (tmp_path / "run" / "snapshots" / "step-00000008" / "complete.json").exists()
    final = train_on_ranks(2, tmp_path / "run")
    assert final["resumed_from"] == 8 and bitwise_equal(final, reference["plain"])


def _count_gradient_allreduces(counter: list[int]):
    def hook_into(trainer) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
            allreduce_hook,
        )

        def counting_hook(state, bucket):
            counter.append(1)
            return allreduce_hook(state, bucket)

        trainer.model.register_comm_hook(None, counting_hook)

    return hook_into


def _accumulation_job(run_dir: str, grad_accum: int) -> tuple[dict, int]:
    counter: list[int] = []
    out = train(
        run_dir,
        grad_accum=grad_accum,
        batchnorm=False,
        global_dropout=True,
        epochs=1,
        snapshot_every_steps=None,
        trainer_hook=_count_gradient_allreduces(counter),
    )
    return out, len(counter)


def test_gradient_accumulation_matches_a_larger_batch_and_syncs_once_per_step(tmp_path):
    # 24 samples per step either way: one micro-batch of 12 per rank, or four of 3 under no_sync.
    (big, syncs_big), _ = run_on_ranks(
        functools.partial(_accumulation_job, str(tmp_path / "a"), 1), 2
    )
    (acc, syncs_acc), _ = run_on_ranks(
        functools.partial(_accumulation_job, str(tmp_path / "b"), 4), 2
    )
    assert big["step"] == acc["step"] == 10
    assert max_rel_diff(acc, big) < 1e-5
    # gradients all-reduced once per optimizer step, not once per micro-batch
    assert syncs_acc == syncs_big


def test_bf16_trains_on_cpu(tmp_path):
    out = train_on_ranks(2, tmp_path / "bf16", precision="bf16", epochs=1)
    assert out["step"] == 10 and all(torch.isfinite(v).all() for v in out["model"].values())


def _start_scale(scale: float):
    def hook(trainer) -> None:
        # The same object the Trainer handed its snapshots, started at another scale.
        trainer.scaler.__init__("cpu", init_scale=scale)

    return hook


def test_fp16_overflow_steps_are_skipped_alike_on_every_rank_and_resume_bitwise(tmp_path):
    # A start scale of 2**20 overflows fp16 gradients: the scaler lowers it and those steps are not
    # taken, on both ranks alike, without being mistaken for a non-finite loss.
    job = functools.partial(train, precision="fp16", epochs=2, trainer_hook=_start_scale(2.0**20))
    whole = run_on_ranks(functools.partial(job, str(tmp_path / "whole")), 2)
    records = read_records(tmp_path / "whole")
    overflows = [r for r in records if r.get("event") == "fp16_overflow"]
    assert 0 < len(overflows) < 10 and whole[0]["skipped_steps"] == 0
    assert whole[0]["step"] == 20 - len(overflows) and whole[0]["scale"] < 2.0**20
    assert bitwise_equal(whole[0], whole[1])
    # Stopped and resumed, the scale and its growth tracker come back with the snapshot.
    train_on_ranks(
        2,
        tmp_path / "resumed",
        max_steps=8,
        precision="fp16",
        epochs=2,
        trainer_hook=_start_scale(2.0**20),
    )
    resumed = train_on_ranks(
        2, tmp_path / "resumed", precision="fp16", epochs=2, trainer_hook=_start_scale(2.0**20)
    )
    assert resumed["resumed_from"] == 8 and resumed["scale"] == whole[0]["scale"]
    assert bitwise_equal(resumed, whole[0])


def test_early_stopping_and_run_directory(tmp_path):
    out = train_on_ranks(
        2, tmp_path / "run", epochs=30, early_stopping_patience=1, snapshot_every_steps=None
    )
    assert out["stopped_by"] == "early_stopping" and out["epoch"] < 30
    rundir = tmp_path / "run"
    config = json.loads((rundir / "config.json").read_text())
    assert (
        config["world_size"] == 2
        and config["per_rank_batch"] == 12
        and config["early_stopping"]["patience"] == 1
    )
    kinds = [r["kind"] for r in read_records(rundir)]
    assert kinds.count("epoch") == out["epoch"]
    rows = (rundir / "epochs.csv").read_text().splitlines()
    assert rows[0].split(",")[:3] == ["epoch", "step", "lr"] and len(rows) == out["epoch"] + 1
    # a rerun resumes the finished state and trains no further
    again = train_on_ranks(
        2, tmp_path / "run", epochs=30, early_stopping_patience=1, snapshot_every_steps=None
    )
    assert again["step"] == out["step"] and bitwise_equal(again, out)


def test_tensorboard_gets_the_training_and_validation_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train_on_ranks(
        1,
        tmp_path / "run",
        epochs=2,
        early_stopping_patience=5,
        snapshot_every_steps=None,
        tensorboard=True,
    )
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    expected = {
        "train/loss",
        "lr",
        "ms_per_step",
        "samples_per_s",
        "train/epoch_loss",
        "epoch_seconds",
        "val/loss",
    }
    assert expected | {"val/accuracy"} == set(scalars)  # no events, no axes, no per-rank lists
    # one per epoch, at its last step
    assert [e.step for e in events.Scalars("val/loss")] == [10, 20]
    jsonl = read_records(tmp_path / "run")
    train = [r["train/loss"] for r in jsonl if r["kind"] == "train"]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(train)


def _stepped_names() -> list[str]:
    ddpkit.init()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    model[0].bias.requires_grad_(False)
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ["1.weight"]
    )
    optimizer = torch.optim.SGD(
        [*model[0].parameters(), *model[1].parameters(), model[2].weight], lr=0.1
    )
    wrapped = ddpkit.prepare_model(model)
    assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for p in _stepped_parameters(wrapped, optimizer)]


def test_the_step_verdict_reads_only_parameters_that_are_stepped_and_all_reduced():
    # Left out: a frozen bias, a weight DDP ignores (each rank's own gradient), one outside the
    # optimizer.
    assert run_on_ranks(_stepped_names, 1) == [["0.weight", "1.bias", "2.weight"]]


JOB = str(Path(__file__).parents[1] / "scripts" / "train_job.py")


@pytest.mark.slow
def test_a_stop_signal_exits_75_after_the_snapshot_unless_the_script_asks_for_a_return(
    tmp_path, run_python
):
    # Plain `python train_job.py` (a world of one), SIGUSR1 at step 5, agreed at the end of epoch
    # 1: uncaught Preempted.
    code = (
        f"import runpy, sys; sys.argv = {[JOB, str(tmp_path / 'run'), '--signal-at', '0', '5']!r}; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    stopped = run_python(code)
    # PREEMPTED_EXIT_CODE: "pre-empted, requeue me"
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    assert "Traceback" not in stopped.stderr
    assert "stopped by SIGUSR1 after optimizer step 10; the snapshot is saved" in stopped.stdout
    assert (tmp_path / "run" / "snapshots" / "step-00000010" / "complete.json").exists()
    # Control: asked for, fit() returns as before, and the script ends with 0 as if training were
    # complete.
    code = code.replace("'5']", "'5', '--no-raise-on-stop-signal']")
    returned = run_python(code.replace(str(tmp_path / "run"), str(tmp_path / "run2")))
    assert returned.returncode == 0, returned.stderr[-2000:]


def test_the_best_weights_are_kept_apart_and_load_outside_ddpkit(tmp_path, capfd):
    out = train_on_ranks(
        2, tmp_path / "run", epochs=30, early_stopping_patience=2, snapshot_every_steps=None
    )
    rows = [line.split(",") for line in (tmp_path / "run" / "epochs.csv").read_text().splitlines()]
    header, rows = rows[0], rows[1:]
    losses = [float(r[header.index("val/loss")]) for r in rows]
    best_epoch = 1 + losses.index(min(losses))
    assert best_epoch == out["epoch"] - 2  # two epochs without improvement, then early stopping
    # The one-liner of the README, with torch alone:
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32, bias=False),
        torch.nn.BatchNorm1d(32),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(32, 2),
    )
    model.load_state_dict(torch.load(tmp_path / "run" / "best.pt", weights_only=True)["model"])
    best = torch.load(tmp_path / "run" / "best.pt", weights_only=True)
    assert (
        best["epoch"] == best_epoch
        and best["metric"] == "val/loss"
        and best["value"] == pytest.approx(min(losses))
    )
    # They are the weights of the best epoch's end (its snapshot, still among the newest 3), not the
    # last ones.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(
        tmp_path / "run" / "snapshots" / f"step-{10 * best_epoch:08d}", tmp_path / "best_epoch.pt"
    )
    snapshot = torch.load(tmp_path / "best_epoch.pt", weights_only=True)["model"]
    assert snapshot.keys() == best["model"].keys()
    assert all(torch.equal(best["model"][k], snapshot[k]) for k in snapshot)
    assert not all(torch.equal(best["model"][k], out["model"][k]) for k in out["model"])  # control
    # The summary at the end says which epoch was best and where its weights are.
    printed = capfd.readouterr().out
    assert (
        f"best val/loss {min(losses):.4g} at epoch {best_epoch}: weights in "
        f"{tmp_path / 'run' / 'best.pt'}" in printed
    )
    assert f"done (early_stopping) after {out['epoch']} epoch(s)" in printed
    assert (
        header[:5] == ["epoch", "step", "lr", "train/epoch_loss", "val/accuracy"]
        and "epoch_seconds" in header
    )


class _Recorder:
    """Records every hook the Trainer calls; ends training after epoch 2 by setting
    ``stopped_by``."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_fit_start(self, trainer) -> None:
        self.calls.append(("fit_start", trainer.epoch, trainer.step))

    def on_step_end(self, trainer, taken: bool, output) -> None:
        self.calls.append(("step_end", trainer.step, taken))

    def on_epoch_end(self, trainer, metrics) -> None:
        self.calls.append(
            ("epoch_end", metrics["epoch"], metrics["step"], metrics["train/epoch_loss"])
        )
        if metrics["epoch"] == 2:
            trainer.stopped_by = "callback"

    def on_fit_end(self, trainer) -> None:
        self.calls.append(("fit_end", trainer.step, trainer.stopped_by))


def _hooked(run_dir: str, max_steps: int | None) -> list[tuple]:
    recorder = _Recorder()
    train(run_dir, epochs=3, max_steps=max_steps, callbacks=[recorder])
    return recorder.calls


def test_each_callback_hook_is_called_on_every_rank_in_order(tmp_path):
    calls = run_on_ranks(functools.partial(_hooked, str(tmp_path / "run"), 4), 2)
    assert calls[0] == calls[1]  # the same hooks, with the same values, on both ranks
    assert calls[0] == [
        ("fit_start", 0, 0),
        *[("step_end", s, True) for s in range(1, 5)],
        ("fit_end", 4, "max_steps"),
    ]
    # Resumed at step 4: on_fit_start sees the restored position; a callback ends training after
    # epoch 2.
    calls = run_on_ranks(functools.partial(_hooked, str(tmp_path / "run"), None), 2)
    assert calls[0] == calls[1]
    kinds = [c[0] for c in calls[0]]
    assert calls[0][0] == ("fit_start", 0, 4) and kinds.count("step_end") == 16
    epochs = [c for c in calls[0] if c[0] == "epoch_end"]
    assert [(e[1], e[2]) for e in epochs] == [(1, 10), (2, 20)] and all(e[3] > 0 for e in epochs)
    assert calls[0][-1] == ("fit_end", 20, "callback")  # not trained to epoch 3


def _signal_before_fit(trainer) -> None:
    # Rank 1 gets SIGUSR1 after the Trainer is built and before fit(): held by init(), then acted on
    # by fit().
    if trainer.runtime.rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)


def test_a_stop_signal_before_fit_is_held_and_stops_every_rank_in_fit(tmp_path):
    results = run_on_ranks(
        functools.partial(
            train, str(tmp_path / "run"), trainer_hook=_signal_before_fit, log_every_steps=4
        ),
        2,
    )
    for r in results:
        assert r["preempted"] == 75 and r["stopped_by"] == "signal"
        assert r["step"] == 4  # the first agreement spread rank 1's held signal


class _SignalAfterTheLastAgreement:
    """SIGUSR1 to rank 1 at the end of the last epoch: after the ranks' last agreement, too late to
    stop."""

    def on_epoch_end(self, trainer, metrics) -> None:
        if trainer.runtime.rank == 1 and trainer.epoch == trainer.config.epochs:
            os.kill(os.getpid(), signal.SIGUSR1)


def _train_then_pending(run_dir: str) -> tuple[str, str | None]:
    from ddpkit.distributed import _signals as signals

    out = train(run_dir, epochs=2, callbacks=(_SignalAfterTheLastAgreement(),))
    pending = signals.pending_stop_signal()
    return out["stopped_by"], None if pending is None else pending.name


def test_a_stop_signal_after_the_last_agreement_is_passed_on_not_lost(tmp_path, monkeypatch):
    """Training ends as planned on both ranks, and rank 1's signal is held for what runs next (a
    search's next candidate stops at once; a SIGTERM ends the process). Control: with nothing passed
    on, it is lost."""
    results = run_on_ranks(functools.partial(_train_then_pending, str(tmp_path / "run")), 2)
    assert results == [("epochs", None), ("epochs", "SIGUSR1")]
    from ddpkit.distributed import _signals as signals

    # fork: the children get the patched module
    monkeypatch.setattr(signals, "pass_on", lambda signum: None)
    lost = run_on_ranks(functools.partial(_train_then_pending, str(tmp_path / "control")), 2)
    assert lost == [("epochs", None), ("epochs", None)]
