"""Ranks that part ways, with real jobs (``disagree_job.py``): two ranks waiting in one collective
under different ops are named in seconds, and a rank that leaves the job with exit code 0 is said
before the failure of the rank it left behind.

Each has its control: ranks held in the same op are left to the collective timeout, and a job whose
ranks all exit 0 at its end is a success with no such line.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.testing import run_job
from tests.jobs.conftest import clean_environ

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and /dev/shm"),
]

JOB = str(Path(__file__).with_name("disagree_job.py"))


def _run(tmp_path: Path, mode: str, *launcher: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in clean_environ().items() if not k.startswith("DDPKIT_STALL")}
    start = time.monotonic()
    out = run_job(
        JOB, mode, launcher_args=launcher, env=env | {"PYTHONUNBUFFERED": "1"}, cwd=tmp_path,
        timeout=180,
    )  # fmt: skip
    return out, time.monotonic() - start


def test_ranks_in_one_collective_under_different_ops_are_named_in_seconds(tmp_path):
    out, _ = _run(tmp_path, "barrier", "--stall-timeout", "3", "--collective-timeout", "60")
    assert out.returncode != 0, out.stderr[-3000:]
    said = "ranks disagree on collective #5: rank 0 in all_reduce, rank 1 in barrier: a collective"
    assert f"ddpkit run: {said}" in out.stderr, out.stderr[-3000:]
    summary = out.stderr[out.stderr.rindex("worker(s) failed") :]
    assert "first: rank 1" in summary and "ended by the stall watch" in summary, summary
    assert said in summary, summary
    # named at the 3 s floor: the stall watch ended it, not the 60 s collective timeout


def test_ranks_held_in_the_same_op_are_left_to_the_collective_timeout(tmp_path):
    # Control: rank 1 held (asleep) inside all_reduce #5, rank 0 waiting in the same one: nothing
    # says which is the cause. The summary says the collective each was in, though rank 0's failed.
    out, took = _run(tmp_path, "held", "--stall-timeout", "3", "--collective-timeout", "10")
    assert out.returncode != 0, out.stderr[-3000:]
    assert "stalled:" not in out.stderr and "ranks disagree" not in out.stderr, out.stderr[-3000:]
    assert took >= 10, (took, out.stderr[-3000:])
    where = next(line for line in out.stderr.splitlines() if "where each rank was" in line)
    assert "rank 0 at step 5, in collective all_reduce #5" in where, where
    assert "rank 1 at step 5, in collective all_reduce #5" in where, where


def test_a_rank_that_exits_0_early_is_said_before_the_survivors_failure(tmp_path):
    out, _ = _run(tmp_path, "exit", "--stall-timeout", "3", "--collective-timeout", "60")
    assert out.returncode == 1, out.stderr[-3000:]
    summary = out.stderr[out.stderr.index("left the job") - 60 :]
    assert (
        "ddpkit run: rank 1 (local rank 1, pid" in summary
        and "left the job with exit code 0 at step 5 while the others went on; rank 0 then failed"
        in summary
    ), summary
    assert summary.index("left the job") < summary.index("worker(s) failed; first: rank 0"), summary
    # Control: every rank trains to its end and exits 0.
    (tmp_path / "none").mkdir()
    out, _ = _run(tmp_path / "none", "none", "--stall-timeout", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank 0 done after 12 steps" in out.stdout and "left the job" not in out.stderr


def test_a_rank_stopped_inside_the_collective_the_others_wait_in_is_named_at_once(tmp_path):
    # A stopped rank cannot progress wherever it is: the one evidence that needs no allowance.
    # Its control is the test above: the same rank held there, not stopped, is left alone.
    out, _ = _run(tmp_path, "stopped", "--stall-timeout", "3", "--collective-timeout", "60")
    assert out.returncode != 0, out.stderr[-3000:]
    named = next(line for line in out.stderr.splitlines() if "stalled:" in line)
    assert "rank 1 stalled" in named and "stopped (SIGSTOP)" in named, named
    assert "in collective all_reduce #5" in named, named
    summary = out.stderr[out.stderr.rindex("worker(s) failed") :]
    assert "ended by the stall watch" in summary, summary  # not by the 60 s collective timeout
