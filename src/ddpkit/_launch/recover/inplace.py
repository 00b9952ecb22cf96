"""In-place recovery (``ddpkit run --recover in-place``, docs/recovery.md): the workers' side
(:func:`leave`, :func:`sever`) and the agent's (:class:`InPlace`), which talk through files in
``$DDPKIT_RECOVER_DIR``; across nodes, the agents talk through the rendezvous store
(:class:`Nodes`), and a node that replaces a lost one takes its place there (:func:`join`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import secrets
import socket
import threading
import time
import traceback
from collections.abc import Iterable
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
BEAT = 0.1  # seconds between an agent's beats on the rendezvous store
LOST_AFTER = 0.8
"""Seconds without a beat after which a node's agent, and the node with it, counts as lost."""
KEY = "ddpkit/recover/"  # on the rendezvous store outside any round: a new node knows no round
NODE_WAITING = (
    "a new node waits in torch's rendezvous (it started before the loss was seen, or runs another "
    "--nproc): the job restarts with it"
)
GRACE = 5.0  # seconds more than a node's ranks get to leave, for its agent's word to arrive


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
    generation = last_recovery(where) + 1
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
    agent = int(os.environ.get("DDPKIT_AGENT_PID", os.getppid()))
    while os.getppid() == agent:  # an agent gone says no word: the error goes on
        if (found := _read_json(go)) is not None:
            os.environ[GO_ENV] = str(go)
            os.environ.update(
                torchrun.attempt_env(
                    found["restart_count"], found["master_addr"], found["master_port"]
                )
            )
            return found
        if end.exists():
            return None
        time.sleep(POLL)
    return None


def last_recovery(where: Path) -> int:
    """The last recovery the job's agent closed (went on or gave back), 0 before any."""
    try:
        return int(fs.read_bytes(where / "last") or b"0")
    except (OSError, ConfigError, ValueError):
        return 0


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
    reported: bool = False  # across nodes: this node's word is on the store
    offered: float | None = None  # across nodes: when the decider offered the lost nodes' places
    lost: set[int] | None = None  # across nodes: the nodes the decider found lost


class Nodes:
    """The agents of one job across nodes, meeting on its rendezvous store under :data:`KEY`.

    Per rendezvous round R, each agent adds to ``beat/R/N`` every :data:`BEAT` seconds from a
    thread of its own, and says its global ranks (``ranks/R/N``). A node whose count stands still
    :data:`LOST_AFTER` seconds by the reader's clock, and that did not say its workers finished
    (``done/R/N``), is lost; one that never beat is not judged. Recovery G: any agent raises
    ``incident`` to G; each says what its ranks did (``G/node/N``); the first to have said it
    decides (``G/decider``): it waits for every other node's word or loss, offers each lost node's
    place (``vacant``) until a new node claims it (``G/claim/N``, :func:`join`), and serves the
    workers' new store. Its go, or any agent's reason to give G back, is ``G/outcome``: the first
    written stands, and every agent follows it.
    """

    _NONE = b"\0none"  # compare_set's answer for a missing key, when asked to expect it

    def __init__(
        self, store: Any, node: int = -1, nodes: int = 0, addr: str = "", round_name: str = ""
    ) -> None:
        """The agent of node ``node`` of ``nodes`` (it beats from now on), or a reader (-1)."""
        self.store, self.node, self.nodes, self.addr = store, node, nodes, addr
        self.round = round_name
        self._beats: dict[int, tuple[bytes, float]] = {}  # node -> (count, since)
        self._stop = threading.Event()
        if node >= 0:
            threading.Thread(target=self._beat, name="ddpkit-beat", daemon=True).start()

    def _beat(self) -> None:
        key, store = f"{KEY}beat/{self.round}/{self.node}", None
        while not self._stop.is_set():
            try:
                # a connection of its own: a slow read of the agent's never holds a beat back
                store = store or _connection(self.store)
                store.add(key, 1)
            except Exception:  # noqa: BLE001  (a broken connection: a new one at the next beat)
                store = None
            self._stop.wait(BEAT)

    def close(self, finished: bool = False) -> None:
        """Stop beating; ``finished``: this node's workers succeeded (not lost when still)."""
        if finished:
            with contextlib.suppress(Exception):
                self.put(f"done/{self.round}/{self.node}", "1")
        self._stop.set()

    def read(self, key: str) -> bytes | None:
        """The value of ``key``, None where unset: one round trip, never a wait."""
        value = self.store.compare_set(KEY + key, self._NONE, self._NONE)
        return None if value == self._NONE else value

    def read_json(self, key: str) -> Any:
        value = self.read(key)
        return json.loads(value) if value is not None else None

    def put(self, key: str, value: Any) -> None:
        self.store.set(KEY + key, value if isinstance(value, str) else json.dumps(value))

    def first(self, key: str, value: str) -> bool:
        """Set ``key`` to ``value`` where unset; whether it holds ``value`` now."""
        return self.store.compare_set(KEY + key, "", value) == value.encode()

    def incident(self) -> int:
        """The newest recovery any node raised, 0 before any."""
        return int(self.read("incident") or b"0")

    def outcome(self, generation: int) -> dict[str, Any] | None:
        """Recovery ``generation``'s outcome, ``{"go": record}`` or ``{"end": why}``; None yet."""
        return self.read_json(f"{generation}/outcome")

    def settle(self, generation: int, outcome: dict[str, Any]) -> dict[str, Any]:
        """``outcome`` for recovery ``generation`` where none was written; the one that stands."""
        text = json.dumps(outcome)
        found = self.store.compare_set(f"{KEY}{generation}/outcome", "", text)
        return json.loads(found)

    def closed(self) -> int:
        """The newest recovery the nodes closed (went on or gave back), 0 before any."""
        g = self.incident()
        return g if not g or self.outcome(g) is not None else g - 1

    def raise_incident(self, generation: int) -> None:
        current = self.read("incident")
        if current is None or int(current) < generation:
            self.store.compare_set(KEY + "incident", current or "", str(generation))

    def lost(self, among: Iterable[int]) -> set[int]:
        """The nodes of ``among`` whose beat has stood still :data:`LOST_AFTER` seconds by this
        reader's clock (from its first look at least), and that did not finish."""
        now, out = time.monotonic(), set[int]()
        for node in among:
            count = self.read(f"beat/{self.round}/{node}")
            if count is None:  # not started yet: no verdict
                continue
            last = self._beats.get(node)
            if last is None or last[0] != count:
                self._beats[node] = (count, now)
            elif now - last[1] > LOST_AFTER and not self.finished(node):
                out.add(node)
        return out

    def finished(self, node: int) -> bool:
        """Whether ``node`` said its workers succeeded."""
        return self.read(f"done/{self.round}/{node}") is not None

    def forget(self, nodes: Iterable[int]) -> None:
        """Judge ``nodes`` afresh: their beats are read from the next look on."""
        for node in nodes:
            self._beats.pop(node, None)

    def neighbour_lost(self) -> bool:
        """Whether the next node is lost: each node watches one, every node is watched."""
        return bool(self.lost([(self.node + 1) % self.nodes]))


def _connection(store: Any) -> Any:
    """A new client connection to TCPStore ``store``'s server (older torch has no ``clone``)."""
    clone = getattr(store, "clone", None)
    if clone is not None:
        return clone()
    import torch.distributed as dist

    return dist.TCPStore(store.host, store.port, is_master=False, timeout=store.timeout)


@dataclass
class Joined:
    """A lost node's place taken by a new node: recovery ``go``'s record, the round's store name,
    and this node's link to the others (beating since its claim)."""

    node: int
    nodes: int
    round_name: str
    go: dict[str, Any]
    link: Nodes


def join(store: Any, addr: str, nproc: int, wait: float, join_timeout: float) -> Joined | None:
    """For a node of ``nproc`` workers starting in a job that recovers in place: the place of a
    lost node, claimed, once the job's agents say go; None where no place is open (or none opens
    within ``wait`` seconds of a recovery under way): torch's rendezvous follows."""
    link = Nodes(store)  # a reader: the agent beats once it has a place
    job = link.read_json("job")
    full = job is not None and _all_beating(store, job)
    if full:  # a place opens when a node is lost: taken here, the job goes on without a restart
        say(
            f"the job runs on all its {job['size']} node(s): waiting for one's place "
            f"(--join-timeout, {join_timeout:g} s)"
        )
    deadline = time.monotonic() + (join_timeout if full else wait)
    while True:
        generation = link.incident()
        if generation and link.outcome(generation) is None:
            vacant = link.read_json("vacant")
            if vacant is not None and vacant["recovery"] == generation:
                break
        elif not full:
            return None  # no recovery under way
        elif all(map(Nodes(store, round_name=job["round"]).finished, range(job["size"]))):
            raise ConfigError("the job finished while this node waited for a node's place")
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
    place = None
    claim = f"{addr} {os.getpid()} {secrets.token_hex(8)}"  # two new nodes never hold one claim
    sizes = {n: len(link.read_json(f"ranks/{vacant['round']}/{n}") or []) for n in vacant["nodes"]}
    for n, size in sizes.items():
        if size != nproc:
            say(f"not taking the place of lost node {n}: it ran {size} worker(s), this node "
                f"{nproc} (--nproc)")  # fmt: skip
        elif link.first(f"{generation}/claim/{n}", claim):
            place = n
            break
    if place is None and set(sizes.values()) == {nproc}:
        # in torch's rendezvous it would wait for a place the job never has: every restart
        # would take it in and leave a node out again
        raise ConfigError(
            f"the place of lost node(s) {_listed(vacant['nodes'])} was taken by another new node "
            f"(recovery {generation}): this node is not needed now; start it again to join the "
            "job at a later restart"
        )
    if place is None:
        return None  # of another size: torch's rendezvous takes it in at a whole restart
    say(f"taking the place of lost node {place} (recovery {generation})")
    # beating from now: the others must not count the place lost again while this node starts
    mine = Nodes(store, place, vacant["size"], addr, vacant["round"])
    deadline = time.monotonic() + join_timeout
    while time.monotonic() < deadline:
        outcome = link.outcome(generation)
        if outcome is not None and "go" in outcome:
            return Joined(place, vacant["size"], vacant["round"], outcome["go"], mine)
        if outcome is not None:
            break
        time.sleep(0.02)
    mine.close()
    return None


def _all_beating(store: Any, job: dict[str, Any]) -> bool:
    """Whether every node of ``job`` (its round and size) beats: each count moves within
    :data:`LOST_AFTER` seconds."""
    link = Nodes(store, round_name=job["round"])
    first = {n: link.read(f"beat/{job['round']}/{n}") for n in range(job["size"])}
    time.sleep(LOST_AFTER + BEAT)
    return all(
        count is not None and link.read(f"beat/{job['round']}/{n}") != count
        for n, count in first.items()
    )


class InPlace:
    """The agent's side: polled before torchrun's look at the workers (:meth:`poll`)."""

    def __init__(
        self,
        where: Path,
        timeout: float = LEAVE_TIMEOUT,
        join_timeout: float = 120.0,
        nproc: int = 1,
    ) -> None:
        self.folder = where
        self.incident: Incident | None = None
        self.generation = 0
        self.fallback = ""
        """Why the last failure was not recovered in place (empty where it was)."""
        self.ended = False
        """Set when an incident ends without recovery: torchrun takes the attempt over."""
        self.timeout = timeout
        self.join_timeout = join_timeout  # seconds a lost node's place is offered
        self.nproc = nproc  # this node's workers
        self.store: Any = None  # the workers' store after a recovery, served by the agent
        self.nodes: Nodes | None = None  # across nodes: the other agents
        self._nodes_of: Any = None  # the round store ``nodes`` was made for
        self.running = False  # the last poll found every worker running
        self.replaced = False
        """Set when this node was counted lost and a new node took its place: its agent ends."""
        self._handler: Any = None  # the rendezvous handler, across nodes

    def poll(self, agent: Any, group: Any) -> bool:
        """True while a failure is recovered in place: torchrun must not look at the workers."""
        processes = agent.worker_processes()
        codes = {w.global_rank: processes[w.local_rank].poll() for w in group.workers}
        self.running = all(c is None for c in codes.values())
        waiting = self._waiting()
        link = self._link(group)
        if self.incident is None:
            failed = {r for r, c in codes.items() if c not in (None, 0)}
            remote = link is not None and (
                link.incident() > self.generation or link.neighbour_lost()
            )
            if not failed and not waiting and not remote:
                return False
            self.incident = Incident(self.generation + 1, time.time())
            self.fallback = ""
            fs.write_atomic(self.folder / "incident", str(self.incident.generation).encode())
            if link is not None:
                link.raise_incident(self.incident.generation)
        incident = self.incident
        outcome = link.outcome(incident.generation) if link is not None else None
        if outcome is None:
            why = self._why_not(codes, agent)
            exited = {r: c for r, c in codes.items() if c is not None}
            if not why and set(exited) | set(waiting) != set(codes):
                late = sorted(set(codes) - set(exited) - set(waiting) - set(incident.stopped))
                if late and time.time() - incident.seen > self.timeout:
                    # Its state is in memory like the others': it is replaced, not waited for.
                    incident.stopped += late
                    agent.stop_late(late, group, self.timeout)
                return True
            if why:
                outcome = {"end": why}
                if link is not None:
                    outcome = link.settle(incident.generation, outcome)
            else:
                incident.replaced = exited
                if link is None:
                    outcome = {"go": self._decide(agent, waiting)}
                else:
                    outcome = self._across(link, agent, waiting)
                    if outcome is None:
                        return True
        if "go" in outcome and self._go(agent, group, waiting, outcome["go"]):
            return True
        # the waiting ranks fail as without the option; torchrun takes over
        self._end(outcome.get("end") or self.fallback)
        return False

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

    def _link(self, group: Any) -> Nodes | None:
        """The other agents, across nodes, for this round of the rendezvous; None on one node."""
        handler = getattr(getattr(group, "spec", None), "rdzv_handler", None)
        base = getattr(handler, "base", None)
        if handler is None or base is None or (getattr(group, "group_world_size", 1) or 1) < 2:
            return None
        self._handler = handler
        if self._nodes_of is not group.store:
            if self.nodes is not None:
                self.nodes.close()
            self._nodes_of = group.store
            self.nodes = Nodes(
                base, group.group_rank, group.group_world_size, handler.addr, handler.round_name
            )
            self.nodes.put(
                f"ranks/{handler.round_name}/{group.group_rank}",
                [w.global_rank for w in group.workers],
            )
            if group.group_rank == 0:  # what a new node finds: the job, at its size
                self.nodes.put("job", {"round": handler.round_name, "size": group.group_world_size})
        return self.nodes

    def _nodes_waiting(self) -> int:
        """Nodes waiting in torch's rendezvous for the next round."""
        waiting = getattr(self._handler, "nodes_waiting", None)
        return int(waiting()) if waiting is not None else 0

    def adopt(self, generation: int) -> None:
        """Count recoveries on from ``generation`` (the job's last, closed): the workers' too."""
        self.generation = generation
        fs.write_atomic(self.folder / "last", str(generation).encode())

    def joined(self, place: Joined, round_store: Any) -> Path:
        """A new node's start in a lost node's place (``round_store``: the round's store torch
        was given): its go record, for its workers."""
        self.nodes, self._nodes_of = place.link, round_store
        self.adopt(place.go["recovery"])
        path = self.folder / f"go-{place.go['recovery']}"
        fs.write_atomic(path, json.dumps(place.go).encode())
        return path

    def finished(self, succeeded: bool = True) -> None:
        """This node's agent stops beating; ``succeeded``: its workers did, and its silence from
        now on is not a loss."""
        if self.nodes is not None:
            self.nodes.close(finished=succeeded)
            self.nodes = self._nodes_of = None

    def _waiting(self) -> dict[int, dict[str, Any]]:
        paths = self.folder.glob(f"wait-{self.generation + 1}.*")
        return {int(r["rank"]): r for r in map(_read_json, paths) if r is not None}

    def _close_incident(self) -> None:
        assert self.incident is not None
        self.adopt(self.incident.generation)
        with contextlib.suppress(OSError, ConfigError):
            fs.remove(self.folder / "incident")
        self.incident = None

    def _end(self, why: str) -> None:
        """The incident given back: the waiting ranks fail with ``why``, as without the option."""
        assert self.incident is not None
        self.fallback, self.ended = why, True
        fs.write_atomic(self.folder / f"end-{self.incident.generation}", why.encode())
        if self.nodes is not None or self.replaced:  # torch may restart every node, unsaid
            say(f"not recovered in place (recovery {self.incident.generation}): {why}")
        self.finished(succeeded=False)  # the job restarts whole: a new node joins its rendezvous
        self._close_incident()

    def _decide(self, agent: Any, waiting: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """One node: the go record, with the workers' new store served here."""
        assert self.incident is not None
        incident = self.incident
        address = torchrun.master_address(agent.process_context().envs[0])
        host = address[0] if address else "127.0.0.1"
        return self._go_record(agent, host, sorted(incident.replaced), [], self._times(waiting))

    def _times(self, waiting: dict[int, dict[str, Any]]) -> list[dict[str, float]]:
        """When this node saw the failure, and when each of its ranks left and tore down."""
        assert self.incident is not None
        seen = self.incident.seen
        return [
            {"seen": seen, "left": r["left"], "torn_down": r["torn_down"]} for r in waiting.values()
        ] or [{"seen": seen}]

    def _go_record(
        self, agent: Any, host: str, replaced: list[int], lost: list[int], times: list[dict]
    ) -> dict[str, Any]:
        """The go record of the incident: a fresh store for the workers (the old one holds the old
        groups' keys, its server may be lost) served on ``host``; the last one served ends."""
        from ddpkit._internals.store import serve_new_store

        assert self.incident is not None
        self.store, port = serve_new_store(host, timedelta(minutes=5))
        return {
            "recovery": self.incident.generation,
            "restart_count": agent.restarts_used() + 1,
            "replaced": replaced,
            "lost_nodes": lost,
            # the failure's first sign: an agent's look, or a rank's leaving before it
            "seen": min(min(t["seen"], t.get("left", t["seen"])) for t in times),
            "left": max(t.get("torn_down", t["seen"]) for t in times),
            "decided": time.time(),
            "master_addr": host,
            "master_port": port,
        }

    def _across(
        self, link: Nodes, agent: Any, waiting: dict[int, dict[str, Any]]
    ) -> dict[str, Any] | None:
        """Across nodes: the outcome that stands once there is one, or None (wait)."""
        assert self.incident is not None
        incident = self.incident
        g = incident.generation
        if not incident.reported:
            link.put(f"{g}/node/{link.node}", {
                "exited": sorted(incident.replaced), "times": self._times(waiting),
            })  # fmt: skip
            incident.reported = True
        link.first(f"{g}/decider", str(link.node))
        decider = int(link.read(f"{g}/decider") or b"-1")
        waited = time.time() - incident.seen
        if decider != link.node:
            if link.lost([decider]):
                return link.settle(g, {"end": f"node {decider}, deciding the recovery, was lost"})
            if waited > self.timeout + LOST_AFTER + self.join_timeout + GRACE:
                return link.settle(
                    g, {"end": f"no word from node {decider}, deciding the recovery"}
                )
            return None
        reports = {n: link.read_json(f"{g}/node/{n}") for n in range(link.nodes)}
        if incident.lost is None:
            missing = {n for n, r in reports.items() if r is None}
            if done := sorted(n for n in missing if link.finished(n)):
                return link.settle(g, {"end": f"node(s) {_listed(done)} had already finished"})
            found = link.lost(missing)
            if missing - found:
                if waited > self.timeout + LOST_AFTER + GRACE:
                    late = _listed(sorted(missing - found))
                    return link.settle(g, {"end": f"node(s) {late} did not say what their ranks "
                                                  f"did within {waited:.0f} s"})  # fmt: skip
                return None
            incident.lost = found
        lost = incident.lost
        for n in sorted(lost):
            # a node counted lost that speaks after all keeps its place, where none claimed it
            if reports[n] is not None and link.first(f"{g}/claim/{n}", "-"):
                lost.discard(n)
        if lost and (why := self._unclaimed(link, g, lost)) is not None:
            return link.settle(g, {"end": why}) if why else None
        replaced = {r for rep in reports.values() if rep is not None for r in rep["exited"]}
        replaced.update(r for n in lost for r in link.read_json(f"ranks/{link.round}/{n}") or [])
        times = [t for rep in reports.values() if rep is not None for t in rep["times"]]
        go = self._go_record(agent, link.addr, sorted(replaced), sorted(lost), times)
        outcome = link.settle(g, {"go": go})
        if "go" not in outcome:
            self.store = None  # given back meanwhile: the store served for it ends
        return outcome

    def _unclaimed(self, link: Nodes, g: int, lost: set[int]) -> str | None:
        """The lost nodes' places offered (once): None once a new node claimed each, "" to wait
        on, or why to give the recovery back."""
        assert self.incident is not None
        if self.incident.offered is None:
            self.incident.offered = time.monotonic()
            link.put("vacant", {"recovery": g, "nodes": sorted(lost), "size": link.nodes,
                                "round": link.round})  # fmt: skip
            say(
                f"node(s) {_listed(sorted(lost))} lost (no beat for {LOST_AFTER:g} s): start the "
                f"same ddpkit run command on a new node to take its place (waiting "
                f"{self.join_timeout:g} s, --join-timeout)"
            )
        if all(link.read(f"{g}/claim/{n}") is not None for n in lost):
            return None
        if self._nodes_waiting():
            return NODE_WAITING
        if time.monotonic() - self.incident.offered > self.join_timeout:
            return (
                f"no new node took the place of lost node(s) {_listed(sorted(lost))} within "
                f"--join-timeout ({self.join_timeout:g} s)"
            )
        return ""

    def _go(
        self, agent: Any, group: Any, waiting: dict[int, dict[str, Any]], go: dict[str, Any]
    ) -> bool:
        """Go on after the incident by ``go``; False where this node was replaced instead."""
        assert self.incident is not None
        incident = self.incident
        if self.nodes is not None and self.nodes.node in go["lost_nodes"]:
            # counted lost while alive (its beat stood still): a new node has its place, and
            # this node's ranks end; its agent ends the job here, leaving the rendezvous open
            self.fallback = (
                f"this node was counted lost (no beat for {LOST_AFTER:g} s) and replaced"
            )
            self.replaced = True
            agent.stop_restarting()
            self.nodes.close()  # its beat is the new node's now
            self.nodes = None
            agent.stop_workers()  # a rank still in a collective of the old world never reads why
            return False
        agent.use_restart()
        if self.nodes is not None:
            self.nodes.forget(go["lost_nodes"])  # their new nodes' beats count from now
        by_rank = {w.global_rank: w for w in group.workers}
        path = self.folder / f"go-{incident.generation}"
        fs.write_atomic(path, json.dumps(go).encode())  # before a replacement can look for it
        env = torchrun.attempt_env(go["restart_count"], go["master_addr"], go["master_port"])
        for rank in incident.replaced:
            agent.replace_worker(by_rank[rank], {GO_ENV: str(path), **env})
        agent.recovered()
        from ddpkit._launch.cli.run import signal_name  # the launcher imports this module

        kinds = [
            f"rank {r} (killed by {signal_name(-c)})" if c < 0 else f"rank {r} (exit code {c})"
            for r, c in sorted(incident.replaced.items())
        ]
        kept = sorted(waiting)
        done = [f"replaced {', '.join(kinds)}"] if kinds else []
        if go["lost_nodes"]:
            done += [f"lost node(s) {_listed(go['lost_nodes'])} replaced by new ones"]
        done += [f"rank(s) {_listed(kept)} go on in their processes"] if kept else []
        say(
            f"recovering in place (recovery {incident.generation}, "
            f"{agent.restarts_left()} restart(s) left): {'; '.join(done)}"
        )
        self._close_incident()
        return True


def _listed(numbers: Iterable[int]) -> str:
    return ", ".join(map(str, numbers))


def prepare(run_dir: Path, join_timeout: float = 120.0, nproc: int = 1) -> InPlace:
    """The agent's side, its folder made in ``run_dir`` and its path set for the workers."""
    from ddpkit.distributed._environment import parse_seconds

    text = os.environ.get(TIMEOUT_ENV)
    timeout = parse_seconds(TIMEOUT_ENV, text) if text else LEAVE_TIMEOUT
    where = run_dir / "recover"
    fs.make_dirs(where, root=run_dir)
    os.environ[DIR_ENV] = str(where)
    return InPlace(where, timeout, join_timeout, nproc)
