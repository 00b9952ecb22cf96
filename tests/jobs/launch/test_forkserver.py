"""``ddpkit run``'s fork server: workers forked from a process that imported torch once, which start
and end as new interpreters would. Real jobs end to end."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpkit.testing import start_job, wait_until
from tests.jobs.scripts.fork_probe_log import TEXT as UNCLOSED

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the fork server is Linux only"
    ),
]

PROBE = str(Path(__file__).parents[1] / "scripts" / "fork_probe.py")


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ddpkit run writes ./ddpkit-logs


JOB_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def job(
    env,
    folder: Path,
    *options: str,
    mode: str = "end",
    stdin: str = "",
    ignored: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """``ddpkit run --nproc 2 --fork-server on OPTIONS fork_probe.py FOLDER MODE`` (a later option
    wins), started with the signals ``ignored`` ignored and the others at their default, whatever
    pytest has."""

    def dispositions() -> None:
        for name in JOB_SIGNALS:
            signal.signal(
                getattr(signal, name), signal.SIG_IGN if name in ignored else signal.SIG_DFL
            )

    folder.mkdir(exist_ok=True)
    proc = start_job(
        PROBE, str(folder), mode, launcher_args=["--fork-server", "on", *options], env=env,
        stdin=subprocess.PIPE, preexec_fn=dispositions,
    )  # fmt: skip
    try:
        out, err = proc.communicate(stdin, timeout=120)
    finally:
        if proc.poll() is None:  # past the timeout: the job and all it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def found(folder: Path, rank: int, attempt: int = 0) -> dict:
    return json.loads((folder / f"rank{rank}.attempt{attempt}.json").read_text())


def ended(folder: Path, rank: int, attempt: int = 0) -> list[str]:
    """What the rank finished before its process exited (see fork_probe.py); ``unclosed``: the text
    its module's file held, whole."""
    return sorted(
        p.suffix[1:]
        for p in folder.glob(f"rank{rank}.attempt{attempt}.*")
        if p.suffix != ".json" and (p.suffix != ".unclosed" or p.read_text() == UNCLOSED)
    )


def test_workers_are_forked_and_start_and_end_as_new_interpreters(clean_env, tmp_path):
    clean_env["FORK_PROBE_VARIABLE"] = "from the launcher's environment"
    # Started as a script's background job is (bash ignores SIGINT and SIGQUIT there): torch's agent
    # handles both once it starts its workers, after its fork server started, so a worker forked
    # with the server's first dispositions would ignore Ctrl-C where a new interpreter does not.
    ignored = ("SIGINT", "SIGQUIT")
    forked = job(clean_env, tmp_path / "forked", stdin="to rank 0\n", ignored=ignored)
    assert forked.returncode == 0, forked.stderr[-3000:]
    # Control: the same job with every worker a new interpreter (as torchrun starts them).
    new = job(
        clean_env, tmp_path / "new", "--fork-server", "off", stdin="to rank 0\n", ignored=ignored
    )
    assert new.returncode == 0, new.stderr[-3000:]
    for rank in range(2):
        a, b = found(tmp_path / "forked", rank), found(tmp_path / "new", rank)
        # torch._dynamo imported before the script
        assert a.pop("preloaded") is True and b.pop("preloaded") is False
        assert a.pop("argv") == [str(tmp_path / "forked"), "end"] and b.pop("argv") == [
            str(tmp_path / "new"),
            "end",
        ]
        a.pop("draws"), b.pop("draws")  # compared between ranks below
        assert a.pop("signals") == b["signals"], f"rank {rank}: forked != new interpreter"
        # the agent's handler, reset by exec: Python's own
        assert b.pop("signals")["SIGINT"] == "python's"
        assert (
            a
            == b
            == {
                "parent_is_agent": True,  # the agent's child, as a Popen child is
                "session_leader": True,  # a session of its own, as torchrun's start_new_session
                "cwd": str(tmp_path),
                "world_size": "2",
                "python_threads": 2,  # the main thread and the one answering stack requests
                "stdin": "to rank 0\n" if rank == 0 else None,
                "attempt": 0,
                "probe_variable": "from the launcher's environment",
                "rank_variables": [str(rank), str(rank), "2", "127.0.0.1"],
            }
        )
        assert (
            ended(tmp_path / "forked", rank)
            == ended(tmp_path / "new", rank)
            == ["atexit", "executor", "thread", "unclosed"]
        )
    # Rank 0's standard output is the launcher's, rank 1's its log file, each printed once.
    for out in (forked, new):
        assert (
            out.stdout.count("rank 0 to standard output") == 1
            and "rank 1 to standard output" not in out.stdout
        )
    # Unseeded generators draw differently on each rank, as in new interpreters (python, numpy,
    # torch), not the server's streams twice.
    for folder in ("forked", "new"):
        draws = [found(tmp_path / folder, rank)["draws"] for rank in range(2)]
        assert all(x != y for x, y in zip(*draws)), draws


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "code", "stderr"), [("exit3", 3, ""), ("message", 1, "a message")]
)
def test_the_scripts_exit_status_is_the_jobs(clean_env, tmp_path, mode, code, stderr):
    out = job(clean_env, tmp_path, mode=mode)
    assert out.returncode == code, out.stderr[-3000:]
    assert found(tmp_path, 0)["preloaded"]
    # the end of an interpreter, after the status
    assert ended(tmp_path, 0) == ["atexit", "executor", "thread", "unclosed"]
    logs = "".join(p.read_text() for p in Path("ddpkit-logs").rglob("*.log")) + out.stderr
    assert stderr in logs


@pytest.mark.slow
def test_a_restart_after_a_sigkill_forks_the_workers_again(clean_env, tmp_path):
    out = job(
        clean_env, tmp_path, "--fork-server", "auto", "--max-restarts", "1", mode="kill-first"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # The server outlived the teardown of the first attempt (which ends everything else below the
    # agent).
    assert [
        found(tmp_path, rank, attempt)["preloaded"] for attempt in (0, 1) for rank in (0, 1)
    ] == [True] * 4
    assert ended(tmp_path, 1, 0) == []  # SIGKILLed: nothing ran at its end
    assert ended(tmp_path, 1, 1) == ["atexit", "executor", "thread", "unclosed"]


@pytest.mark.slow
def test_a_fork_server_killed_during_the_job_leaves_the_restart_to_new_interpreters(
    clean_env, tmp_path
):
    out = job(clean_env, tmp_path, "--max-restarts", "1", mode="kill-server-first")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "workers start as new interpreters (the fork server cannot fork them" in out.stderr
    assert [
        found(tmp_path, rank, attempt)["preloaded"] for attempt in (0, 1) for rank in (0, 1)
    ] == [True, True, False, False]
    assert ended(tmp_path, 1, 1) == ["atexit", "executor", "thread", "unclosed"]


def _processes_naming(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (the job's server, intermediates and workers
    all name the probe's folder there)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
                if (
                    stat[0] not in ("Z", "X")
                    and text.encode() in Path(f"/proc/{name}/cmdline").read_bytes()
                ):
                    found.append(int(name))
    return found


@pytest.mark.slow
def test_a_launcher_killed_at_any_instant_of_the_start_leaves_no_process(clean_env, tmp_path):
    # SIGKILL of `ddpkit run` while the server imports, forks, or the workers start: the server dies
    # with the agent (its parent-death signal, and the end of its socket), a worker waiting to be
    # adopted exits, and an adopted one dies with the agent. Nothing of the job may be left.
    seed = int(os.environ.get("DDPKIT_KILL_SEED", "0")) or random.randrange(
        1 << 30
    )  # DDPKIT_KILL_SEED replays
    rng = random.Random(seed)
    for trial in range(6):
        folder = tmp_path / f"trial{trial}"
        folder.mkdir()
        with open(tmp_path / f"trial{trial}.log", "w") as log:
            proc = start_job(
                PROBE, str(folder), "hold", launcher_args=["--fork-server", "on"], env=clean_env,
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        started = _processes_naming(str(folder))
        # the instant of the kill, anywhere in the start
        deadline = time.monotonic() + rng.uniform(0.0, 4.0)
        while time.monotonic() < deadline and proc.poll() is None:
            started = sorted(set(started) | set(_processes_naming(str(folder))))
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        # what is still alive then is the finding, not an error
        with contextlib.suppress(TimeoutError):
            wait_until(
                lambda job=str(folder): not _processes_naming(job),
                15,
                what="the job's processes to end",
            )
        left = _processes_naming(str(folder))
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert left == [], (
            f"seed {seed}, trial {trial}: {len(started)} processes seen, left alive: {left}"
        )


@pytest.mark.slow
def test_a_worker_forked_for_a_server_that_died_before_answering_never_runs(clean_env, tmp_path):
    # The server forks rank 0's worker and dies before it answers: the agent starts rank 0 (and
    # rank 1) as new interpreters; the forked worker, told nothing, exits without running the
    # script. Each rank runs once.
    out = job(clean_env, tmp_path, "--preload", "tests.jobs.scripts.server_dies_before_reply")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "workers start as new interpreters (the fork server cannot fork them: it did not answer)"
        in out.stderr
    )
    assert [len((tmp_path / f"rank{rank}.starts").read_text().splitlines()) for rank in (0, 1)] == [
        1,
        1,
    ]
    assert [found(tmp_path, rank)["preloaded"] for rank in (0, 1)] == [False, False]


@pytest.mark.slow
def test_without_pidfds_workers_are_still_forked_and_adopted(clean_env, tmp_path):
    # A kernel before 5.3, or a seccomp profile that refuses pidfd_open: a worker waits for its
    # adoption by watching its parent instead.
    out = job(
        clean_env,
        tmp_path,
        "--preload",
        "tests.jobs.scripts.no_pidfd",
        "--max-restarts",
        "1",
        mode="kill-first",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert [
        found(tmp_path, rank, attempt)["preloaded"] for attempt in (0, 1) for rank in (0, 1)
    ] == [True] * 4
    assert [found(tmp_path, rank, 1)["parent_is_agent"] for rank in (0, 1)] == [True, True]


THREAD_AT_IMPORT = "tests.jobs.scripts.thread_at_import"


@pytest.mark.slow
def test_a_server_that_must_not_fork_leaves_the_workers_to_new_interpreters(clean_env, tmp_path):
    # A module that starts a thread when imported: forking the server then would copy a process with
    # a thread that the fork does not carry over, so the server refuses and the workers start as new
    # interpreters.
    out = job(clean_env, tmp_path, "--preload", THREAD_AT_IMPORT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        "workers start as new interpreters (the fork server cannot fork them: 1 Python thread(s)"
        in out.stderr
    )
    assert [found(tmp_path, rank)["preloaded"] for rank in (0, 1)] == [False, False]
    # Control: modules that start nothing are preloaded and the workers are forked; one that cannot
    # be imported is named, and left to the script.
    out = job(
        clean_env,
        tmp_path / "plain",
        "--preload",
        "json,tests.jobs.scripts",
        "--preload",
        "no_such_module",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "new interpreters" not in out.stderr
    assert "the fork server could not import no_such_module" in out.stderr
    assert [found(tmp_path / "plain", rank)["preloaded"] for rank in (0, 1)] == [True, True]
