"""A run killed at every boundary of an epoch's end (after the epoch's last step, in its
validation, in ``on_validation_end``, in ``on_epoch_end``, inside its disk snapshot, and after it)
resumes to the state an uninterrupted run passes through: each run below takes one kill at each
boundary, one epoch after another, under ``ddpkit run --max-restarts``, and ends bitwise where the
uninterrupted run ends, every hook of every rank run as often, and ``metrics.jsonl`` holding each
epoch's records once (the records a killed attempt wrote after the copy it resumed from moved to
``metrics.rewound.jsonl``).

Variants: the Trainer with copies in memory (an epoch whose last global batch is partial), the
same on a stream, a step function with disk snapshots, a hand loop with
``ddpkit.Snapshots(memory=True)``. Controls: the epoch's snapshots taken before its callbacks (a
kill in ``on_epoch_end`` then resumes past a hook that never ran), and the records not rewound (an
epoch's records twice)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddpkit.testing import Job, read_records
from tests.jobs.scripts.epoch_end_job import EPOCHS, finals, under_launcher
from tests.trainer_checks import same_bits

EVERY = "last_step,validation,on_validation_end,on_epoch_end,disk_write,after_end"
KILLS = {
    "trainer": EVERY,
    "stream": EVERY,
    # its step function variant is given no validation data
    "step_fn": "last_step,on_epoch_end,disk_write,after_end",
    # its disk save due at the epoch's end is deferred to the next step: epoch 3's is (step 15)
    "hand": "last_step,validation,disk_write,on_epoch_end,after_end",
}
# Kept, a run's own: each varies (times, the speed a window measured, the process's start).
VARYING = {"time", "ms_per_step", "samples_per_s", "epoch_seconds", "restart_count"}


def records(job: Job) -> list[dict]:
    """What the run recorded, less its events and what varies from run to run."""
    return [
        {k: v for k, v in r.items() if k not in VARYING}
        for r in job.records
        if r["kind"] not in ("event", "ranks")
    ]


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param("trainer", marks=pytest.mark.heavy),
        *(pytest.param(v, marks=pytest.mark.slow) for v in ("stream", "step_fn", "hand")),
    ],
)
def test_a_kill_at_each_boundary_of_an_epochs_end_resumes_to_the_uninterrupted_run(
    tmp_path, memory_env, epoch_end_references, variant
):
    kills = KILLS[variant]
    killed = under_launcher(tmp_path, memory_env, "killed", variant, kills)
    reference = epoch_end_references(variant)
    got, want = finals(killed), finals(reference)
    assert [g["attempt"] for g in got] == [len(kills.split(","))] * 2  # every kill landed
    for rank, (g, w) in enumerate(zip(got, want)):
        assert same_bits(g, w, "model", "optimizer"), (
            f"rank {rank}: not the uninterrupted run's weights and optimizer"
        )
        # each hook as often as in the uninterrupted run: none skipped by a resume, none run twice
        assert g["hooks"] == w["hooks"], f"rank {rank}"
        assert g["step"] == w["step"]
    if variant == "hand":  # its records are the script's own
        return
    assert records(killed) == records(reference)
    epochs = [r["epoch"] for r in records(killed) if r["kind"] == "epoch"]
    assert epochs == list(range(1, EPOCHS + 1))  # each epoch's records (its validation's) once
    resumes = killed.events("resume")
    assert len(resumes) == len(kills.split(","))
    # the killed attempts' records past the copy each resumed from were kept, in the other file
    assert sum(r["rewound_records"] for r in resumes) > 0
    assert (killed.run_dir / "metrics.rewound.jsonl").exists()
    # the first kill, in the epoch's last step's on_step_end, resumed from the step before it
    assert resumes[0]["step"] == 4 and resumes[0]["epoch"] == 0


@pytest.mark.slow
def test_control_snapshots_taken_before_the_epochs_callbacks_resume_past_a_hook(
    tmp_path, memory_env, epoch_end_references
):
    kills = "last_step,on_epoch_end"
    killed = under_launcher(tmp_path, memory_env, "killed", "trainer", kills, "snapshot-first")
    got, want = finals(killed), finals(epoch_end_references("trainer"))
    # rank 1 died inside epoch 2's on_epoch_end, after the epoch's snapshots: the resume skipped it
    assert got[1]["hooks"]["epoch"] == want[1]["hooks"]["epoch"] - 1


@pytest.mark.slow
def test_control_records_not_rewound_hold_an_epoch_twice(tmp_path, memory_env):
    kills = "last_step,on_epoch_end"
    killed = under_launcher(tmp_path, memory_env, "killed", "trainer", kills, "no-rewind")
    epochs = [r["epoch"] for r in records(killed) if r["kind"] == "epoch"]
    assert epochs.count(2) == 2 and len(epochs) == EPOCHS + 1


class _SaveAtTheLastStepThenFail:
    """A script's own ``trainer.save()`` in the epoch's last step (its position: the epoch's end,
    not yet handled), then a failure in that epoch's ``on_epoch_end``."""

    def __init__(self) -> None:
        self.fail = True

    def on_step_end(self, trainer, taken, output) -> None:
        if trainer.cursor == trainer.sampler.num_samples and trainer.epoch == 0:
            trainer.save()

    def on_epoch_end(self, trainer, metrics) -> None:
        if self.fail:
            raise RuntimeError("failed in on_epoch_end")


def _fit(run_dir: Path, callbacks: list, epochs: int = 2) -> dict:
    import torch.nn.functional as F

    from ddpkit import SnapshotConfig, Trainer, TrainerConfig
    from tests.jobs.scripts.epoch_end_job import GLOBAL_BATCH, Data, build_model

    model = build_model()
    config = TrainerConfig(
        run_dir=str(run_dir), epochs=epochs, global_batch_size=GLOBAL_BATCH, drop_last=False,
        resume=True, snapshot=SnapshotConfig(every_epochs=0, async_write=False),
    )  # fmt: skip
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), Data(), config,
        loss_fn=F.cross_entropy, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit()
    return {"model": model.state_dict(), "position": trainer.state.position}


def test_a_snapshot_at_an_epochs_partial_last_batch_resumes_into_the_epochs_end(tmp_path):
    reference = _fit(tmp_path / "reference", [])
    failing = _SaveAtTheLastStepThenFail()
    with pytest.raises(RuntimeError, match="on_epoch_end"):
        _fit(tmp_path / "run", [failing])
    saved = json.loads(next((tmp_path / "run" / "snapshots").glob("*/complete.json")).read_text())
    failing.fail = False
    got = _fit(tmp_path / "run", [failing])  # resumes at (epoch 0, step 5, cursor 100)
    assert got["position"] == reference["position"] == (2, 10, 0)
    assert all(torch.equal(got["model"][k], v) for k, v in reference["model"].items())
    # the case under test: the snapshot's cursor is past the epoch's last, partial global batch
    resume = [r for r in read_records(tmp_path / "run") if r.get("event") == "resume"][0]
    assert (resume["epoch"], resume["step"], resume["cursor"]) == (0, 5, 100), saved
