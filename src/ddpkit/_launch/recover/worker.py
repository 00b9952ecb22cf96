"""The worker's side of in-place recovery (docs/recovery.md). Told of a failure (its inbox's
``incident G``), a worker cuts every connection its process groups made, so that no rank waits
for a lost one (:func:`sever`); its script's exception unwinds; the worker lets go of everything
the failed run held, so that the next run starts from a process as clean as a fresh one
(:func:`clean`), says so to its agent and waits for its word (:func:`leave`). Its script then runs
again in the same process.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit import _fs as fs
from ddpkit._errors import PREEMPTED_EXIT_CODE, ConfigError, Preempted
from ddpkit._fs import lock
from ddpkit._launch.proctree import sockets
from ddpkit.distributed import _channels as channels
from ddpkit.distributed import _runtime
from ddpkit.platforms import _torchrun as torchrun

WORD_POLL = 0.1
"""Seconds between a waiting worker's looks at its agent's word where no message wakes it."""


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(fs.read_bytes(path))
    except (OSError, ConfigError, ValueError):
        return None


def last_recovery(where: Path) -> int:
    """The last recovery this node's agent closed (went on or gave back), 0 before any."""
    try:
        return int(fs.read_bytes(where / "last") or b"0")
    except (OSError, ConfigError, ValueError):
        return 0


def _pending(where: Path) -> int:
    """The recovery the agent has under way (its ``incident`` file), 0 when none."""
    try:
        return int(fs.read_bytes(where / "incident") or b"0")
    except (OSError, ConfigError, ValueError):
        return 0


@dataclass
class _Baseline:
    """What the process had before its script first ran: what a rerun goes back to, or names."""

    handlers: dict[int, Any]
    threads: set[int]

    @classmethod
    def now(cls) -> _Baseline:
        handlers = {}
        for sig in signal.valid_signals():
            with contextlib.suppress(OSError, ValueError, TypeError):
                handler = signal.getsignal(sig)
                if handler is not None:  # None: installed outside Python, not ours to put back
                    handlers[int(sig)] = handler
        return cls(handlers, {t.ident for t in threading.enumerate() if t.ident is not None})


@dataclass
class _Worker:
    """This worker's part in the job's recoveries (made by :func:`start`)."""

    baseline: _Baseline
    handled: int = 0  # the newest recovery it has cut its links for
    went_on: int = 0  # the recovery its run goes on after (or started in)
    recovery: dict[str, Any] | None = None  # the agent's go record of the recovery its run is in
    recorded: int = 0  # the recovery whose ``recover`` event a resume recorded
    lock: threading.Lock = field(default_factory=threading.Lock)
    word: threading.Event = field(default_factory=threading.Event)  # the agent's word is written


_worker: _Worker | None = None
_links: list[tuple[int, str]] = []  # (fd, "socket:[inode]") made while a process group was made
_making: list[dict[int, str]] = []  # each group being made now: the sockets before it began


def start() -> None:
    """In a worker of a job that recovers in place, before its script first runs: the groups it
    makes note their connections, its inbox acts on the recovery's news, and a resume records the
    recovery it runs in. A replacement started inside recovery G counts G handled: the failure it
    replaces is not a new one."""
    global _worker
    where = channels.channel(channels.RECOVER)
    if where is None or not where.is_dir():
        return
    note_links()
    recovery = _started_in(where)
    started_in = int(recovery["recovery"]) if recovery is not None else 0
    channels.on_message("incident", lambda g: _sever_for(int(g)))
    channels.on_message("word", lambda g: _worker.word.set() if _worker is not None else None)
    _runtime.on_resume(_recover_event)
    channels.serve()
    # what the process had before its script first ran: after the inbox's thread
    _worker = _Worker(_Baseline.now(), started_in, started_in, recovery)
    # a failure raised before this process read its inbox: its message went to no one
    if (pending := _pending(where)) > started_in:
        _sever_for(pending)


def _started_in(where: Path) -> dict[str, Any] | None:
    """The go record of the recovery this process was started in (a replacement), else None."""
    go = read_json(where / f"go-{last_recovery(where)}")
    restart = torchrun.restart_count(os.environ)
    return go if go is not None and go.get("restart_count") == restart else None


def _sever_for(generation: int) -> None:
    """:func:`sever` once for recovery ``generation``, from whichever thread comes first: once the
    ranks meet again, a late cut would sever the new group's connections."""
    worker = _worker
    if worker is None:
        return
    with worker.lock:
        if worker.handled < generation:
            worker.handled = generation
            sever()


def _noting_links(make: Any) -> Any:
    """``make`` (one of torch's makers of process groups), noting the sockets it opens: gloo's
    connections to the other ranks, which :func:`sever` cuts, while it runs too."""

    @functools.wraps(make)
    def made(*args: Any, **kwargs: Any) -> Any:
        _refuse_while_cut_off()
        before = sockets()
        _making.append(before)
        try:
            return make(*args, **kwargs)
        finally:
            # noted before the group stops counting as being made: a cut in between misses none
            _links.extend((fd, t) for fd, t in sockets().items() if before.get(fd) != t)
            _making.remove(before)
            # a cut while it was made may have come before some of its connections: its group is
            # the failed run's, and its connections are cut with it
            _refuse_while_cut_off(sever_first=True)

    return made


def _refuse_while_cut_off(sever_first: bool = False) -> None:
    """Raise where this worker is cut off for a failure not yet recovered: a group made now would
    wait for a lost rank."""
    worker = _worker
    if worker is None or worker.handled <= worker.went_on:
        return
    if sever_first:
        with worker.lock:
            sever()
    raise RuntimeError(
        f"a failure is being recovered in place (recovery {worker.handled}): this rank leaves "
        "its step instead of making a process group"
    )


def note_links() -> None:
    """Have every process group this worker makes note its sockets (once per process)."""
    from ddpkit._internals.groups import wrap_group_makers

    wrap_group_makers(_noting_links)


def sever() -> None:
    """Fail at once every peer's pending and next collective with this worker, this worker's next
    one, and its waits on the store: shut down the sockets its gloo groups opened (and those of a
    group being made; gloo's ``abort`` does not end a peer's wait) and its connections to the job's
    store; abort NCCL's groups."""
    from ddpkit._internals.groups import abort_nccl_groups

    address, store = torchrun.master_address(os.environ), None
    with contextlib.suppress(OSError):  # a name no longer resolved: the store's connection stays
        store = (socket.gethostbyname(address[0]), int(address[1])) if address else None
    now = sockets()
    cut = dict(_links)
    for before in list(_making):
        cut.update({fd: t for fd, t in now.items() if before.get(fd) != t})
    for fd, target in now.items():
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=os.dup(fd))
            try:
                # not a listener: gloo aborts the process when its accept() fails
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                if cut.get(fd) == target or (store is not None and _peer(s) == store):
                    s.shutdown(socket.SHUT_RDWR)
            finally:
                s.close()
    _links.clear()
    with contextlib.suppress(Exception):  # a group already broken
        abort_nccl_groups()


def _peer(s: socket.socket) -> tuple[str, int] | None:
    """The socket's peer address, None where it has none."""
    try:
        address = s.getpeername()
    except OSError:
        return None
    if not isinstance(address, tuple):
        return None
    host = address[0].removeprefix("::ffff:")  # an IPv4 peer of an IPv6 socket (torch's store)
    return host, address[1]


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]


def clean(error: BaseException) -> list[str]:
    """Let go of everything the failed run held, so that the script runs again in a process as
    clean as a fresh one: the failed frames' locals, what the run holds through ddpkit (snapshots'
    stores and threads, folder locks), every process group (and torch's count of them), the signal
    handlers the run installed; then its objects, collected. What stays alive regardless (a thread
    the script started, an object a module of its own keeps), a line each."""
    import torch

    # the frames of a traceback hold the script's globals (a module's frame keeps them whatever
    # clear_frames does): the error keeps its traceback as text (for the agent's error file)
    error.__ddpkit_traceback__ = "".join(traceback.format_exception(error))  # type: ignore[attr-defined]
    # released first: a store's finalizer may need the frames' objects whole
    left = _runtime.release_all()
    for e in _chain(error):
        traceback.clear_frames(e.__traceback__)
        e.__traceback__ = None
    lock.release_all()
    _runtime.forget_for_recovery()
    baseline = _worker.baseline if _worker is not None else None
    if baseline is not None:
        for sig, handler in baseline.handlers.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                if signal.getsignal(sig) is not handler:
                    signal.signal(sig, handler)
    gc.collect()
    # the process's own objects were frozen before the script first ran (worker.main): what the
    # collector still tracks of these kinds is the failed run's
    kinds = {"optimizer(s)": torch.optim.Optimizer, "module(s)": torch.nn.Module}
    with warnings.catch_warnings():  # an object whose class is deprecated warns when asked
        warnings.simplefilter("ignore")
        alive = {
            name: [o for o in gc.get_objects() if isinstance(o, kind)]
            for name, kind in kinds.items()
        }
    if any(alive.values()):
        counts = ", ".join(f"{len(found)} {name}" for name, found in alive.items() if found)
        first = next(found[0] for found in alive.values() if found)
        left.append(f"{counts} of the failed run stay alive ({_held_by(first)})")
    if baseline is not None:
        threads = [
            t.name
            for t in threading.enumerate()
            if t.ident not in baseline.threads and t.is_alive()
        ]
        if threads:
            left.append(f"thread(s) the failed run started still run: {', '.join(threads)}")
    return left


def _held_by(obj: Any, depth: int = 3) -> str:
    """What holds ``obj``, in words: the module whose global reaches it (through ``depth``
    containers at most), else what refers to it."""
    import types

    modules = {id(vars(m)): name for name, m in list(sys.modules.items()) if hasattr(m, "__dict__")}
    seen, level, found = {id(obj)}, [obj], set()
    for _ in range(depth):
        referrers = [r for o in level for r in gc.get_referrers(o) if id(r) not in seen]
        for ref in referrers:
            seen.add(id(ref))
            if id(ref) in modules:
                return f"held by a global of module {modules[id(ref)]}"
            if isinstance(ref, types.FrameType) and ref.f_code.co_filename != __file__:
                found.add(f"a frame of {ref.f_code.co_name}")
            elif isinstance(ref, types.CellType):
                found.add("a closure")
        level = [r for r in referrers if isinstance(r, (dict, list, tuple, set))]
    return "held by " + (", ".join(sorted(found)[:4]) if found else "a container of its own")


def leave(error: BaseException) -> bool:
    """After the script raised ``error`` in a job that recovers in place: cut and tear down what the
    failed run held, say so to the agent and wait for its word; True to run the script again (the
    variables of the go set), False where the error goes on as without in-place recovery."""
    where, worker = channels.channel(channels.RECOVER), _worker
    if where is None or worker is None or not _recoverable(error):
        return False
    # the newest of: the agent's last closed recovery, the one under way, the one this worker was
    # told of, the one its run went on after (before the agent wrote it last)
    latest = max(last_recovery(where), worker.handled - 1, _pending(where) - 1, worker.went_on)
    generation = latest + 1
    left = time.time()
    _sever_for(generation)
    severed = time.time()
    rank = torchrun.rank_text(os.environ)
    text = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    print(f"ddpkit: rank {rank} left its step ({text})", file=sys.stderr, flush=True)
    for line in clean(error):
        print(f"ddpkit: rank {rank}: {line}", file=sys.stderr, flush=True)
    record = {"rank": int(rank or 0), "pid": os.getpid(), "error": text, "left": left}
    record |= {"severed": severed, "torn_down": time.time()}
    fs.write_atomic(where / f"wait-{generation}.{rank}", json.dumps(record).encode())
    go = _word_of(worker, where, generation)
    if go is None:
        return False
    worker.recovery, worker.went_on = go, generation
    os.environ.update(
        torchrun.attempt_env(go["restart_count"], go["master_addr"], go["master_port"])
    )
    return True


def _word_of(worker: _Worker, where: Path, generation: int) -> dict[str, Any] | None:
    """The agent's go record of recovery ``generation``; None for its end, or where it is gone."""
    go, end = where / f"go-{generation}", where / f"end-{generation}"
    agent = channels.agent_pid()
    while os.getppid() == agent:  # an agent gone says no word: the error goes on
        worker.word.clear()
        if (found := read_json(go)) is not None:
            return found
        if end.exists():
            return None
        worker.word.wait(WORD_POLL)
    return None


def _recoverable(error: BaseException) -> bool:
    """A success (``sys.exit(0)``), a pre-emption, Ctrl-C and a refused configuration (the same
    again at every run) end the worker as they would."""
    if isinstance(error, (KeyboardInterrupt, ConfigError)):
        return False
    if isinstance(error, SystemExit):
        return error.code not in (None, 0, PREEMPTED_EXIT_CODE)
    return not isinstance(error, Preempted)


def _recover_event(resume: _runtime.Resume) -> dict[str, Any] | None:
    """The ``recover`` event of the first resume after a recovery in place (rank 0's times: from
    the failure's first sign to its state loaded)."""
    worker = _worker
    go = worker.recovery if worker is not None else None
    if worker is None or go is None or go["recovery"] == worker.recorded:
        return None
    worker.recorded = go["recovery"]
    seen, left, decided = go["seen"], go["left"], go["decided"]
    return {
        "event": "recover", "recovery": go["recovery"], "replaced": go["replaced"],
        "step": resume.step, "source": resume.source, "seen": seen,
        "seconds": {
            "leave": round(left - seen, 4), "decide": round(decided - left, 4),
            "regroup": round(_runtime.joined_at - decided, 4),
            "restore": round(resume.restored - resume.started, 4),
            "total": round(resume.restored - seen, 4),
        },
    }  # fmt: skip
