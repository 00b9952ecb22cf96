"""Ending what a worker started: real process trees, made by small Python programs that load
``ddpkit._launch.proctree`` alone (no torch, so each starts in a tenth of a second). End to end
under ``ddpkit run``: ``tests/test_launcher.py::test_what_the_workers_start_*``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit._launch.proctree import descendants, kill_descendants
from ddpkit.testing import wait_until

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="process trees are read from /proc"
    ),
]

PROCTREE = Path(__file__).resolve().parents[3] / "src" / "ddpkit" / "_launch" / "proctree.py"
LOAD = (
    "import importlib.util, os, signal, subprocess, sys, time\n"
    f"spec = importlib.util.spec_from_file_location('proctree', {str(PROCTREE)!r})\n"
    "pt = importlib.util.module_from_spec(spec); spec.loader.exec_module(pt)\n"
)
# A worker's family: a sleep in its process group, a forked child that ignores SIGTERM, a sleep in a
# session of its own; their pids on one line, then the worker waits for a line on stdin and exits.
FAMILY = (
    LOAD
    + """
if sys.argv[1] == "guard":
    pt.start_guard()
sleeper = subprocess.Popen(["sleep", "1000"])
# Ignored from the fork on: no window to die in.
term = signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = os.fork()
if child == 0:
    time.sleep(1000)
    os._exit(0)
signal.signal(signal.SIGTERM, term)
detached = subprocess.Popen(["sleep", "1001"], start_new_session=True)
print(sleeper.pid, child, detached.pid, flush=True)
sys.stdin.readline()
"""
)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def _survivors(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Those of ``pids`` still alive after ``timeout`` (the guard acts on its own time); killed,
    then returned."""
    with contextlib.suppress(TimeoutError):  # what is still alive then is the finding, not an error
        wait_until(lambda: all(map(_gone, pids)), timeout, what="the processes to end")
    alive = [pid for pid in pids if not _gone(pid)]
    for pid in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return alive


@pytest.mark.parametrize("end", ["exit", "sigterm-to-group", "sigkill"])
@pytest.mark.parametrize("guarded", [True, False])
def test_the_guard_ends_what_a_worker_started_however_the_worker_ends(end, guarded):
    # A session of its own, as torchrun starts each worker; the guard (when started) is its child.
    worker = subprocess.Popen(
        [sys.executable, "-c", FAMILY, "guard" if guarded else "none"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    family = [int(pid) for pid in worker.stdout.readline().split()]
    assert len(family) == 3
    if end == "exit":
        worker.stdin.write("\n")
        worker.stdin.flush()
    elif end == "sigterm-to-group":  # torchrun stopping a worker: the forked child ignores it
        os.killpg(worker.pid, signal.SIGTERM)
    else:  # the kernel's parent-death signal once the agent was SIGKILLed
        worker.kill()
    worker.wait(timeout=30)
    alive = _survivors(family, timeout=10 if guarded else 0)
    if guarded:
        assert alive == []
    # control: without the guard they outlive the worker (the group's sleep dies of the group's
    # SIGTERM)
    else:
        assert set(alive) >= set(family[1:]), alive


def test_a_subreaper_keeps_orphans_below_it_and_kill_descendants_ends_them_all():
    # root adopts what its children orphan (a shell that backgrounds a sleep and exits) when it is a
    # subreaper.
    code = (
        LOAD
        + """
subreaper = sys.argv[1] == "subreaper" and pt.become_subreaper()
sleeper = subprocess.Popen(["sleep", "1000"])
detached = subprocess.Popen(["sleep", "1001"], start_new_session=True)
orphan = subprocess.run(["sh", "-c", "sleep 1002 >/dev/null 2>&1 & echo $!"], capture_output=True,
                        text=True).stdout.strip()
print(sleeper.pid, detached.pid, orphan, flush=True)
sys.stdin.readline()
"""
    )
    trees = {}
    for mode in ("subreaper", "plain"):
        root = subprocess.Popen(
            [sys.executable, "-c", code, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        trees[mode] = (root, [int(pid) for pid in root.stdout.readline().split()])
    try:
        root, family = trees["subreaper"]
        assert set(descendants(root.pid)) >= set(family)
        assert set(kill_descendants(root.pid)) >= set(family)
        # below it all gone, the root itself untouched
        assert all(map(_gone, family)) and root.poll() is None
        # Control: without the subreaper the orphan went to init, out of the root's tree.
        root, family = trees["plain"]
        assert family[2] not in descendants(root.pid) and not _gone(family[2])
    finally:
        for root, family in trees.values():
            _survivors(family, timeout=0)
            root.kill()
            root.wait()
