"""The stall watch across nodes: each node's agent publishes where its ranks are, and judges with
the job's view.

A rank's record lives in its node's shared memory (:mod:`ddpkit.distributed._progress`), where only
that node's agent reads it. So that a rank is named when the ranks that wait for it are on other
nodes (one rank per node, or a whole node waiting), each agent writes a summary of its own ranks to
the job's rendezvous store, under one key per node that it overwrites (:data:`KEY`): for each
running rank its step, collectives entered, phase, op, seconds since its record last changed,
allowance, pid and process state, and the node's host; a few dozen bytes a rank. Nothing of it is on
the ranks' path: the agent's own thread (:class:`Exchange`) talks to the store, and reads the other
nodes' summaries only while one of its ranks has been idle for half its allowance, so a healthy job
writes one small value per node and poll and reads none.

Every agent then judges the same view (:func:`decide`): the rank behind all others, idle past its
allowance (or, when every rank waits in one collective under different ops, the ranks whose op is
not the others': :func:`disagreement`), is named by the agent of its node, the one that can read its
``/proc`` state, ask for its stack and kill it; an agent whose own ranks are idle waiting for a
stalled rank of another node says which one, on which host, doing what, with its own ranks' stacks,
and leaves the ending to that rank's agent, which kills the rank once the others have said so
(:data:`HEARD_WAIT`); see :class:`Waiting` for when a waiting node ends the job itself.

Times are never compared across machines: a summary carries durations, and a reader ages them by its
own clock from the moment it first saw that publication (each carries a count that every publication
raises), so the ranks of an agent that stopped publishing look ever more idle rather than frozen in
time.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddpkit.distributed._progress import OPS, PHASE_NAMES, Phase

KEY = "ddpkit_watch/node{}"
"""The store key of node N's summary, under the prefix torch gives each rendezvous round: a
restarted job's agents never read the summaries of the attempt before."""
MAX_BYTES = 65536
"""A summary longer than this is not read (a node of 1,024 ranks, the most ``--nproc`` takes, writes
about 42 KB)."""
GRACE = 10.0
"""Seconds a waiting node gives the stalled rank's own agent to name it, at least (the floor when
longer)."""
HEARD_WAIT = 5.0
"""Seconds the agent that named a rank waits, at most, for the other nodes' agents to say where
their ranks wait before it kills it (their stacks are lost once their collectives fail): a stack
dump (up to 3 s) and two turns."""

# Where a phase falls within a step, for telling who is behind at the same step and collective
# count.
ORDER = {
    Phase.STARTING: 0,
    Phase.DATA: 1,
    Phase.LOOP: 2,
    Phase.FORWARD_BACKWARD: 2,
    # its backward computed, waiting in DDP's all-reduce of the gradients (or, in a loop ddpkit
    # does not drive, anywhere after it): ahead of a rank still in its forward or backward
    Phase.GRADIENT_SYNC: 3,
    Phase.OPTIMIZER: 4,
    Phase.SNAPSHOT: 5,
    Phase.USER: 5,
    Phase.EVALUATION: 5,
    Phase.COLLECTIVE: 6,  # arrived, waiting for the others
}

STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "in disk sleep (uninterruptible: waiting on a file system or device)",
    "T": "stopped (SIGSTOP)",
    "t": "stopped by a debugger",
    "Z": "zombie (exited, not yet collected)",
    "X": "dead",
    "I": "idle",
    "?": "gone",
}


@dataclass(frozen=True)
class View:
    """One rank as a node's agent sees it (its own) or last published it (another node's)."""

    rank: int
    node: int
    host: str
    local_rank: int
    pid: int
    step: int
    """-1: no mark yet."""
    coll: int
    phase: int
    op: str
    idle: float
    """Seconds since its record last changed."""
    allowance: float
    state: str
    """The ``/proc`` state code (``?``: gone)."""
    quiet: float = -1.0
    """Seconds since anything of it last moved: its record, its CPU time or its reads and writes
    (its own and its children's: loader workers); -1: not read (its record alone counts)."""
    numel: int = -1
    """The elements of its collective's first tensor (-1: not said)."""

    @property
    def marked(self) -> bool:
        return self.step >= 0

    @property
    def position(self) -> tuple[int, int, int]:
        return self.step, self.coll, ORDER.get(self.phase, 0)

    @property
    def over(self) -> bool:
        return self.idle > self.allowance

    @property
    def still(self) -> float:
        """Seconds it has not moved (its record alone, where its CPU and I/O were not read)."""
        return self.quiet if self.quiet >= 0 else self.idle

    @property
    def blocked(self) -> bool:
        """Nothing of it moved for longer than its allowance: it cannot progress on its own."""
        return self.still > self.allowance

    @property
    def stopped(self) -> bool:
        return self.state in STOPPED

    @property
    def in_collective(self) -> bool:
        """In a collective: one of ddpkit's or ``torch.distributed``'s, or DDP's all-reduce of the
        gradients (after its backward, not moving)."""
        return self.phase == Phase.COLLECTIVE or (
            self.phase == Phase.GRADIENT_SYNC and self.still > 1.0
        )

    @property
    def waiting(self) -> float:
        """Seconds it has waited: in a collective, since it entered it; elsewhere, since it last
        moved (a rank that runs waits for nobody)."""
        return self.idle if self.phase == Phase.COLLECTIVE else self.still

    @property
    def collective(self) -> tuple[int, int, str, int]:
        """Which collective it waits in: DDP's (after collective number ``coll``) or number
        ``coll`` under its op and size."""
        if self.phase == Phase.GRADIENT_SYNC:
            return 0, self.coll, "DDP's all-reduce of the gradients", -1
        return 1, self.coll, self.op, self.numel

    def doing(self) -> str:
        if self.phase == Phase.COLLECTIVE:
            size = f" of {self.numel} elements" if self.numel >= 0 else ""
            return f"in collective {self.op} #{self.coll}{size}"
        return PHASE_NAMES.get(self.phase, f"phase {int(self.phase)}")

    def state_words(self) -> str:
        return STATES.get(self.state, self.state)


STOPPED = ("T", "t")
"""Process states in which a rank cannot progress whatever it waits for: named at once."""


@dataclass(frozen=True)
class Judged:
    """What the job's views show (:func:`judge`)."""

    stalled: list[View] = field(default_factory=list)
    """Ranks that cannot progress while the others wait for them: ended (``--on-stall end``)."""
    slow: list[View] = field(default_factory=list)
    """Ranks the others have waited for past their allowance that still run (their CPU time or
    I/O moves): named, not ended (the collective timeout ends them if it comes)."""
    disagree: list[View] = field(default_factory=list)
    """Every rank of the job, when they all wait in collectives that are not one
    (:func:`disagreement`)."""
    waited: float = 0.0
    """How long the others have waited for the ``stalled`` or ``slow`` ranks."""


def judge(views: list[View]) -> Judged:
    """The verdict on the job's ``views``, from evidence, not from one rank's silence alone.

    - A stopped rank (SIGSTOP, a debugger) cannot progress: stalled at once.
    - Every rank waiting in a collective, none moving past its allowance, not all in the same one
      (number, op and size, or DDP's all-reduce): they wait for each other forever; those off the
      common one are stalled (:func:`disagreement`, :func:`odd_ones`). All in the same one (a
      collective the network holds up): left to the collective timeout.
    - Else the ranks behind every other (the lowest step, then the fewest collectives entered, then
      the earliest phase of a step), once every rank ahead has waited for them longer than their
      allowance (in a collective since it entered it, elsewhere without moving): stalled when
      nothing of them moved for longer than their allowance either, slow when something did.

    Work every rank does is no stall (nobody waits); nothing is judged while a rank has not
    marked."""
    if len(views) < 2 or not all(v.marked for v in views):
        return Judged()
    stopped = [v for v in views if v.stopped and v.idle > 0.4]
    if stopped:
        return Judged(stalled=stopped)
    disagree = disagreement(views)
    if disagree:
        return Judged(stalled=odd_ones(disagree), disagree=disagree)
    lowest = min(v.position for v in views)
    behind = [v for v in views if v.position == lowest]
    ahead = [v for v in views if v.position != lowest]
    if not ahead:
        return Judged()
    waited = min(v.waiting for v in ahead)
    late = [v for v in behind if waited > v.allowance]
    return Judged(
        stalled=[v for v in late if v.blocked],
        slow=[v for v in late if not v.blocked],
        waited=waited,
    )


def disagreement(views: list[View]) -> list[View]:
    """``views`` by rank when no rank has moved past its allowance and they wait in collectives
    that are not one; else none.

    Only the world's collectives are counted (:mod:`ddpkit.distributed._progress`), and every rank
    enters them in the same order: collective #N is one op of one size on every rank. So ranks that
    wait in different ones (another op or size at #N, another count, DDP's all-reduce against a
    collective) wait for each other forever, until the collective timeout: a collective called on
    some ranks only, or in another order. The same when the ranks behind all others wait in a
    collective while those ahead of them, past it, are blocked too (in a collective nothing marks:
    a DDP built by hand, a library's own). Ranks all in the same one, all still (a collective the
    network holds up), are left to the timeout: nothing says which of them is the cause."""
    if len(views) < 2 or not all(v.marked and v.blocked for v in views):
        return []
    if all(v.in_collective for v in views):
        if len({v.collective for v in views}) < 2:
            return []
    else:
        lowest = min(v.position for v in views)
        if not all(v.in_collective for v in views if v.position == lowest):
            return []  # one behind outside any collective: the others wait for it (a stall)
    return sorted(views, key=lambda v: v.rank)


def odd_ones(views: list[View]) -> list[View]:
    """Of ranks that disagree on a collective, those to name: the ranks behind the others in a
    collective the others went past; where all wait in collectives, those not in the one most
    ranks are in (of equal counts, the lowest rank's counts as the others'). Every node picks the
    same ranks from the same view: one node's agent names them, and the others say they wait for
    them."""
    if not views:
        return []
    if not all(v.in_collective for v in views):
        lowest = min(v.position for v in views)
        return [v for v in views if v.position == lowest]
    counts: dict[tuple[int, int, str, int], int] = {}
    for v in views:
        counts[v.collective] = counts.get(v.collective, 0) + 1
    # views are by rank: max() keeps the first of the highest count, the lowest rank's on a tie
    common = max(counts, key=lambda key: counts[key])
    return [v for v in views if v.collective != common]


def disagreement_words(views: list[View], hosts: bool = False) -> str:
    """One line for ranks that disagree on a collective (:func:`disagreement`): every rank with the
    collective it waits in (or where it is blocked), and what to change. ``hosts``: name each
    rank's host (a job of several nodes)."""
    groups: dict[tuple[int, int, str, int], list[View]] = {}
    for v in views:
        key = v.collective if v.in_collective else (2, v.step, v.doing(), -1)
        groups.setdefault(key, []).append(v)
    numbered = len({k[1] for k in groups if k[0] == 1}) > 1 or any(k[0] != 1 for k in groups)
    parts = []
    for key, group in sorted(groups.items(), key=lambda item: item[1][0].rank):
        names = [f"{v.rank}" + (f" (host {v.host})" if hosts else "") for v in group[:8]]
        more = f", ... ({len(group)} ranks)" if len(group) > 8 else ""
        who = f"rank {names[0]}" if len(group) == 1 else f"ranks {', '.join(names)}{more}"
        parts.append(f"{who} {_collective_words(key, numbered)}")
    counts = sorted({v.coll for v in views if v.phase == Phase.COLLECTIVE})
    at = f"collective #{counts[0]}" if len(counts) == 1 and not numbered else "their collectives"
    return (
        f"ranks disagree on {at}: {', '.join(parts)}: a collective called on some ranks only, or "
        "in another order (each rank's stack shows where it called its own)"
    )


def _collective_words(key: tuple[int, int, str, int], numbered: bool) -> str:
    kind, coll, op, numel = key
    if kind == 0:
        return f"in {op} (after collective #{coll})"
    if kind == 2:
        return f"blocked at step {coll}, {op}, in no collective ddpkit sees (DDP built by hand?)"
    size = f" of {numel} elements" if numel >= 0 else ""
    return f"in {op}{' #' + str(coll) if numbered else ''}{size}"


@dataclass(frozen=True)
class Verdict:
    stalled: list[View]
    """This node's ranks to name and end."""
    waited_for: list[View]
    """Other nodes' stalled ranks, for which this node's idle ranks wait."""
    disagree: list[View] = field(default_factory=list)
    """Every rank of the job, when they disagree on a collective (:func:`disagreement`): the ranks
    named, here or by another node's agent, are those off the common one."""
    slow: list[View] = field(default_factory=list)
    """This node's ranks the others wait for that still run: named, not ended."""
    waited: float = 0.0
    """How long the others have waited for them."""


def decide(node: int, views: list[View], named: frozenset[int] | set[int] = frozenset()) -> Verdict:
    """What node ``node``'s agent does with the job's ``views`` (its own ranks and the other
    nodes'): name its own stalled and slow ranks; say which other node's stalled ranks its ranks
    wait for, once they are idle past their allowance too, or once that rank's agent has named it
    (``named``: before it ends the job, it waits for this node to say where its ranks are)."""
    j = judge(views)
    mine = [v for v in j.stalled if v.node == node]
    idle_here = any(v.over for v in views if v.node == node and v not in j.stalled)
    theirs = [
        v for v in views if v.node != node and (v in j.stalled and idle_here or v.rank in named)
    ]
    slow = [v for v in j.slow if v.node == node]
    return Verdict(mine, theirs, j.disagree, slow, j.waited)


@dataclass
class Waiting:
    """A waiting node's decision to end the job itself.

    The stalled rank's own agent names it first: it alone can read the rank's ``/proc`` state, ask
    for its stack, and kill it. That agent's summary says so (``named``); a waiting node that has
    seen a remote rank stalled for :data:`GRACE` seconds (or the floor, when longer) without its
    agent naming it ends its own workers, and the job with them, rather than wait out the collective
    timeout. That happens only when that agent cannot act: it stopped publishing (killed, stuck, cut
    off from the store), so its summary ages on the reader's clock, or its poll is stuck. An agent
    that does publish and chose not to end the job (``--on-stall warn``) still lists the rank as
    named, and is left to its choice.
    """

    grace: float
    since: dict[int, float]
    """Rank -> when this node first saw it stalled (its clock)."""

    def overdue(self, waited_for: list[View], named: set[int], now: float) -> list[View]:
        """The ranks waited for longer than the grace that their agents have not named."""
        current = {v.rank for v in waited_for}
        for rank in list(self.since):
            if rank not in current:
                del self.since[rank]  # it moved: the wait, if any, starts again
        for v in waited_for:
            self.since.setdefault(v.rank, now)
        return [
            v for v in waited_for if v.rank not in named and now - self.since[v.rank] > self.grace
        ]


class Link:
    """One node's side of the exchange, for the stall watch (:class:`ddpkit._launch.watch.Watch`):
    what it has published, what it read, and what it said."""

    def __init__(self, grace: float) -> None:
        self.host = socket.gethostname()
        self.node = 0
        self.multi = False
        """Whether the job has several nodes: hosts are named then."""
        self.exchange: Exchange | None = None
        self.remote: list[View] = []
        """The other nodes' ranks, while this node reads them."""
        self.named: set[int] = set()
        """This node's ranks its agent named."""
        self.said: set[int] = set()
        """The other nodes' ranks this node said its ranks wait for."""
        self.awaited: list[View] = []
        """Those ranks as this node last saw them (for the summary at the job's end, once they are
        gone)."""
        self.waiting = Waiting(grace, {})
        self.ending: tuple[Any, float] | None = None
        """The stall named here, and when to end it at the latest, while the other nodes are
        heard."""
        self._count = 0

    def reset(self) -> None:
        self.named.clear()
        self.said.clear()
        self.awaited = []
        self.waiting.since.clear()
        self.ending = None

    def connect(self, store: Any, node: int, count: int, addr: str | None, every: float) -> None:
        """Publish to the rendezvous round's ``store``, as node ``node`` of ``count`` at
        ``addr``."""
        self.close()
        self.node, self.multi = node, count > 1
        if addr and addr not in ("127.0.0.1", "::1", "localhost"):
            # nodes of one machine (containers) share a name
            self.host = f"{socket.gethostname()} ({addr})"
        if count > 1:
            self.exchange = Exchange(store, node, count, every)

    def close(self) -> None:
        """Say that this node's ranks have exited, and stop publishing."""
        if self.exchange is not None:
            self.exchange.close(encode(self.node, self.host, self._count + 1, self.named, []))
            self.exchange = None

    def trade(self, live: list[View]) -> set[int]:
        """Publish ``live``; read the other nodes' ranks into :attr:`remote` while one of this
        node's is half-way to its allowance (else none: nothing to judge). The ranks their agents
        named."""
        if self.exchange is None:
            return set()
        want = any(v.idle > v.allowance / 2 for v in live)
        self.publish(live, want)
        self.remote, named = self.exchange.views() if want else ([], set())
        return named

    def publish(self, live: list[View], want: bool) -> None:
        if self.exchange is not None:
            self._count += 1
            self.exchange.publish(
                encode(self.node, self.host, self._count, self.named, live, self.said), want
            )

    def heard(self, ranks: list[int]) -> bool:
        """Whether every other node read has said where its ranks wait for ``ranks`` (true with none
        read)."""
        heard = self.exchange.heard() if self.exchange is not None else {}
        return all(set(ranks) <= said for said in heard.values())


# -- the summaries ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    node: int
    host: str
    count: int
    """Raised by every publication: a reader that sees it unchanged knows nothing newer."""
    named: frozenset[int]
    """The ranks its agent named as stalled in this attempt."""
    waiting: frozenset[int]
    """The other nodes' ranks its agent said its ranks wait for."""
    views: list[View]


def encode(
    node: int,
    host: str,
    count: int,
    named: set[int],
    views: list[View],
    waiting: frozenset[int] | set[int] = frozenset(),
) -> bytes:
    rows = [
        [
            v.rank,
            v.local_rank,
            v.pid,
            v.step,
            v.coll,
            v.phase,
            OPS.index(v.op) if v.op in OPS else 0,
            round(v.idle, 1),
            round(v.allowance, 1),
            v.state,
            round(v.quiet, 1),
            v.numel,
        ]
        for v in views
    ]
    doc = {
        "v": 2,
        "n": node,
        "h": host[:255],
        "c": count,
        "x": sorted(named),
        "w": sorted(waiting),
        "r": rows,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(data: bytes) -> Summary | None:
    """The summary in ``data``; None for anything else (another version's, cut short, not one at
    all)."""
    if len(data) > MAX_BYTES:
        return None
    try:
        doc = json.loads(data)
        node, host, count = int(doc["n"]), str(doc["h"]), int(doc["c"])
        named = frozenset(int(r) for r in doc["x"])
        waiting = frozenset(int(r) for r in doc["w"])
        views = []
        for rank, local, pid, step, coll, phase, op, idle, allowance, state, quiet, n in doc["r"]:
            name = OPS[op] if isinstance(op, int) and 0 <= op < len(OPS) else "collective"
            views.append(
                View(
                    int(rank),
                    node,
                    host,
                    int(local),
                    int(pid),
                    int(step),
                    int(coll),
                    int(phase),
                    name,
                    float(idle),
                    float(allowance),
                    str(state)[:1],
                    float(quiet),
                    int(n),
                )  # fmt: skip
            )
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    return Summary(node, host, count, named, waiting, views) if doc.get("v") == 2 else None


def _aged(quiet: float, seconds: float) -> float:
    return quiet + seconds if quiet >= 0 else quiet


class Exchange:
    """This node's summary to the store and the other nodes' from it, in a thread of the agent: a
    store that is slow or gone (its host's agent ending) holds up this thread, never the agent's
    poll of its workers."""

    def __init__(
        self,
        store: Any,
        node: int,
        nodes: int,
        every: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.node, self.nodes, self.clock = store, node, nodes, clock
        # Each agent reads the others' summaries once per interval: past 10 nodes the interval grows
        # with the count, so the store's host answers at most ~20 reads a second, whatever the size
        # of the job.
        self.every = max(every, 0.05 * nodes)
        self.failures = 0
        self._lock = threading.Lock()
        self._outgoing: bytes | None = None
        self._want = False
        # node -> (summary, when its count last changed)
        self._seen: dict[int, tuple[Summary, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpkit-stall-exchange", daemon=True)
        self._thread.start()

    def publish(self, data: bytes, want: bool) -> None:
        """Write ``data`` at the next turn; read the others' summaries while ``want``."""
        with self._lock:
            self._outgoing, self._want = data, want

    def views(self) -> tuple[list[View], set[int]]:
        """The other nodes' ranks, aged by this node's clock since each publication was first read,
        and the ranks their agents named."""
        now = self.clock()
        with self._lock:
            seen = list(self._seen.values())
        views: list[View] = []
        named: set[int] = set()
        for summary, at in seen:
            named |= summary.named
            views += [
                View(
                    **{**v.__dict__, "idle": v.idle + (now - at), "quiet": _aged(v.quiet, now - at)}
                )
                if v.marked
                else v
                for v in summary.views
            ]
        return views, named

    def heard(self) -> dict[int, frozenset[int]]:
        """Node -> the ranks its agent said its ranks wait for, of the nodes read."""
        with self._lock:
            return {n: summary.waiting for n, (summary, _) in self._seen.items()}

    def close(self, last: bytes | None = None) -> None:
        """Write ``last`` (a summary with no ranks: this node's have exited), then stop."""
        with self._lock:
            self._outgoing, self._want = last if last is not None else self._outgoing, False
        self._stop.set()
        # a store call may hang on a host that went away: the thread is a daemon
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        sent: bytes | None = None
        stopping = False
        while not stopping:
            stopping = self._stop.wait(self.every)
            with self._lock:
                data, want = self._outgoing, self._want
            try:
                if data is not None and data != sent:
                    self.store.set(KEY.format(self.node), data)
                    sent = data
                if want:
                    self._read()
                elif self._seen:
                    with self._lock:
                        self._seen.clear()  # read afresh, and aged from then, at the next wait
            except Exception:  # noqa: BLE001  (any store error: the job is ending, or the host is gone)
                # The watch must not end an agent, and a store error can be any of torch's exception
                # types; the node goes on judging with what it read last, ageing it.
                self.failures += 1

    def _read(self) -> None:
        others = [n for n in range(self.nodes) if n != self.node]
        # A get blocks on a missing key (a node not yet publishing): one check for all, then one per
        # key.
        if self.store.check([KEY.format(n) for n in others]):
            present = others
        else:
            present = [n for n in others if self.store.check([KEY.format(n)])]
        if not present:
            return
        keys = [KEY.format(n) for n in present]
        many = getattr(self.store, "multi_get", None)  # one round trip, where torch's store has it
        values = many(keys) if many is not None else [self.store.get(k) for k in keys]
        now = self.clock()
        for n, raw in zip(present, values, strict=True):
            summary = decode(bytes(raw))
            if summary is None or summary.node != n:
                continue
            with self._lock:
                before = self._seen.get(n)
                if before is None or before[0].count != summary.count:
                    self._seen[n] = (summary, now)
