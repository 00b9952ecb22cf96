"""The folder ``ddpkit run``'s agent keeps for the job on each node, named to its workers by one
variable (:data:`JOB_DIR_ENV`), and the channels through it between the agent and the processes
it starts (docs/launcher.md, "Inside each worker")::

    owner                      the agent's pid and start time
    progress/rank<R>.progress  each rank's progress record
    inbox/<pid>                each process's FIFO: the agent's news, a line each
    stacks/<pid>.txt           a process's answer to a stack request
    stacks/<name>.txt          the same, by name (rank<R>, rank<R>-loader<I>)
    recover/                   in-place recovery's state
    memory/                    the snapshots in memory (memory.off: why none)

Its readers: :mod:`ddpkit.distributed._progress` (the records), :mod:`ddpkit.snapshot._slots`
(the snapshots in memory), ``ddpkit._launch.recover`` (in-place recovery); the agent makes it
(``ddpkit._launch.agent.jobdir``).

Outside ``ddpkit run`` there is no folder, and every channel is off. The agent writes into a
process's inbox and never waits; the process answers in files, which the agent reads.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TypeVar

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._internals.interpreter import current_frames
from ddpkit.platforms import _torchrun as torchrun

JOB_DIR_ENV = "DDPKIT_JOB_DIR"
"""The job's folder on this node, set by ``ddpkit run``'s agent for everything it starts."""
PROGRESS, INBOX, STACKS, RECOVER, MEMORY = "progress", "inbox", "stacks", "recover", "memory"
MEMORY_OFF = "memory.off"  # the reason the job keeps no snapshots in memory, where it keeps none

K = TypeVar("K")


def job_folder() -> Path | None:
    """This job's folder on this node; None outside ``ddpkit run``."""
    folder = os.environ.get(JOB_DIR_ENV)
    return Path(folder) if folder else None


def channel(name: str) -> Path | None:
    """The folder of channel ``name`` (:data:`PROGRESS`, :data:`RECOVER`, ...) of this job; None
    outside ``ddpkit run``."""
    folder = job_folder()
    return folder / name if folder is not None else None


def agent_pid() -> int:
    """The pid of the agent that started this process: the job folder's owner, else the parent."""
    folder = job_folder()
    if folder is not None:
        with contextlib.suppress(OSError, ValueError, ConfigError):
            return int(fs.read_bytes(folder / "owner").split()[0])
    return os.getppid()


# -- the inbox: one FIFO per process, read by a daemon thread -------------------------------------

Handler = Callable[[str], None]
_handlers: dict[str, Handler] = {}
"""What a message of each kind does in this process (``kind -> handler(argument)``)."""
_TOKEN = re.compile(r"[0-9a-f]{16}")
_TOKENS_KEPT = 64  # an answer names the last requests its process read, its own among them
NO_ANSWER = "(no answer within {wait:g} s: a process holding the GIL cannot answer)"
SKIPPED_FRAMES = (
    "ddpkit/_launch/agent/worker.py", "ddpkit/_launch/agent/forkserver.py", "<frozen runpy>",
    "elastic/multiprocessing",
)  # fmt: skip
"""Frames of the launch machinery, left out of a stack as shown."""


@dataclass
class _Inbox:
    pid: int
    fd: int
    fifo: Path
    answers: list[Path]
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False
    asked: deque[str] = field(default_factory=lambda: deque(maxlen=_TOKENS_KEPT))


_inbox: _Inbox | None = None  # this process's, once it reads one


def on_message(kind: str, handler: Handler) -> None:
    """Have this process's inbox call ``handler(argument)`` for each message ``kind argument``."""
    _handlers[kind] = handler


def serve(name: str | None = None) -> bool:
    """Read this process's inbox (``inbox/<pid>``, made now) from a daemon thread, once per process:
    stack requests answered in ``stacks/<pid>.txt`` and ``stacks/<name>.txt`` (default
    ``rank<RANK>``), other messages by their :func:`on_message` handlers. False where there is no
    inbox (outside ``ddpkit run``, or the folder cannot be used). Nothing is signalled."""
    global _inbox
    pid, folder = os.getpid(), job_folder()
    if folder is None or (_inbox is not None and _inbox.pid == pid):
        return _inbox is not None
    fifo = folder / INBOX / str(pid)
    name = name or f"rank{torchrun.rank_text(os.environ)}"
    answers = [folder / STACKS / f"{name}.txt", folder / STACKS / f"{pid}.txt"]  # awaited last
    try:
        for path in (fifo, *answers):  # a dead process's of this pid, or an earlier attempt's
            fs.remove(path)
        fd = fs.open_fifo(fifo, os.O_RDWR, create=True)
    except (OSError, ConfigError):
        return False
    if fd is None:
        return False
    inbox = _inbox = _Inbox(pid, fd, fifo, answers)
    atexit.register(_close, inbox)
    # a loader worker ends through multiprocessing's finalizers, not atexit's
    multiprocessing.util.Finalize(None, _close, args=(inbox,), exitpriority=0)
    threading.Thread(target=_read, args=(inbox,), name="ddpkit-inbox", daemon=True).start()
    return True


def _forget_in_child() -> None:
    global _inbox
    if _inbox is not None:
        with contextlib.suppress(OSError):
            os.close(_inbox.fd)
        _inbox = None


# a forked child inherits the descriptor, not the thread: a reader that never answers
os.register_at_fork(after_in_child=_forget_in_child)


def _close(inbox: _Inbox) -> None:
    """At the process's end: no more answers (one being written is finished), no FIFO left."""
    if inbox.pid != os.getpid():  # a forked child's inherited exit handler
        return
    acquired = inbox.lock.acquire(timeout=5)
    try:
        inbox.closed = True
        with contextlib.suppress(OSError, ConfigError):
            fs.remove(inbox.fifo)
    finally:
        if acquired:
            inbox.lock.release()


def _read(inbox: _Inbox) -> None:
    pending = b""
    while True:
        try:
            data = os.read(inbox.fd, 4096)
        except OSError:
            return
        if not data:  # never while this process holds the FIFO open to write too
            return
        *lines, pending = (pending + data).split(b"\n")
        stacks = False
        for line in lines:
            kind, _, argument = line.decode("ascii", "replace").partition(" ")
            if kind == "stack" and _TOKEN.fullmatch(argument):
                inbox.asked.append(argument)
                stacks = True
            elif (handler := _handlers.get(kind)) is not None:
                with contextlib.suppress(Exception):  # the next message is read all the same
                    handler(argument)
        if stacks:
            _answer(inbox)


def _answer(inbox: _Inbox) -> None:
    try:
        text = f"stacks of pid {inbox.pid}, asked by: {' '.join(inbox.asked)}\n"
        text += format_stacks(threading.get_ident())
        with inbox.lock:
            if inbox.closed:
                return
            for path in inbox.answers:
                fs.write_atomic(path, text.encode(errors="replace"))
    except Exception:  # noqa: BLE001  (a folder removed or full: the next request is answered)
        return


def send(pid: int, kind: str, argument: str = "") -> bool:
    """Put ``kind argument`` into process ``pid``'s inbox, without waiting; False where it has none
    (not started yet, or gone) or its FIFO is full."""
    folder = job_folder()
    if folder is None:
        return False
    try:
        fd = fs.open_fifo(folder / INBOX / str(pid), os.O_WRONLY | os.O_NONBLOCK)
    except (OSError, ConfigError):  # ENXIO: no reader; ENOENT: none made
        return False
    if fd is None:
        return False
    try:
        os.write(fd, f"{kind} {argument}\n".encode())  # one write under PIPE_BUF: never torn
    except OSError:  # EAGAIN: its pipe is full
        return False
    finally:
        os.close(fd)
    return True


def inboxes() -> list[int]:
    """The pids of the processes of this job on this node that read an inbox."""
    folder = channel(INBOX)
    try:
        return [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder else []
    except OSError:
        return []


# -- stacks: asked through the inbox, answered in files ------------------------------------------


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


def request_stack(pid: int) -> str | None:
    """Ask process ``pid`` for its stacks, without waiting; the request's token (its answer names
    it), or None where it reads no inbox."""
    token = secrets.token_hex(8)
    return token if send(pid, "stack", token) else None


def request_every_stack() -> dict[int, str]:
    """Ask every process of the job on this node for its stacks, without waiting; the pids asked,
    each with its request's token."""
    asked = {pid: request_stack(pid) for pid in inboxes()}
    return {pid: token for pid, token in asked.items() if token is not None}


def _answer_of(pid: int, token: str) -> str | None:
    """Process ``pid``'s answer, where it answers the request ``token``."""
    folder = channel(STACKS)
    try:
        text = fs.read_bytes(folder / f"{pid}.txt").decode(errors="replace") if folder else ""
    except (OSError, ConfigError):
        return None
    head, _, body = text.partition("\n")
    return body if token in head.split() else None


def answered(asked: Mapping[int, str], wait: float = 3.0) -> set[int]:
    """The pids of ``asked`` (pid -> token) that answered their request, waited for ``wait``
    seconds at most."""
    done: set[int] = set()
    deadline = time.monotonic() + wait
    while len(done) < len(asked) and time.monotonic() < deadline:
        done |= {pid for pid, token in asked.items() if _answer_of(pid, token) is not None}
        time.sleep(0.01)
    return done


def ask_stacks(pids: Mapping[K, int], wait: float = 3.0, lines: int = 10) -> dict[K, list[str]]:
    """Each process's main-thread stack (``key -> pid``), innermost first, without the launch
    machinery's frames, asked now, at most ``wait`` seconds in all. A process that reads no inbox
    is left out; one that did not answer in time gets the single line :data:`NO_ANSWER`."""
    asked = {key: (pid, t) for key, pid in pids.items() if (t := request_stack(pid))}
    out: dict[K, list[str]] = {}
    deadline = time.monotonic() + wait
    while True:
        for key, (pid, token) in asked.items():
            if key not in out and (text := _answer_of(pid, token)) is not None:
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
            if line.startswith("File ") and not any(skip in line for skip in SKIPPED_FRAMES):
                frames.append(line)
    return frames
