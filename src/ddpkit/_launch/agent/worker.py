"""What ``ddpkit run`` starts in each worker (``python -m ddpkit._launch.agent.worker [-m] TARGET
ARGS...``): the user's script, its exception recorded for the launcher, with the worker tied to the
agent, its guard, SIGUSR1 held and stack requests answered (:func:`serve_stacks`)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import json
import multiprocessing.util
import os
import re
import runpy
import secrets
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TypeVar

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._internals.elastic import record_with
from ddpkit._internals.interpreter import current_frames
from ddpkit._launch.proctree import set_parent_death_signal, start_guard
from ddpkit._launch.recover import inplace as recover
from ddpkit.distributed._progress import watch_torch_collectives
from ddpkit.distributed._signals import hold_stop_signals
from ddpkit.platforms import _torchrun as torchrun

K = TypeVar("K")


STACK_DIR_ENV = "DDPKIT_STACK_DIR"  # where workers serve stack requests (set by the launcher)
NO_ANSWER = "(no answer within {wait:g} s: a process holding the GIL cannot answer)"
_TOKEN = re.compile(r"[0-9a-f]{16}")
_TOKENS_KEPT = 64  # an answer names the last requests its process read, its own among them
_SKIPPED = (
    "ddpkit/_launch/agent/worker.py", "ddpkit/_launch/agent/forkserver.py", "<frozen runpy>",
    "elastic/multiprocessing",
)  # fmt: skip
"""Frames of the launch machinery, left out of a stack as shown."""


@dataclass
class _Serving:
    pid: int
    fd: int
    fifo: Path
    answers: list[Path]
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False


_serving: _Serving | None = None  # this process's, once it serves


def serve_stacks(name: str | None = None) -> bool:
    """Answer stack requests (:func:`ask_stacks`) on the FIFO ``stack-<pid>.fifo`` from a daemon
    thread, writing every thread's stack (:func:`format_stacks`) to ``stack-<pid>.txt`` and
    ``<name>.txt`` (default ``rank<RANK>``); False where nothing serves them (no
    ``$DDPKIT_STACK_DIR``, or it cannot be used). Nothing is signalled."""
    global _serving
    pid = os.getpid()
    folder_name = os.environ.get(STACK_DIR_ENV)
    if not folder_name or (_serving is not None and _serving.pid == pid):
        return _serving is not None
    folder = Path(folder_name)
    fifo = folder / f"stack-{pid}.fifo"
    # the one askers wait on, last
    name = name or f"rank{torchrun.rank_text(os.environ)}"
    answers = [folder / f"{name}.txt", folder / f"stack-{pid}.txt"]
    try:
        for path in (fifo, *answers):  # a dead process's of this pid, or an earlier attempt's
            fs.remove(path)
        fd = fs.open_fifo(fifo, os.O_RDWR, create=True)
    except (OSError, ConfigError):
        return False
    if fd is None:
        return False
    serving = _serving = _Serving(pid, fd, fifo, answers)
    atexit.register(_close, serving)
    # a loader worker ends through multiprocessing's finalizers, not atexit's
    multiprocessing.util.Finalize(None, _close, args=(serving,), exitpriority=0)
    threading.Thread(target=_serve, args=(serving,), name="ddpkit-stacks", daemon=True).start()
    return True


def _forget_in_child() -> None:
    global _serving
    if _serving is not None:
        with contextlib.suppress(OSError):
            os.close(_serving.fd)
        _serving = None


# a forked child inherits the descriptor, not the thread: a reader that never answers
os.register_at_fork(after_in_child=_forget_in_child)


def _close(serving: _Serving) -> None:
    """At the process's end: no more answers (one being written is finished), no FIFO left."""
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
        except Exception:  # noqa: BLE001  (a folder removed or full: the next one is served)
            continue


def format_stacks(skip: int | None = None, limit: int = 100) -> str:
    """Every thread's Python stack but ``skip``'s (a thread ident), main thread first, each
    innermost first (at most ``limit`` frames), in faulthandler's layout; read holding the GIL."""
    frames = current_frames()
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
    request's token (its answer names it), or None where nothing serves there or its FIFO is
    full."""
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
    """Ask every process serving stack requests in ``folder``, without waiting; how many."""
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
    """Each process's main-thread stack (``key -> pid``), innermost first, without the launch
    machinery's frames, asked now of the processes serving stack requests in ``folder``, at most
    ``wait`` seconds in all. A process that serves none is left out; one that did not answer in
    time gets the single line :data:`NO_ANSWER`. Nothing is signalled."""
    asked = {key: (pid, t) for key, pid in pids.items() if (t := request_stack(folder, pid))}
    out: dict[K, list[str]] = {}
    deadline = time.monotonic() + wait
    while True:
        for key, (pid, token) in asked.items():
            if key not in out and (text := _answer(folder, pid, token)) is not None:
                out[key] = main_frames(text)[:lines]
        if len(out) == len(asked) or time.monotonic() >= deadline:
            break
        time.sleep(0.01)
    for key in asked:
        out.setdefault(key, [NO_ANSWER.format(wait=wait)])
    return out


def main_frames(dump: str) -> list[str]:
    """The main thread's frames in one answer, innermost first, without the launch machinery's."""
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


class WholeErrorFile(ErrorHandler):
    """torch's error handler, its file (``TORCHELASTIC_ERROR_FILE``) written whole or not at all (a
    truncated one ends the agent's poll), in torch's format; a script's own ``@record`` too."""

    def record_exception(self, e: BaseException) -> None:
        path = torchrun.error_file(os.environ)
        if not path:
            super().record_exception(e)  # torch logs it
            return
        info = {"py_callstack": traceback.format_exc(), "timestamp": str(int(time.time()))}
        record = {"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": info}}
        fs.write_atomic(Path(path), json.dumps(record).encode())


def _ignore_warnings_at_exit() -> None:
    # a SIGUSR1 after the script (its handler reset at exit) would kill a worker that finished
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


@functools.partial(record, error_handler=WholeErrorFile())
def _run(target: str, as_module: bool) -> None:
    while True:
        try:
            if as_module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
            return
        except BaseException as error:  # noqa: BLE001 -- a recovering job's rank runs again
            failed = error
        # out of the handler: the failed step's frames, and the groups they hold, are released
        if recover.leave(failed) is None:
            raise failed
        del failed


def main() -> None:
    argv = sys.argv[1:]
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m ddpkit._launch.agent.worker [-m] TARGET [ARGS...]")
    # SIGKILLed when the agent dies (Linux); if it died before prctl, no signal will come
    agent = int(os.environ.get("DDPKIT_AGENT_PID", os.getppid()))
    if set_parent_death_signal(signal.SIGKILL) and os.getppid() != agent:
        os.kill(os.getpid(), signal.SIGKILL)
    start_guard()
    hold_stop_signals()
    atexit.register(_ignore_warnings_at_exit)  # run after the script's own exit handlers
    # nothing sends it: a stray one (a `kill` to the worker's group) must not kill the worker
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    serve_stacks()
    watch_torch_collectives()  # marked for the stall watch
    record_with(WholeErrorFile)  # a script's own @record writes the agent's file whole too
    if recover.folder() is not None:
        recover.note_links()
        recover.watch_incidents()
        # what is loaded now lives as long as the process: recover.leave's collection skips it
        gc.freeze()
    target = argv[0]
    sys.argv = argv
    # as `python script.py`: the script's folder first on the import path
    sys.path[0] = os.getcwd() if as_module else os.path.dirname(os.path.abspath(target))
    _run(target, as_module)


if __name__ == "__main__":
    main()
