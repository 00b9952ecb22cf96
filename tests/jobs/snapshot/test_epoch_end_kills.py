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

from ddpkit._launch.agent import jobdir
from ddpkit.testing import run_job
from tests.jobs.scripts.epoch_end_job import EPOCHS, write_records

JOB = Path(__file__).parents[1] / "scripts" / "epoch_end_job.py"
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


@pytest.fixture
def env(clean_env, tmp_path) -> dict[str, str]:
    (tmp_path / "shm").mkdir()
    return clean_env | {jobdir.ROOT_ENV: str(tmp_path / "shm")}


def run(tmp: Path, env: dict, name: str, variant: str, kills: str = "", *control: str) -> Path:
    records = tmp / "records.jsonl"
    if variant == "stream" and not records.exists():
        write_records(records)
    args = [str(tmp / name), str(tmp / f"{name}.out"), "--variant", variant, "--kills", kills]
    args += ["--records", str(records), *(("--control", *control) if control else ())]
    restarts = ("--max-restarts", str(len(kills.split(",")) if kills else 0))
    done = run_job(JOB, *args, launcher_args=restarts, env=env, cwd=tmp, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return tmp / name


def finals(tmp: Path, name: str) -> list[dict]:
    return [torch.load(f"{tmp / name}.out.rank{r}", weights_only=False) for r in range(2)]


def same_bits(a: dict, b: dict) -> bool:
    model = a["model"].keys() == b["model"].keys() and all(
        torch.equal(a["model"][k], b["model"][k]) for k in a["model"]
    )
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    optimizer = sa.keys() == sb.keys() and all(
        torch.equal(torch.as_tensor(sa[i][k]), torch.as_tensor(sb[i][k])) for i in sa for k in sa[i]
    )
    return model and optimizer and a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


def records(run_dir: Path) -> list[dict]:
    """What the run recorded, less its events and what varies from run to run."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {k: v for k, v in r.items() if k not in VARYING}
        for r in map(json.loads, lines)
        if r["kind"] not in ("event", "ranks")
    ]


def events(run_dir: Path, name: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == name]


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param("trainer", marks=pytest.mark.heavy),
        *(pytest.param(v, marks=pytest.mark.slow) for v in ("stream", "step_fn", "hand")),
    ],
)
def test_a_kill_at_each_boundary_of_an_epochs_end_resumes_to_the_uninterrupted_run(
    tmp_path, env, variant
):
    kills = KILLS[variant]
    killed = run(tmp_path, env, "killed", variant, kills)
    reference = run(tmp_path, env, "reference", variant)
    got, want = finals(tmp_path, "killed"), finals(tmp_path, "reference")
    assert [g["attempt"] for g in got] == [len(kills.split(","))] * 2  # every kill landed
    for rank, (g, w) in enumerate(zip(got, want)):
        assert same_bits(g, w), f"rank {rank}: not the uninterrupted run's weights and optimizer"
        # each hook as often as in the uninterrupted run: none skipped by a resume, none run twice
        assert g["hooks"] == w["hooks"], f"rank {rank}"
        assert g["step"] == w["step"]
    if variant == "hand":  # its records are the script's own
        return
    assert records(killed) == records(reference)
    epochs = [r["epoch"] for r in records(killed) if r["kind"] == "epoch"]
    assert epochs == list(range(1, EPOCHS + 1))  # each epoch's records (its validation's) once
    resumes = events(killed, "resume")
    assert len(resumes) == len(kills.split(","))
    # the killed attempts' records past the copy each resumed from were kept, in the other file
    assert sum(r["rewound_records"] for r in resumes) > 0
    assert (killed / "metrics.rewound.jsonl").exists()
    # the first kill, in the epoch's last step's on_step_end, resumed from the step before it
    assert resumes[0]["step"] == 4 and resumes[0]["epoch"] == 0


@pytest.mark.slow
def test_control_snapshots_taken_before_the_epochs_callbacks_resume_past_a_hook(tmp_path, env):
    run(tmp_path, env, "killed", "trainer", "last_step,on_epoch_end", "snapshot-first")
    run(tmp_path, env, "reference", "trainer")
    got, want = finals(tmp_path, "killed"), finals(tmp_path, "reference")
    # rank 1 died inside epoch 2's on_epoch_end, after the epoch's snapshots: the resume skipped it
    assert got[1]["hooks"]["epoch"] == want[1]["hooks"]["epoch"] - 1


@pytest.mark.slow
def test_control_records_not_rewound_hold_an_epoch_twice(tmp_path, env):
    killed = run(tmp_path, env, "killed", "trainer", "last_step,on_epoch_end", "no-rewind")
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
    resume = events(tmp_path / "run", "resume")[0]
    assert (resume["epoch"], resume["step"], resume["cursor"]) == (0, 5, 100), saved
