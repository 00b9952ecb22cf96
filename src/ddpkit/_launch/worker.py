"""What ``ddpkit run`` starts in each worker: the user's script, with its exception recorded for the
launcher.

torchrun reports a failed worker's traceback only when the script's entry point is decorated with
``@record``; running the script through this module gives every script that, unchanged. Before the
script starts, the worker ties its life to the agent's (a parent-death signal), forks the guard that
ends whatever it starts once it is gone (:mod:`ddpkit._launch.proctree`), holds SIGUSR1 until a
Trainer listens for it (:mod:`ddpkit.distributed._signals`), answers stack requests from a thread of
its own (:func:`serve_stacks`), and on global rank 0 serves the workers' store on ``MASTER_ADDR``
alone. Usage (by the launcher): ``python -m ddpkit._launch.worker [-m] TARGET ARGS...``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import multiprocessing.util
import os
import re
import runpy
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._internals.elastic import record_with
from ddpkit._internals.store import agent_store_in_use, serve_store, use_agent_store
from ddpkit._launch.proctree import set_parent_death_signal, start_guard
from ddpkit.distributed._progress import watch_torch_collectives
from ddpkit.distributed._signals import hold_stop_signals
from ddpkit.platforms import _torchrun as torchrun

K = TypeVar("K")


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent (the launcher's agent) dies.

    A SIGKILLed agent cannot stop its workers, and they would train on to the end, reparented to
    init, holding the GPUs and writing the run directory. SIGKILL, not SIGTERM: with the agent gone
    nobody would report or restart anything, so a worker has no use for the time a snapshot takes.
    Returns False where the call does not exist (not Linux).
    """
    parent = int(os.environ.get("DDPKIT_AGENT_PID", os.getppid()))
    if not set_parent_death_signal(sig):
        return False
    # The parent may have died between fork and prctl; then no signal will come, and the parent is
    # gone.
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


STACK_DIR_ENV = "DDPKIT_STACK_DIR"
"""The folder where each worker serves stack requests and writes its answers (set by the
launcher)."""
NO_ANSWER = "(no answer within {wait:g} s: a process holding the GIL cannot answer)"
""":func:`ask_stacks`'s one line for a process asked that did not answer in time."""
_TOKEN = re.compile(r"[0-9a-f]{16}")
_TOKENS_KEPT = 64  # an answer names the last requests its process read, its own among them
_SKIPPED = (
    "ddpkit/_launch/worker.py",
    "ddpkit/_launch/forkserver/",
    "<frozen runpy>",
    "elastic/multiprocessing",
)
"""Frames of the launch machinery, left out of a worker's stack as shown."""


@dataclass
class _Serving:
    pid: int
    fd: int
    fifo: Path
    answers: list[Path]
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False


_serving: _Serving | None = None  # this process's, once it serves
_fork_hook = False


def serve_stacks(name: str | None = None) -> bool:
    """Answer stack requests (:func:`ask_stacks`) from a daemon thread of this process, for as long
    as it lives; False where nothing serves them (no ``$DDPKIT_STACK_DIR``, or it cannot be used).

    The thread blocks on a FIFO of this user's, ``$DDPKIT_STACK_DIR/stack-<pid>.fifo``. On each
    request it writes every thread's Python stack (from ``sys._current_frames()``, holding the GIL:
    main thread first, then the others, each innermost first) whole to ``stack-<pid>.txt`` and to
    ``<name>.txt`` (default ``rank<RANK>``). Nothing is signalled: a request can never kill the
    process, whatever it runs, at its start or its end. A main thread blocked in C (a collective, a
    sleep) has released the GIL, so its process answers; one that holds the GIL does not answer.
    """
    global _serving, _fork_hook
    pid = os.getpid()
    folder_name = os.environ.get(STACK_DIR_ENV)
    if not folder_name or (_serving is not None and _serving.pid == pid):
        return _serving is not None
    folder = Path(folder_name)
    fifo = folder / f"stack-{pid}.fifo"
    # the one askers wait on last: the other is written when they see it
    answers = [folder / f"{name or 'rank' + torchrun.rank_text(os.environ)}.txt"]
    answers.append(folder / f"stack-{pid}.txt")
    try:
        for path in (fifo, *answers):  # a dead process's of the same pid; an earlier attempt's
            fs.remove(path)
        fd = fs.open_fifo(fifo, os.O_RDWR, create=True)
    except (OSError, ConfigError):
        return False
    if fd is None:
        return False
    serving = _serving = _Serving(pid, fd, fifo, answers)
    if not _fork_hook:
        # A forked child (a loader worker) inherits the descriptor, not the thread: it would hold a
        # reader open on this process's FIFO that never answers.
        os.register_at_fork(after_in_child=_forget_in_child)
        _fork_hook = True
    atexit.register(_close, serving)
    # A loader worker ends through multiprocessing, which runs its finalizers and not atexit's.
    multiprocessing.util.Finalize(None, _close, args=(serving,), exitpriority=0)
    threading.Thread(target=_serve, args=(serving,), name="ddpkit-stacks", daemon=True).start()
    return True


def _forget_in_child() -> None:
    global _serving
    if _serving is not None:
        with contextlib.suppress(OSError):
            os.close(_serving.fd)
        _serving = None


def _close(serving: _Serving) -> None:
    """At the process's end: no more answers, and no FIFO left to ask (an answer being written is
    finished first)."""
    if serving.pid != os.getpid():  # a forked child's inherited exit handler
        return
    acquired = serving.lock.acquire(timeout=5)
    try:
        serving.closed = True
        with contextlib.suppress(OSError, ConfigError):
            fs.remove(serving.fifo)
    finally:
        if acquired:
            serving.lock.release()


def _serve(serving: _Serving) -> None:
    asked: deque[str] = deque(maxlen=_TOKENS_KEPT)
    me = threading.get_ident()
    while True:
        try:
            data = os.read(serving.fd, 4096)
        except OSError:
            return
        if not data:  # never while this process holds the FIFO open to write too
            return
        asked.extend(t for t in data.decode("ascii", "replace").split() if _TOKEN.fullmatch(t))
        try:
            text = f"stacks of pid {serving.pid}, asked by: {' '.join(asked)}\n" + format_stacks(me)
            with serving.lock:
                if serving.closed:
                    return
                for path in serving.answers:
                    fs.write_atomic(path, text.encode(errors="replace"))
        except Exception:  # noqa: BLE001
            # A folder removed or full: this answer is lost, the next request is served.
            continue


def format_stacks(skip: int | None = None, limit: int = 100) -> str:
    """Every thread's Python stack but ``skip``'s (a thread ident), main thread first, each
    innermost first (at most ``limit`` frames): faulthandler's layout, the main thread's block
    headed ``Main thread``. Call it holding the GIL (any Python code does)."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    blocks = []
    for ident in sorted(frames, key=lambda i: i != main):
        if ident == skip:
            continue
        head = "Main thread" if ident == main else "Thread"
        name = "" if ident == main else f" {names.get(ident, '?')!r}"
        lines = [f"{head} 0x{ident:016x}{name} (most recent call first):"]
        frame: FrameType | None = frames[ident]
        while frame is not None and len(lines) <= limit:
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}')
            frame = frame.f_back
        if frame is not None:
            lines.append("  ...")
        blocks.append("\n".join(lines))
    if main not in frames:
        blocks.insert(0, "Main thread: no Python frame (the interpreter is ending)")
    return "\n\n".join(blocks) + "\n"


def request_stack(folder: Path, pid: int) -> str | None:
    """Ask process ``pid`` for its stacks through its FIFO in ``folder``, without waiting; the
    request's token (its answer names it), or None where nothing serves there (no FIFO, or nobody
    reading it: the process has ended), or its FIFO is full (it reads none)."""
    token = secrets.token_hex(8)
    try:
        fd = fs.open_fifo(folder / f"stack-{pid}.fifo", os.O_WRONLY | os.O_NONBLOCK)
    except (OSError, ConfigError):  # ENXIO: no reader; ENOENT: none made
        return None
    if fd is None:
        return None
    try:
        os.write(fd, f"{token}\n".encode())
    except OSError:  # EAGAIN: its pipe is full
        return None
    finally:
        os.close(fd)
    return token


def request_every_stack(folder: Path) -> int:
    """Ask every process serving stack requests in ``folder`` (ranks and their loader workers),
    without waiting: each writes its answer (:func:`serve_stacks`). How many were asked."""
    try:
        pids = [int(p.name[6:-5]) for p in folder.glob("stack-*.fifo") if p.name[6:-5].isdigit()]
    except OSError:
        return 0
    return sum(request_stack(folder, pid) is not None for pid in pids)


def _answer(folder: Path, pid: int, token: str) -> str | None:
    """Process ``pid``'s answer in ``folder``, where it answers the request ``token``."""
    try:
        text = fs.read_bytes(folder / f"stack-{pid}.txt").decode(errors="replace")
    except (OSError, ConfigError):
        return None
    head, _, body = text.partition("\n")
    return body if token in head.split() else None


def ask_stacks(
    folder: Path, pids: Mapping[K, int], wait: float = 3.0, lines: int = 10
) -> dict[K, list[str]]:
    """Each process's main-thread stack (``key -> pid``: a global rank, a loader worker's pid, any
    key), innermost first and without the launch machinery's frames, asked now of the processes
    serving stack requests in ``folder`` (:func:`serve_stacks`), at most ``wait`` seconds in all.

    A key whose process serves none (ended, or not started by ``ddpkit run``) is left out; one that
    did not answer in time (it holds the GIL) gets the single line :data:`NO_ANSWER`. Nothing is
    signalled: asking kills nothing."""
    asked = {key: (pid, t) for key, pid in pids.items() if (t := request_stack(folder, pid))}
    out: dict[K, list[str]] = {}
    deadline = time.monotonic() + wait
    while True:
        for key, (pid, token) in asked.items():
            if key not in out and (text := _answer(folder, pid, token)) is not None:
                out[key] = main_frames(text)[:lines]
        if len(out) == len(asked) or time.monotonic() >= deadline:
            break
        # answered from the other process's thread: nothing to wait on but the file
        time.sleep(0.01)
    for key in asked:
        out.setdefault(key, [NO_ANSWER.format(wait=wait)])
    return out


def main_frames(dump: str) -> list[str]:
    """The main thread's frames in one answer (:func:`format_stacks`), innermost first, without
    the launch machinery's."""
    frames = []
    inside = False
    for line in dump.splitlines():
        if line.startswith("Main thread"):
            inside = True
        elif inside and (line.startswith("Thread") or not line.strip()):
            break
        elif inside:
            line = line.strip()
            if line.startswith("File ") and not any(skip in line for skip in _SKIPPED):
                frames.append(line)
    return frames


_worker_store: Any = None  # the store global rank 0 serves, alive as long as the process


def serve_worker_store() -> Any:
    """On global rank 0, serve the workers' TCPStore on ``MASTER_ADDR:MASTER_PORT``, bound to that
    address only.

    ``torch.distributed``'s own env:// rendezvous has rank 0 start the store listening on every
    interface of its node, whatever ``MASTER_ADDR`` says; a single-node job's ``MASTER_ADDR`` is
    127.0.0.1, so that store would be open to the network for nothing. Served here from a socket
    bound to ``MASTER_ADDR``'s address, and every rank (this one too) told to connect as a client
    (``TORCHELASTIC_USE_AGENT_STORE``), which holds for scripts that call
    ``torch.distributed.init_process_group`` themselves as much as for ``ddpkit.init()``.
    """
    global _worker_store
    master = torchrun.master_address(os.environ)
    if master is None or agent_store_in_use():
        return None  # no store to serve: the agent serves it, or this is not a job of ddpkit run
    addr, port = master
    if torchrun.is_rank_zero(os.environ):
        from datetime import timedelta

        try:
            listener = socket.create_server((socket.gethostbyname(addr), int(port)), backlog=1024)
        except OSError as err:
            raise ConfigError(
                f"rank 0 cannot serve the workers' store at {addr}:{port} ({err.strerror}): the "
                "agent picked this port as free, and another program took it since, or "
                "--local-addr is not an address of this node; run the job again"
            ) from None
        _worker_store = serve_store(listener.detach(), addr, int(port), timedelta(minutes=5))
    use_agent_store()
    return _worker_store


class WholeErrorFile(ErrorHandler):
    """torch's error handler, its file (``TORCHELASTIC_ERROR_FILE``) written whole or not at all.

    torch writes it in place. A worker stopped in the middle of that write (the agent ending the
    survivors of a failed rank) left a truncated file, and the agent's next poll, which reads every
    failed worker's file, raised on it and ended the whole launcher with a JSON error. Here the same
    record (torch's format: the message, the traceback, the time) replaces the file whole
    (:func:`ddpkit._fs.write_atomic`): a worker stopped before that has no file, and its failure
    reads as its exit status. A script's own ``@record`` (torchrun's documentation asks for one on
    ``main``) writes through it too (:func:`main`)."""

    def record_exception(self, e: BaseException) -> None:
        path = torchrun.error_file(os.environ)
        if not path:
            super().record_exception(e)  # torch logs what it would have written
            return
        record = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": traceback.format_exc(),
                    "timestamp": str(int(time.time())),
                },
            }
        }
        fs.write_atomic(Path(path), json.dumps(record).encode())


def _ignore_warnings_at_exit() -> None:
    # Once the script has ended a SIGUSR1 (forwarded by the agent) has nothing left to stop, and the
    # interpreter gives a signal with a Python handler its default action back while it exits (for
    # torch's modules, ~0.6 s): the warning would kill a worker that has finished. Ignored instead.
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


@functools.partial(record, error_handler=WholeErrorFile())
def _run(target: str, as_module: bool) -> None:
    serve_worker_store()
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


def main() -> None:
    argv = sys.argv[1:]
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m ddpkit._launch.worker [-m] TARGET [ARGS...]")
    die_with_parent()
    start_guard()
    hold_stop_signals()
    atexit.register(_ignore_warnings_at_exit)  # run after the script's own exit handlers
    # Nothing sends it: a stray one (a `kill` to the worker's group) must not kill the worker.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    serve_stacks()
    # the world's collectives the script calls through torch.distributed, marked for the stall
    # watch (a rank that calls another one than the others is named)
    watch_torch_collectives()
    # A script's own @record, applied as its module runs, writes the agent's file whole too: torch's
    # handler would write it in place, before this worker's sees the exception it re-raises.
    record_with(WholeErrorFile)
    target = argv[0]
    sys.argv = argv
    # As `python script.py` does: the script's folder first on the import path, not ours.
    sys.path[0] = os.getcwd() if as_module else os.path.dirname(os.path.abspath(target))
    _run(target, as_module)


if __name__ == "__main__":
    main()
