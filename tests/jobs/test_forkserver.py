"""``ddpkit run``'s fork server: workers forked from a process that imported torch once, which start and end as
new interpreters would. Real jobs end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs.test_launcher import DDPKIT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux only")

PROBE = str(Path(__file__).parent / "scripts" / "fork_probe.py")


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ddpkit run writes ./ddpkit-logs


def job(env, folder: Path, *options: str, mode: str = "end", stdin: str = "") -> subprocess.CompletedProcess:
    """``ddpkit run --nproc 2 --fork-server on OPTIONS fork_probe.py FOLDER MODE`` (a later option wins)."""
    folder.mkdir(exist_ok=True)
    return subprocess.run(
        DDPKIT + ["run", "--nproc", "2", "--fork-server", "on", *options, PROBE, str(folder), mode],
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
    )


def found(folder: Path, rank: int, attempt: int = 0) -> dict:
    return json.loads((folder / f"rank{rank}.attempt{attempt}.json").read_text())


def ended(folder: Path, rank: int, attempt: int = 0) -> list[str]:
    """What the rank finished before its process exited (see fork_probe.py)."""
    return sorted(p.suffix[1:] for p in folder.glob(f"rank{rank}.attempt{attempt}.*") if p.suffix != ".json")


def test_workers_are_forked_and_start_and_end_as_new_interpreters(clean_env, tmp_path):
    forked = job(clean_env, tmp_path / "forked", stdin="to rank 0\n")
    assert forked.returncode == 0, forked.stderr[-3000:]
    # Control: the same job with every worker a new interpreter (as torchrun starts them).
    new = job(clean_env, tmp_path / "new", "--fork-server", "off", stdin="to rank 0\n")
    assert new.returncode == 0, new.stderr[-3000:]
    for rank in range(2):
        a, b = found(tmp_path / "forked", rank), found(tmp_path / "new", rank)
        assert a.pop("preloaded") is True and b.pop("preloaded") is False  # torch._dynamo imported before the script
        assert a.pop("argv") == [str(tmp_path / "forked"), "end"] and b.pop("argv") == [str(tmp_path / "new"), "end"]
        a.pop("draws"), b.pop("draws")  # compared between ranks below
        assert (
            a
            == b
            == {
                "parent_is_agent": True,  # the agent's child, as a Popen child is
                "session_leader": True,  # a session of its own, as torchrun's start_new_session
                "cwd": str(tmp_path),
                "world_size": "2",
                "python_threads": 1,
                "sigint_is_python_default": True,
                "stdin": "to rank 0\n" if rank == 0 else None,
                "attempt": 0,
            }
        )
        assert ended(tmp_path / "forked", rank) == ended(tmp_path / "new", rank) == ["atexit", "executor", "thread"]
    # Unseeded generators draw differently on each rank, as in new interpreters (python, numpy, torch), not the
    # server's streams twice.
    for folder in ("forked", "new"):
        draws = [found(tmp_path / folder, rank)["draws"] for rank in range(2)]
        assert all(x != y for x, y in zip(*draws)), draws


@pytest.mark.slow
@pytest.mark.parametrize(("mode", "code", "stderr"), [("exit3", 3, ""), ("message", 1, "a message")])
def test_the_scripts_exit_status_is_the_jobs(clean_env, tmp_path, mode, code, stderr):
    out = job(clean_env, tmp_path, mode=mode)
    assert out.returncode == code, out.stderr[-3000:]
    assert found(tmp_path, 0)["preloaded"]
    assert ended(tmp_path, 0) == ["atexit", "executor", "thread"]  # the end of an interpreter, after the status
    logs = "".join(p.read_text() for p in Path("ddpkit-logs").rglob("*.log")) + out.stderr
    assert stderr in logs


def test_a_restart_after_a_sigkill_forks_the_workers_again(clean_env, tmp_path):
    out = job(clean_env, tmp_path, "--fork-server", "auto", "--max-restarts", "1", mode="kill-first")
    assert out.returncode == 0, out.stderr[-3000:]
    # The server outlived the teardown of the first attempt (which ends everything else below the agent).
    assert [found(tmp_path, rank, attempt)["preloaded"] for attempt in (0, 1) for rank in (0, 1)] == [True] * 4
    assert ended(tmp_path, 1, 0) == []  # SIGKILLed: nothing ran at its end
    assert ended(tmp_path, 1, 1) == ["atexit", "executor", "thread"]


@pytest.mark.slow
def test_a_fork_server_killed_during_the_job_leaves_the_restart_to_new_interpreters(clean_env, tmp_path):
    out = job(clean_env, tmp_path, "--max-restarts", "1", mode="kill-server-first")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "workers start as new interpreters (the fork server cannot fork them" in out.stderr
    assert [found(tmp_path, rank, attempt)["preloaded"] for attempt in (0, 1) for rank in (0, 1)] == [
        True, True, False, False
    ]  # fmt: skip
    assert ended(tmp_path, 1, 1) == ["atexit", "executor", "thread"]


THREAD_AT_IMPORT = "tests.jobs.scripts.thread_at_import"


@pytest.mark.slow
def test_a_server_that_must_not_fork_leaves_the_workers_to_new_interpreters(clean_env, tmp_path):
    # A module that starts a thread when imported: forking the server then would copy a process with a thread
    # that the fork does not carry over, so the server refuses and the workers start as new interpreters.
    out = job(clean_env, tmp_path, "--preload", THREAD_AT_IMPORT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "workers start as new interpreters (the fork server cannot fork them: 1 Python thread(s)" in out.stderr
    assert [found(tmp_path, rank)["preloaded"] for rank in (0, 1)] == [False, False]
    # Control: modules that start nothing are preloaded and the workers are forked; one that cannot be imported
    # is named, and left to the script.
    out = job(clean_env, tmp_path / "plain", "--preload", "json,tests.jobs.scripts", "--preload", "no_such_module")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "new interpreters" not in out.stderr
    assert "the fork server could not import no_such_module" in out.stderr
    assert [found(tmp_path / "plain", rank)["preloaded"] for rank in (0, 1)] == [True, True]
