"""In-place recovery (``ddpkit run --recover in-place``, docs/recovery.md): the workers' side
(:func:`leave`, :func:`sever`) and the agent's (:class:`InPlace`), which talk through files in
``$DDPKIT_RECOVER_DIR``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from ddpkit import _fs as fs
from ddpkit._errors import PREEMPTED_EXIT_CODE, ConfigError, Preempted
from ddpkit._fs import lock
from ddpkit._launch import say
from ddpkit._launch.proctree import sockets
from ddpkit.distributed._environment import RECOVER_DIR_ENV as DIR_ENV
from ddpkit.distributed._environment import RECOVERED_ENV as GO_ENV
from ddpkit.platforms import _torchrun as torchrun

LEAVE_TIMEOUT = 10.0
"""Seconds every rank gets to leave its step once a failure is seen; a rank still in it then is
killed and replaced (``$DDPKIT_RECOVER_TIMEOUT`` sets another)."""
TIMEOUT_ENV = "DDPKIT_RECOVER_TIMEOUT"
POLL = 0.005  # seconds between a waiting worker's looks at the folder


def folder() -> Path | None:
    """The job's recovery folder, where this worker recovers in place; else None."""
    path = os.environ.get(DIR_ENV)
    return Path(path) if path else None


_links: list[tuple[int, str]] = []  # (fd, "socket:[inode]") made while a process group was made
_handled = 0  # the last recovery this worker cut its links for
_handling = threading.Lock()


def _sever_for(generation: int) -> None:
    """:func:`sever` once for recovery ``generation``, from whichever thread comes first: once the
    ranks meet again, a late cut would sever the new group's connections."""
    global _handled
    with _handling:
        if _handled < generation:
            _handled = generation
            sever()


def _noting_links(make: Any) -> Any:
    """``make`` (torch's ``init_process_group`` or ``new_group``), noting the sockets it opened:
    gloo's connections to the other ranks, which :func:`sever` cuts."""

    @functools.wraps(make)
    def made(*args: Any, **kwargs: Any) -> Any:
        before = sockets()
        try:
            return make(*args, **kwargs)
        finally:
            _links.extend((fd, t) for fd, t in sockets().items() if before.get(fd) != t)

    made.__wrapped_by_ddpkit__ = True  # type: ignore[attr-defined]
    return made


def note_links() -> None:
    """Have every process group this worker makes note its sockets (once per process)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for name in ("init_process_group", "new_group"):
        fn = getattr(c10d, name)
        if not getattr(fn, "__wrapped_by_ddpkit__", False):
            wrapped = _noting_links(fn)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)


def sever() -> None:
    """Fail at once every peer's pending and next collective with this worker, this worker's next
    one, and its waits on the store: shut down the sockets its gloo groups opened (gloo's ``abort``
    does not end a peer's wait) and its connections to the job's store; abort NCCL's groups."""
    from ddpkit._internals.elastic import abort_nccl_groups

    address = torchrun.master_address(os.environ)
    store = (socket.gethostbyname(address[0]), int(address[1])) if address else None
    links = dict(_links)
    for fd, target in sockets().items():
        with contextlib.suppress(OSError):
            s = socket.socket(fileno=os.dup(fd))
            try:
                # not a listener: gloo aborts the process when its accept() fails
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue
                if links.get(fd) == target or (store is not None and _peer(s) == store):
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


def watch_incidents() -> None:
    """A daemon thread that severs this worker's collectives when the agent names a failure."""
    where = folder()
    if where is None:
        return

    def run() -> None:
        incident = where / "incident"
        while True:
            time.sleep(0.02)
            if not os.path.exists(incident):  # a stat: every 20 ms in every worker
                continue
            with contextlib.suppress(OSError, ValueError, ConfigError):
                newest = int(fs.read_bytes(incident) or b"0")
                if newest > _handled:  # once per recovery: the file stays until the agent decides
                    _sever_for(newest)

    threading.Thread(target=run, name="ddpkit-recover", daemon=True).start()


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(fs.read_bytes(path))
    except (OSError, ConfigError, ValueError):
        return None


def leave(error: BaseException) -> dict[str, Any] | None:
    """After the script raised ``error`` in a recovering job: cut and tear down this worker's
    process group, say so to the agent and wait for its word; the ``go`` record to run again by,
    or None (``end``): the error goes on as without in-place recovery."""
    from ddpkit.distributed import _runtime

    where = folder()
    if where is None or not _recoverable(error):
        return None
    # one past the last ``go`` in the folder
    done = [int(p.name[3:]) for p in where.glob("go-*") if p.name[3:].isdigit()]
    generation = max(done, default=0) + 1
    left = time.time()
    # the failed run's folder locks and locals (loader workers, model) go now, not when collected
    lock.release_all()
    traceback.clear_frames(error.__traceback__)
    _sever_for(generation)
    severed = time.time()
    _runtime.forget_for_recovery()
    rank = torchrun.rank_text(os.environ)
    text = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    record = {"rank": int(rank), "pid": os.getpid(), "error": text, "left": left}
    record |= {"severed": severed, "torn_down": time.time()}
    fs.write_atomic(where / f"wait-{generation}.{rank}", json.dumps(record).encode())
    # free what the failed run held (model, optimizer, device memory: in reference cycles)
    gc.collect()
    go, end = where / f"go-{generation}", where / f"end-{generation}"
    while True:
        if (found := _read_json(go)) is not None:
            os.environ[GO_ENV] = str(go)
            os.environ.update(torchrun.attempt_env(found["restart_count"], found["master_port"]))
            return found
        if end.exists():
            return None
        time.sleep(POLL)


def _recoverable(error: BaseException) -> bool:
    """A success (``sys.exit(0)``), a pre-emption, Ctrl-C and a refused configuration (the same
    again at every run) end the worker as they would."""
    if isinstance(error, (KeyboardInterrupt, ConfigError)):
        return False
    if isinstance(error, SystemExit):
        return error.code not in (None, 0, PREEMPTED_EXIT_CODE)
    return not isinstance(error, Preempted)


@dataclass
class Incident:
    """A failure being recovered: recovery ``generation``, seen at ``seen`` (time.time())."""

    generation: int
    seen: float
    replaced: dict[int, int] = field(default_factory=dict)  # global rank -> exit code
    stopped: list[int] = field(default_factory=list)  # ranks killed for not leaving in time


class InPlace:
    """The agent's side: polled before torchrun's look at the workers (:meth:`poll`)."""

    def __init__(self, where: Path, timeout: float = LEAVE_TIMEOUT) -> None:
        self.folder = where
        self.incident: Incident | None = None
        self.generation = 0
        self.fallback = ""
        """Why the last failure was not recovered in place (empty where it was)."""
        self.ended = False
        """Set when an incident ends without recovery: torchrun takes the attempt over."""
        self.timeout = timeout
        self.store: Any = None  # the workers' store after a recovery, served by the agent

    def poll(self, agent: Any, group: Any) -> bool:
        """True while a failure is recovered in place: torchrun must not look at the workers."""
        processes = agent.worker_processes()
        codes = {w.global_rank: processes[w.local_rank].poll() for w in group.workers}
        waiting = self._waiting()
        if self.incident is None:
            failed = {r for r, c in codes.items() if c not in (None, 0)}
            if not failed and not waiting:
                return False
            self.incident = Incident(self.generation + 1, time.time())
            self.fallback = ""
            fs.write_atomic(self.folder / "incident", str(self.incident.generation).encode())
        incident = self.incident
        why = self._why_not(codes, agent)
        if why:  # the waiting ranks fail as without the option; torchrun takes over
            self.fallback, self.ended = why, True
            fs.write_atomic(self.folder / f"end-{incident.generation}", why.encode())
            self._close_incident()
            return False
        exited = {r: c for r, c in codes.items() if c is not None}
        if set(exited) | set(waiting) != set(codes):
            late = sorted(set(codes) - set(exited) - set(waiting) - set(incident.stopped))
            if late and time.time() - incident.seen > self.timeout:
                # Its state is in memory like the others': it is replaced, not waited for.
                incident.stopped += late
                agent.stop_late(late, group, self.timeout)
            return True
        incident.replaced = exited
        self._go(agent, group, waiting)
        return True

    def _why_not(self, codes: dict[int, int | None], agent: Any) -> str:
        if any(c == PREEMPTED_EXIT_CODE for c in codes.values()):
            return "a rank was pre-empted"
        if any(c == 0 for c in codes.values()):
            return "a rank had already finished"
        if agent.restarts_left() < 1:
            return "no restart left (--max-restarts)"
        if agent.stall is not None:
            return "the stall watch ended the attempt"
        return ""

    def _waiting(self) -> dict[int, dict[str, Any]]:
        paths = self.folder.glob(f"wait-{self.generation + 1}.*")
        return {int(r["rank"]): r for r in map(_read_json, paths) if r is not None}

    def _close_incident(self) -> None:
        assert self.incident is not None
        self.generation = self.incident.generation
        with contextlib.suppress(OSError, ConfigError):
            fs.remove(self.folder / "incident")
        self.incident = None

    def _go(self, agent: Any, group: Any, waiting: dict[int, dict[str, Any]]) -> None:
        assert self.incident is not None
        incident = self.incident
        agent.use_restart()
        restart_count = agent.restarts_used()
        by_rank = {w.global_rank: w for w in group.workers}
        go = {
            "recovery": incident.generation,
            "restart_count": restart_count,
            "replaced": sorted(incident.replaced),
            # the failure's first sign: the agent's look, or a rank's leaving before it
            "seen": min([incident.seen] + [r["left"] for r in waiting.values()]),
            "left": max((r["torn_down"] for r in waiting.values()), default=incident.seen),
            "decided": time.time(),
        }
        # a fresh store (the old one holds the old groups' keys, its server may be the lost rank),
        # on the workers' MASTER_ADDR alone; the last one this agent served ends now
        from ddpkit._internals.store import serve_new_store

        address = torchrun.master_address(agent.process_context().envs[0])
        host = address[0] if address else "127.0.0.1"
        self.store, go["master_port"] = serve_new_store(host, timedelta(minutes=5))
        path = self.folder / f"go-{incident.generation}"
        fs.write_atomic(path, json.dumps(go).encode())  # before a replacement can look for it
        for rank in incident.replaced:
            agent.replace_worker(by_rank[rank], {
                GO_ENV: str(path), **torchrun.attempt_env(restart_count, go["master_port"]),
            })  # fmt: skip
        from ddpkit._launch.launcher import signal_name  # the launcher imports this module

        kinds = [
            f"rank {r} (killed by {signal_name(-c)})" if c < 0 else f"rank {r} (exit code {c})"
            for r, c in sorted(incident.replaced.items())
        ]
        kept = sorted(waiting)
        done = [f"replaced {', '.join(kinds)}"] if kinds else []
        done += [f"rank(s) {', '.join(map(str, kept))} go on in their processes"] if kept else []
        say(
            f"recovering in place (recovery {incident.generation}, "
            f"{agent.restarts_left()} restart(s) left): {'; '.join(done)}"
        )
        self._close_incident()


def prepare(run_dir: Path) -> InPlace:
    """The agent's side, its folder made in ``run_dir`` and its path set for the workers."""
    from ddpkit.distributed._environment import parse_seconds

    text = os.environ.get(TIMEOUT_ENV)
    timeout = parse_seconds(TIMEOUT_ENV, text) if text else LEAVE_TIMEOUT
    where = run_dir / "recover"
    fs.make_dirs(where, root=run_dir)
    os.environ[DIR_ENV] = str(where)
    return InPlace(where, timeout)
