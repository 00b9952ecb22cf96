"""A run directory belongs to one job at a time, and resumes only the run that wrote it (real gloo
jobs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from ddpkit.testing import run_job, start_job, wait_job, wait_until
from tests.jobs.scripts.train_job import train_on_ranks

LOCK_JOB = str(Path(__file__).parents[1] / "scripts" / "lock_job.py")


def refusal(world: int, run_dir: Path, **kwargs) -> str:
    """The error message of a run that must be refused (the rank's traceback, as spawn reports
    it)."""
    with pytest.raises(Exception) as refused:
        train_on_ranks(world, run_dir, **kwargs)
    return str(refused.value)


def test_a_rerun_with_another_lr_model_or_config_is_refused_naming_what_differs(tmp_path):
    # The reported case: lr 0.1, then lr 0.5 on the same run directory "resumed" the first run.
    first = train_on_ranks(2, tmp_path / "run", lr=0.1, max_steps=4)
    message = refusal(2, tmp_path / "run", lr=0.5)
    assert (
        "ConfigError" in message
        and "step-00000004 was taken by a run with another config" in message
    )
    assert "optimizer param group 0 lr: 0.1 in the snapshot, 0.5 now" in message
    assert "new run_dir" in message and "resume=False" in message and "epochs, " in message
    # A resized layer: named, instead of torch's raw "size mismatch".
    message = refusal(2, tmp_path / "run", lr=0.1, hidden=48)
    assert "model 0.weight: (32, 8) float32 in the snapshot, (48, 8) float32 now" in message
    assert "size mismatch" not in message
    message = refusal(2, tmp_path / "run", lr=0.1, seed=3)
    assert "TrainerConfig.seed: 0 in the snapshot, 3 now" in message
    # Control: the same lr resumes, though the job's StepLR had moved the snapshot's lr away from it
    # (the lr compared is the one asked for), and a resume may change max_steps.
    assert first["optimizer"]["param_groups"][0]["lr"] != 0.1
    again = train_on_ranks(2, tmp_path / "run", lr=0.1, max_steps=6)
    assert again["resumed_from"] == 4 and again["step"] == 6


def test_resume_false_starts_afresh_and_moves_the_old_snapshots_aside(tmp_path):
    train_on_ranks(2, tmp_path / "run", lr=0.1, max_steps=20)
    fresh = train_on_ranks(2, tmp_path / "run", lr=0.5, max_steps=6, resume=False)
    assert fresh["resumed_from"] is None and fresh["step"] == 6
    aside = [p for p in (tmp_path / "run").iterdir() if p.name.startswith("replaced-")]
    assert len(aside) == 1 and (aside[0] / "snapshots" / "step-00000020" / "complete.json").exists()
    # What is left to resume is this run's: a rerun with lr 0.5 resumes it at step 6, not the old
    # step 20.
    assert train_on_ranks(2, tmp_path / "run", lr=0.5, max_steps=8)["resumed_from"] == 6


def _start_holder(tmp_path: Path, run_dir: Path, env: dict) -> tuple[subprocess.Popen, dict]:
    ready, go = tmp_path / "ready", tmp_path / "go"
    ready.unlink(missing_ok=True)
    go.unlink(missing_ok=True)
    holder = start_job(LOCK_JOB, str(run_dir), "--hold", str(ready), str(go), env=env)

    def began() -> str:  # the holder's rank 0 says when fit() has begun
        assert holder.poll() is None, holder.communicate()[1][-3000:]
        return ready.read_text() if ready.exists() else ""

    wait_until(began, 90, what="the holding job to start")
    return holder, json.loads(ready.read_text())


@pytest.mark.slow
def test_a_second_job_on_a_run_dir_in_use_is_refused_and_a_killed_job_leaves_no_lock(
    tmp_path, clean_env
):
    run_dir = tmp_path / "run"
    holder, who = _start_holder(tmp_path, run_dir, clean_env)
    try:
        second = run_job(LOCK_JOB, str(run_dir), env=clean_env, timeout=120)
        assert second.returncode != 0
        assert f"is in use by another job (host {who['host']}, pid {who['pid']}" in second.stderr
        assert "trained to step" not in second.stdout
        os.kill(who["pid"], signal.SIGKILL)  # the rank holding the lock dies: it runs no clean-up
        held = wait_job(holder, 120, run_dir=run_dir)  # the agent sees it and stops the other rank
        assert held.returncode != 0
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
            holder.wait()
    # Only the holder had written records; the refused job wrote none.
    assert [e["event"] for e in held.events()] == ["start"]
    # The kernel dropped the dead job's lock: the next job takes it at once and trains.
    assert (run_dir / ".lock").exists()
    after = run_job(LOCK_JOB, str(run_dir), env=clean_env, timeout=120)
    assert after.returncode == 0, after.stderr[-3000:]
    assert "trained to step 8" in after.stdout
