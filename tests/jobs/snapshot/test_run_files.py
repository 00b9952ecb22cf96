"""A training job's run directory: a link in it is refused on every rank, and ``resume=False`` moves
the previous run's records aside with its snapshots."""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import pytest

from ddpkit.snapshot._disk import MARKER
from ddpkit.testing import read_records, run_on_ranks
from tests.jobs.scripts.train_job import train

VICTIM_TEXT = "a file of someone else's, outside the run directory\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the run directory that a link inside it points to; it must never change."""
    path = tmp_path / "elsewhere" / "victim.txt"
    path.parent.mkdir()
    path.write_text(VICTIM_TEXT)
    return path


def link(run_dir: Path, name: str, target: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / name).symlink_to(target)
    return run_dir / name


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [".lock", "metrics.jsonl", "epochs.csv", "config.json", "snapshots"]
)
def test_a_training_job_with_a_link_in_its_run_dir_is_refused_on_every_rank(tmp_path, victim, name):
    run_dir = tmp_path / "run"
    link(run_dir, name, victim.parent if name == "snapshots" else victim)
    with pytest.raises(Exception, match=f"{name}' is a symbolic link"):
        run_on_ranks(functools.partial(train, str(run_dir), max_steps=2, epochs=1), 2)
    assert victim.read_text() == VICTIM_TEXT and os.listdir(victim.parent) == ["victim.txt"]
    # Control: without the link the same job trains and writes its files in the run directory.
    (run_dir / name).unlink()
    assert (
        run_on_ranks(functools.partial(train, str(run_dir), max_steps=2, epochs=1), 2)[0]["step"]
        == 2
    )
    assert (run_dir / "metrics.jsonl").is_file() and (
        run_dir / "snapshots" / "step-00000002"
    ).is_dir()


@pytest.mark.slow
def test_resume_false_moves_the_previous_runs_records_aside_with_its_snapshots(tmp_path, capfd):
    run_dir = tmp_path / "run"
    # Two steps make an epoch of 48 samples: the run writes every record (metrics, epochs.csv,
    # best.pt).
    job = functools.partial(
        train, str(run_dir), n_samples=48, epochs=1, early_stopping_patience=5, log_every_steps=1
    )
    run_on_ranks(job, 1)
    first = read_records(run_dir)
    run_on_ranks(functools.partial(job, lr=0.5, resume=False), 1)
    out = capfd.readouterr().out
    (aside,) = [p for p in run_dir.iterdir() if p.name.startswith("replaced-")]
    moved = (
        "snapshots, best.pt, best.safetensors, final.safetensors, metrics.jsonl, epochs.csv, "
        "config.json"
    )
    assert (
        f"ddpkit: resume=False: the previous run's {moved} moved to {aside}; this run starts them "
        "afresh" in out
    )
    # The new run's records start afresh: one start, each step once; the old ones are whole in the
    # aside folder.
    records = read_records(run_dir)
    assert [
        r["event"] for r in records if r["kind"] == "event" and r["event"] in ("start", "resume")
    ] == ["start"]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    assert read_records(aside) == first
    # header and this run's one epoch
    assert len((run_dir / "epochs.csv").read_text().splitlines()) == 2
    assert len((aside / "epochs.csv").read_text().splitlines()) == 2
    assert json.loads((run_dir / "config.json").read_text())["resume"] is False
    assert json.loads((aside / "config.json").read_text())["resume"] is True
    assert (aside / "best.pt").is_file() and (
        aside / "snapshots" / "step-00000002" / MARKER
    ).is_file()
    # The aside folder has a run directory's layout: `ddpkit plot` reads it as one.
    from ddpkit.tracking._curves import read_curves

    assert sorted(read_curves(aside)["train/loss"]) == [1, 2]
