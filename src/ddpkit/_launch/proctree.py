"""Ending every process a worker started, however it ended (docs/launcher.md, "Inside each worker"):
the agent as a child subreaper (:func:`kill_descendants`) and each worker's guard
(:func:`start_guard`). Linux only; elsewhere these calls do nothing."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
import warnings
from collections.abc import Callable, Collection, Iterable

from ddpkit._internals.interpreter import (
    LINUX,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_NAME,
    PR_SET_PDEATHSIG,
    prctl,
    set_command_line,
)

MARK = "DDPKIT_WORKER_MARK"
"""The variable every process a worker starts inherits: ``<worker pid>.<worker start time>``."""


def set_parent_death_signal(sig: int) -> bool:
    """Have Linux send ``sig`` when this process's parent dies; False where not Linux."""
    return prctl(PR_SET_PDEATHSIG, int(sig))


def become_subreaper() -> bool:
    """Make this process adopt its descendants' orphans; False where Linux does not."""
    return prctl(PR_SET_CHILD_SUBREAPER, 1)


def send(pids: Iterable[int], sig: int) -> None:
    """Send ``sig`` to each of ``pids``, skipping those gone or not ours."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def sockets() -> dict[int, str]:
    """This process's sockets: descriptor -> ``socket:[inode]``."""
    out = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:"):
                    out[int(name)] = target
    return out


def _stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, parent, process group, start time in ticks) of ``pid``; None once gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name in parentheses may hold spaces
    return fields[0], int(fields[1]), int(fields[2]), int(fields[19])


def state_code(pid: int) -> str:
    """The state of ``pid`` as ``/proc/PID/stat`` gives it (``R``, ``S``...); ``?`` once gone."""
    stat = _stat(pid)
    return stat[0] if stat is not None else "?"


def parent_of(pid: int) -> int | None:
    """The parent pid of ``pid``; None once it is gone."""
    stat = _stat(pid)
    return stat[1] if stat is not None else None


def start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (with the pid, its identity); None once
    it is gone."""
    stat = _stat(pid)
    return stat[3] if stat is not None else None


def wait_exit(pid: int, timeout: float | None) -> bool | None:
    """Wait until ``pid`` has exited (zombie or reaped), at most ``timeout`` seconds; whether it
    has. None where there are no pidfds (a kernel before 5.3, a seccomp profile): the caller
    polls."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except (OSError, AttributeError):
        return None
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _children(pid: int) -> list[int]:
    """The children of ``pid`` (each thread's, from ``/proc/PID/task/TID/children``)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def activity(root: int) -> tuple[int, int] | None:
    """What ``root`` and every process below it have done so far: CPU time in clock ticks and bytes
    read and written (``rchar + wchar``; 0 where ``/proc/PID/io`` cannot be read). None once
    ``root`` is gone."""
    ticks = chars = 0
    todo, seen = [root], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            if pid == root:
                return None
            continue
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
        try:
            with open(f"/proc/{pid}/io", "rb") as f:
                for line in f:
                    if line.startswith((b"rchar:", b"wchar:")):
                        chars += int(line.split()[1])
        except OSError:
            pass
        todo += _children(pid)
    return ticks, chars


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (children, their children, ...), zombies left out."""
    children: dict[int, list[int]] = {}
    states = {}
    for pid in _all_pids():
        stat = _stat(pid)
        if stat is not None:
            states[pid] = stat[0]
            children.setdefault(stat[1], []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return [pid for pid in found if states.get(pid) not in ("Z", "X")]


def _wait_gone(pids: Iterable[int], deadline: float) -> None:
    """Until each of ``pids`` has exited (or ``deadline``)."""
    for pid in pids:
        if wait_exit(pid, max(0.0, deadline - time.monotonic())) is None:
            while (
                (stat := _stat(pid)) is not None
                and stat[0] not in ("Z", "X")
                and time.monotonic() < deadline
            ):
                time.sleep(0.01)


def _kill_until_gone(find: Callable[[], list[int]], timeout: float) -> list[int]:
    """SIGKILL the pids ``find`` returns, again until it returns none (``timeout`` s at most), and
    wait until they are gone; the pids killed."""
    deadline = time.monotonic() + timeout
    killed: list[int] = []
    while time.monotonic() < deadline and (found := find()):
        send(found, signal.SIGKILL)
        killed += found
        _wait_gone(found, deadline)
    return killed


def kill_descendants(
    root: int | None = None, keep: Collection[int] = (), timeout: float = 10.0
) -> list[int]:
    """SIGKILL every process below ``root`` (this process by default), again until none is left,
    and wait until they are gone; reap this process's own zombies but ``keep`` (whose status a
    ``Popen`` has to read). Returns the pids killed."""
    if not LINUX:
        return []
    me = os.getpid()
    root = me if root is None else root
    killed = _kill_until_gone(lambda: [p for p in descendants(root) if p not in keep], timeout)
    for pid in _all_pids() if root == me else []:
        if pid not in keep and (s := _stat(pid)) is not None and s[1] == me and s[0] == "Z":
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)
    return killed


def _marked(pid: int, mark: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return mark in f.read().split(b"\0")
    except OSError:  # gone, or another user's process
        return False


def kill_worker_tree(group: int | None, mark: str, timeout: float = 10.0) -> list[int]:
    """SIGKILL every process in process group ``group`` (what the worker forked) or whose
    environment holds ``MARK=mark`` (what it started with ``exec``, in any group), this one
    excepted."""
    me, entry = os.getpid(), f"{MARK}={mark}".encode()

    def found() -> list[int]:
        return [
            pid
            for pid in _all_pids()
            if pid != me
            and (stat := _stat(pid)) is not None
            and stat[0] not in ("Z", "X")
            and (stat[2] == group or _marked(pid, entry))
        ]

    return _kill_until_gone(found, timeout)


GUARD_TITLE = "ddpkit-guard"  # the guard's command line, then its worker's pid
# what the kernel sends the guard when its worker dies (a signal nothing else sends it)
GUARD_SIGNAL = signal.SIGRTMIN if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2


def is_guard(pid: int) -> bool:
    """Whether ``pid`` is a worker's guard (:func:`start_guard`), by its command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(GUARD_TITLE.encode())
    except OSError:
        return False


def start_guard() -> int | None:
    """Mark this process's environment and fork its guard, which blocks every signal but the
    parent-death one and leaves the worker's group; the guard's pid (None where not Linux)."""
    if not LINUX:
        return None
    worker = os.getpid()
    mark = f"{worker}.{start_time(worker)}"  # with the start time: a reused pid never matches
    os.environ[MARK] = mark
    # a worker that does not lead its group shares it with others (a shell's job): the mark only
    group = worker if os.getpgid(0) == worker else None
    with warnings.catch_warnings():
        # 3.12 warns of fork() with threads; the child below only makes system calls
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return pid
    try:  # the guard: never returns
        os.setpgid(0, 0)
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        # a command line of its own, or `pkill -f ... --newest` would find it for its worker
        set_command_line([GUARD_TITLE, str(worker)])
        prctl(PR_SET_NAME, GUARD_TITLE)
        set_parent_death_signal(GUARD_SIGNAL)
        if os.getppid() == worker:  # else it died before prctl: no signal will come
            signal.sigwait({GUARD_SIGNAL})
        kill_worker_tree(group, mark)
    finally:
        os._exit(0)
