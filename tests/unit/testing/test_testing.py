"""ddpkit.testing's helpers that need no ranks: waiting for a condition with a deadline, the
environment a job started from inside another gets, and what a :class:`~ddpkit.testing.Job` reads
of a run."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

import ddpkit.testing
from ddpkit.testing import LAUNCH_VARIABLES, wait_until, without_launch_env


def _true_on_call(n: int, value: object = "ready"):
    calls = []

    def predicate():
        calls.append(None)
        return value if len(calls) >= n else None

    return predicate, calls


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The pauses wait_until asks for, each still taken."""
    asked: list[float] = []
    sleep = time.sleep

    def recorded(seconds: float) -> None:
        asked.append(seconds)
        sleep(seconds)

    monkeypatch.setattr("ddpkit.testing.time.sleep", recorded)
    return asked


def test_wait_until_returns_the_first_true_value_without_waiting_out_the_timeout(sleeps):
    predicate, calls = _true_on_call(4, value=["rank0.pid", "rank1.pid"])
    assert wait_until(predicate, 60, what="the pid files") == ["rank0.pid", "rank1.pid"]
    assert len(calls) == 4 and sleeps == [0.01, 0.02, 0.04]  # doubling from the interval


def test_a_condition_never_true_raises_after_the_timeout_naming_it_and_the_last_value(sleeps):
    start = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"waited 0.3 s for the snapshot at step 6; last seen: 0$"
    ):
        wait_until(lambda: 0, 0.3, what="the snapshot at step 6")
    assert time.monotonic() - start >= 0.3
    assert sum(sleeps) <= 0.3 + 1e-9  # no pause past the deadline


def test_what_given_as_a_function_is_read_at_the_timeout_only():
    log = ["starting"]
    seen = []

    def describe() -> str:
        seen.append(None)
        return f"the job (log: {log[-1]})"

    log.append("worker 1 stuck in a collective")
    with pytest.raises(
        TimeoutError, match=r"for the job \(log: worker 1 stuck in a collective\); last seen: ''"
    ):
        wait_until(lambda: "", 0.05, what=describe)
    assert len(seen) == 1
    predicate, _ = _true_on_call(2)
    wait_until(predicate, 10, what=describe)  # done in time: the description is never built
    assert len(seen) == 1


def test_an_error_of_the_predicate_ends_the_wait_at_once(sleeps):
    def job_died():
        raise AssertionError("the job exited with 1")

    with pytest.raises(AssertionError, match="the job exited with 1"):
        wait_until(job_died, 60)
    assert sleeps == []


def test_the_pauses_double_from_the_interval_up_to_the_cap(monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr(ddpkit.testing.time, "sleep", pauses.append)
    predicate, _ = _true_on_call(10)
    wait_until(predicate, 60, interval=0.01, max_interval=0.5)
    assert pauses == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5, 0.5])


def test_the_last_pause_ends_at_the_deadline_and_the_condition_is_read_once_more():
    """A condition that became true in the last pause is seen, not reported as a timeout."""
    calls = []

    def true_after_the_deadline():
        calls.append(time.monotonic())
        return len(calls) > 1 and calls[-1] - calls[0] >= 0.2

    assert wait_until(true_after_the_deadline, 0.2, interval=5, max_interval=5) is True
    assert len(calls) == 2  # one pause, cut to the 0.2 s left, not the 5 s interval


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"timeout": -1}, "timeout=-1"),
        ({"timeout": float("nan")}, "timeout=nan"),
        ({"interval": 0}, "interval=0"),
        ({"max_interval": 0.001}, "max_interval="),
    ],
)
def test_bad_settings_are_refused_naming_them(kwargs, named):
    with pytest.raises(ValueError, match=named):
        wait_until(lambda: True, **{"timeout": 1, **kwargs})


def test_the_launch_free_environment_drops_every_job_variable_and_keeps_the_rest():
    enclosing = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "outer",
        "SLURM_JOB_ID": "42",
        "OMPI_COMM_WORLD_RANK": "3",
        "PATH": "/usr/bin",
        "MY_RANKING": "kept",  # a name that only contains one of them
    }
    assert without_launch_env(enclosing) == {"PATH": "/usr/bin", "MY_RANKING": "kept"}
    assert {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} <= LAUNCH_VARIABLES


def test_the_suites_clean_environment_is_the_packages_plus_its_own_settings(monkeypatch):
    from tests.jobs.conftest import clean_environ

    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "outer")
    env = clean_environ()
    assert (
        "RANK" not in env and "TORCHELASTIC_RUN_ID" not in env and env["CUDA_VISIBLE_DEVICES"] == ""
    )


def test_run_job_refuses_a_job_of_no_process_before_starting_one():
    from ddpkit.testing import run_job

    with pytest.raises(ValueError, match="nproc=0; give the number of worker processes"):
        run_job("train.py", nproc=0)


def test_start_job_refuses_no_process_or_arguments_without_a_script_before_starting_one():
    from ddpkit.testing import start_job

    with pytest.raises(ValueError, match="nproc=0; give the number of worker processes"):
        start_job("train.py", nproc=0)
    with pytest.raises(ValueError, match=r"script=None with arguments \['--lr'\]"):
        start_job(None, "--lr", command="bench")


def test_a_runs_records_are_read_in_order_skipping_a_line_a_kill_cut_short(tmp_path):
    from ddpkit.testing import Job, read_records

    lines = [
        '{"kind": "event", "event": "start", "step": 0}',
        '{"kind": "train", "step": 1, "loss": 0.5}',
        '{"kind": "event", "event": "resume", "step": 1}',
        '{"kind": "train", "st',  # the kill
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert [r["kind"] for r in read_records(tmp_path)] == ["event", "train", "event"]
    job = Job(["ddpkit"], 0, "", "", run_dir=tmp_path)
    assert [e["event"] for e in job.events()] == ["start", "resume"]
    assert job.events("resume") == [{"kind": "event", "event": "resume", "step": 1}]
    # Control: the last line is no record; parsed as is, it fails.
    with pytest.raises(ValueError):
        json.loads(lines[-1])
    assert read_records(tmp_path / "nothing-yet") == []


def test_a_job_is_a_completed_process_and_names_what_it_was_not_given():
    from ddpkit.testing import Job

    failed = Job(["ddpkit", "run"], 3, "out", "err")
    assert isinstance(failed, subprocess.CompletedProcess) and failed.stdout == "out"
    with pytest.raises(subprocess.CalledProcessError):
        failed.check_returncode()
    with pytest.raises(ValueError, match="pass run_dir= to run_job"):
        failed.records  # noqa: B018
    with pytest.raises(ValueError, match="give 'stdout' or 'stderr'"):
        failed.output(1, "logs")
    # rank 0's output is the job's own; no log folder, no other rank's
    assert (failed.output(0), failed.output(0, "stderr"), failed.output(1)) == ("out", "err", "")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ((), ["--log-dir", "/w/ddpkit-logs"]),
        (
            ("--max-restarts", "1", "-m"),
            ["--log-dir", "/w/ddpkit-logs", "--max-restarts", "1", "-m"],
        ),
        (("--log-dir", "logs", "-m"), ["--log-dir", "/w/logs", "-m"]),
        (("--log-dir=/abs", "--log-dir", "b"), ["--log-dir", "/w/b"]),  # the last, as argparse
        (("--log-dir", "a", "--log-dir=/abs"), ["--log-dir", "/abs"]),
    ],
)
def test_the_launchers_log_folder_is_made_absolute_and_put_first(given, expected):
    from pathlib import Path

    from ddpkit.testing import _log_dir_first

    assert _log_dir_first(given, Path("/w")) == expected
