"""The Trainer's decisions in one process: when snapshots are written, why fit() ended, a
metric-driven LR scheduler, whether a restart resumes, and global-batch dropout on sequence-first
tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit._errors import ConfigError
from ddpkit.nn._dropout import BatchLayout, GlobalBatchDropout, batch_layout, convert_dropout
from ddpkit.training._config import EarlyStoppingConfig, LoggingConfig, SnapshotConfig
from ddpkit.training._step import StopReason
from ddpkit.training._trainer import TrainerConfig


def _trainer(
    run_dir: Path,
    *,
    samples: int = 32,
    val: bool = False,
    scheduler=None,
    lr: float = 0.1,
    **options,
):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(samples, 4)
    data = torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    options.setdefault("logging", LoggingConfig(progress=False))
    config = TrainerConfig(run_dir=str(run_dir), batch_size=4, num_workers=0, **options)
    return ddpkit.Trainer(
        model,
        optimizer,
        data,
        config,
        val_data=data if val else None,
        scheduler=scheduler(optimizer) if scheduler is not None else None,
    )


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _expected_snapshot_steps(every_steps, every_epochs, steps_per_epoch, epochs) -> list[int]:
    """Brute force: each step after which a snapshot must exist, so that a failure loses no more
    than asked."""
    total = steps_per_epoch * epochs
    due = set()
    for step in range(1, total + 1):
        if every_steps and step % every_steps == 0:
            due.add(step)
        if (
            step % steps_per_epoch == 0
            and every_epochs
            and (step // steps_per_epoch) % every_epochs == 0
        ):
            due.add(step)
    if every_steps or every_epochs:
        due.add(total)  # where training ends: a rerun finds it finished
    return sorted(due)


@pytest.mark.parametrize(
    "every_steps, every_epochs, steps_per_epoch, epochs",
    [
        (4, 3, 4, 4),  # every step snapshot falls on an epoch end that every_epochs leaves out
        (4, 100, 8, 2),  # steps 8 and 16 are epoch ends
        (3, 2, 4, 4),
        (2, 1, 4, 2),
        (None, 2, 3, 5),
        (5, 0, 4, 3),  # epoch ends off: the steps' interval alone
        (None, 0, 3, 2),  # snapshots off
    ],
)
def test_snapshots_exist_after_every_step_the_intervals_name(
    tmp_path, every_steps, every_epochs, steps_per_epoch, epochs
):
    snapshot = SnapshotConfig(every_steps=every_steps, every_epochs=every_epochs, async_write=False)
    trainer = _trainer(tmp_path, samples=4 * steps_per_epoch, epochs=epochs, snapshot=snapshot)
    trainer.fit()
    written = [r["step"] for r in _records(tmp_path) if r.get("event") == "snapshot"]
    assert written == _expected_snapshot_steps(every_steps, every_epochs, steps_per_epoch, epochs)


def test_the_schedule_defers_an_epochs_last_step_to_its_end():
    from ddpkit.snapshot._state import SnapshotSchedule

    schedule = SnapshotSchedule(every_steps=4, every_epochs=3)
    assert not schedule.after_step(4, taken=True, last_in_epoch=True)  # the epoch end takes it
    assert schedule.at_epoch_end(1, 4, last_step_taken=True, stopping=False)
    # a skipped step: step 4 is saved
    assert not schedule.at_epoch_end(1, 4, last_step_taken=False, stopping=False)
    assert schedule.after_step(4, taken=True, last_in_epoch=False) and not schedule.after_step(
        4, False, False
    )
    assert schedule.new_position((0, 4, 16))
    schedule.written((0, 4, 16))
    assert not schedule.new_position((0, 4, 16))


def test_stopped_by_says_epochs_after_a_run_that_trained_its_epochs(tmp_path):
    trainer = _trainer(tmp_path, epochs=2)
    trainer.fit()
    assert trainer.stopped_by == StopReason.EPOCHS and trainer.epoch == 2
    again = _trainer(tmp_path, epochs=2)  # resumed finished: nothing to train, and the same answer
    again.fit()
    assert again.stopped_by == StopReason.EPOCHS and again.step == trainer.step


def _plateau(optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)


def test_a_metric_driven_scheduler_steps_on_the_validation_metric_and_resumes(tmp_path):
    # lr=1e-7: the weights barely move, so val/loss plateaus and the lr halves at each epoch end
    # after the first.
    options = dict(
        val=True,
        scheduler=_plateau,
        lr=1e-7,
        early_stopping=EarlyStoppingConfig(metric="val/loss", patience=None),
    )
    whole = _trainer(tmp_path / "whole", epochs=4, **options)
    whole.fit()
    lrs = [r["lr"] for r in _records(tmp_path / "whole") if r["kind"] == "epoch"]
    assert whole.optimizer.param_groups[0]["lr"] == pytest.approx(1e-7 / 8)
    # each epoch's lr (read before its validation)
    assert lrs == pytest.approx([1e-7, 1e-7, 1e-7 / 2, 1e-7 / 4])
    # Stopped after epoch 2 and resumed: the scheduler's count and best come back with the snapshot.
    _trainer(tmp_path / "resumed", epochs=4, max_steps=16, **options).fit()
    resumed = _trainer(tmp_path / "resumed", epochs=4, **options)
    resumed.fit()
    assert resumed.resumed_from == 16
    assert resumed.scheduler.state_dict() == whole.scheduler.state_dict()
    assert resumed.optimizer.param_groups[0]["lr"] == whole.optimizer.param_groups[0]["lr"]


def test_a_metric_driven_scheduler_without_its_metric_is_refused_at_construction(tmp_path):
    with pytest.raises(
        ConfigError, match="ReduceLROnPlateau steps on a validation metric: pass .*val_data"
    ):
        _trainer(tmp_path, scheduler=_plateau)
    with pytest.raises(ConfigError, match="EarlyStoppingConfig\\(metric="):
        _trainer(tmp_path, scheduler=_plateau, val=True)


def test_a_restart_resumes_even_when_the_config_says_resume_false():
    from ddpkit.training._trainer import resumes

    assert not resumes(False, 0)  # the job's first attempt starts afresh, as asked
    assert resumes(False, 1) and resumes(False, 3)  # a restarted worker continues its own job
    assert resumes(True, 0) and resumes(True, 2)


def _dropout_outputs(
    layer: GlobalBatchDropout, x: torch.Tensor, parts: list[int], dim: int
) -> torch.Tensor:
    """The layer's output on ``x``'s global batch split over ``len(parts)`` ranks, joined again."""
    outs, offset = [], 0
    for n in parts:
        with batch_layout(BatchLayout(sum(parts), offset, key=7, size=n)):
            outs.append(layer(x.narrow(dim, offset, n)))
        offset += n
    return torch.cat(outs, dim)


def test_global_batch_dropout_takes_sequence_first_tensors_at_batch_dim_1_and_refuses_a_wrong_dim():
    seq_first = torch.ones(5, 6, 3)  # (seq, batch, features), batch 6
    layer = GlobalBatchDropout(0.5, batch_dim=1)
    one = _dropout_outputs(layer, seq_first, [6], 1)
    assert torch.equal(_dropout_outputs(layer, seq_first, [3, 3], 1), one)  # world-size independent
    assert torch.equal(_dropout_outputs(layer, seq_first, [2, 2, 2], 1), one)
    # Each sample's mask varies along the sequence: a mask per (position, sample, feature), not one
    # per sample.
    assert not torch.equal(one[0], one[1])
    # Batch-first, the default, on the sequence-first tensor: its size at dim 0 (5) is not the 3
    # samples.
    with pytest.raises(
        ConfigError,
        match=r"size at batch_dim=0 is 5, where this rank's micro-batch has 3 .*batch_dim=1",
    ):
        _dropout_outputs(GlobalBatchDropout(0.5), seq_first, [3, 3], 1)
    # convert_dropout passes batch_dim on; layers already converted keep theirs, with layer ids of
    # their own.
    model = convert_dropout(
        nn.Sequential(GlobalBatchDropout(0.1, layer_id=0, batch_dim=1), nn.Dropout(0.2)), 1
    )
    assert [(m.layer_id, m.batch_dim) for m in model] == [(0, 1), (1, 1)]


def test_global_batch_dropout_masks_are_the_samples_whatever_the_padding_and_pinned():
    # Samples 2-4 of a global batch of 6, padded to 6 positions and to 4: the same masks where both
    # have the position (an element's draw hangs on its sample's place and its coordinates only).
    x = torch.ones(3, 6, 2)
    with batch_layout(BatchLayout(6, 2, key=3, size=3)):
        long = GlobalBatchDropout(0.5, layer_id=1)(x)
    with batch_layout(BatchLayout(6, 2, key=3, size=3)):
        short = GlobalBatchDropout(0.5, layer_id=1)(x[:, :4])
    assert torch.equal(long[:, :4], short)
    # The masks are part of a run's bits (a resume across versions draws them again): pinned.
    assert (long[0] > 0).int().flatten().tolist() == [1, 1, 1, 1, 1, 1, 0, 1, 1, 0, 0, 0]
    assert (long[2] > 0).int().flatten().tolist() == [1, 0, 0, 0, 1, 0, 1, 0, 0, 0, 0, 0]


class _Notice:
    """A launcher's pre-emption notice given at its ``at``-th asking (as Ray's, which every rank
    asks alike)."""

    def __init__(self, at: int) -> None:
        self.at, self.asked = at, 0

    def __call__(self) -> str | None:
        self.asked += 1
        return "node b is reclaimed" if self.asked >= self.at else None


@pytest.mark.parametrize(
    "every_epochs, at, snapshots",
    [
        # asked at steps 2, 4, 6: a snapshot after step 6, none other (the intervals are off)
        (0, 3, [6]),
        (0, 2, [4]),  # at an epoch's last step: the epoch's end takes it
        # at a step already due: one snapshot there, and no snapshot after every step since
        (1, 2, [4, 8, 12]),
    ],
)
def test_a_preemption_notice_snapshots_at_once_and_training_goes_on(
    tmp_path, monkeypatch, every_epochs, at, snapshots
):
    notice = _Notice(at)
    monkeypatch.setattr(
        "ddpkit.distributed._signals.preemption_notice", lambda launcher, group=None: notice
    )
    snapshot = SnapshotConfig(every_epochs=every_epochs, async_write=False)
    logging = LoggingConfig(progress=False, every_steps=2)
    trainer = _trainer(tmp_path, samples=16, epochs=3, snapshot=snapshot, logging=logging)
    trainer.fit()
    records = _records(tmp_path)
    assert [r["step"] for r in records if r.get("event") == "snapshot"] == snapshots
    assert [(r["step"], r["notice"]) for r in records if r.get("event") == "preemption_notice"] == [
        (2 * at, "node b is reclaimed")
    ]
    assert notice.asked == at and trainer.stopped_by == StopReason.EPOCHS and trainer.step == 12


def test_only_ray_gives_a_notice_to_ask_for_and_only_for_the_whole_job(monkeypatch):
    import sys
    import types

    from ddpkit.distributed._signals import preemption_notice

    assert preemption_notice("torchrun") is None and preemption_notice("slurm") is None
    ray = types.ModuleType("ray")
    ray.train = types.ModuleType("ray.train")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", ray)
    monkeypatch.setitem(sys.modules, "ray.train", ray.train)  # type: ignore[attr-defined]
    assert preemption_notice("ray") is None  # a Ray before 2.60: nothing to ask
    info = types.SimpleNamespace(preempted_node_ids=["a3f0c9e1d2b4"], preempted_ranks=[1])
    answers = iter([None, info])
    ray.train.get_preemption_info = lambda: next(answers)  # type: ignore[attr-defined]
    # a group of split_world: the other groups never ask
    assert preemption_notice("ray", group=object()) is None
    notice = preemption_notice("ray")
    assert notice is not None and notice() is None
    assert notice() == "Ray Train's pre-emption notice (node a3f0c9e1, ranks [1])"
