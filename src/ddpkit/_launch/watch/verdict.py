"""The stall watch's rule (:func:`judge`, :func:`decide`), the same on every node, and the summary
of a node's ranks it publishes to the others (:func:`encode`, :func:`decode`) through its link
(:class:`~ddpkit._launch.rendezvous.link.NodeLink`)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field, replace

from ddpkit.distributed._progress import OPS, PHASE_NAMES, Phase

GRACE = 10.0
"""Seconds a waiting node gives the stalled rank's own agent to name it, at least."""
HEARD_WAIT = 5.0
"""Seconds the naming agent waits, at most, for the others to say where their ranks wait."""

# where a phase falls within a step: who is behind at the same step and collective count
ORDER = {
    Phase.STARTING: 0,
    Phase.DATA: 1,
    Phase.LOOP: 2,
    Phase.FORWARD_BACKWARD: 2,
    Phase.GRADIENT_SYNC: 3,  # after its backward: ahead of a rank still in it
    Phase.OPTIMIZER: 4,
    Phase.SNAPSHOT: 5,
    Phase.USER: 5,
    Phase.EVALUATION: 5,
    Phase.COLLECTIVE: 6,  # arrived, waiting for the others
    Phase.POINT_TO_POINT: 6,  # arrived, waiting for its peer
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
    step: int  # -1: no mark yet
    coll: int
    phase: int
    op: str
    idle: float  # seconds since its record last changed
    allowance: float
    state: str  # the /proc state code ("?": gone)
    quiet: float = -1.0
    """Seconds since anything of it (record, CPU, I/O, its children's) moved; -1: not read."""
    numel: int = -1  # the elements of its collective's first tensor (-1: not said)
    peer: int = -1  # the rank its point-to-point call is with (-1: none, or any)

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
        """In a collective: a marked one, or DDP's gradient all-reduce (after its backward)."""
        return self.phase in (Phase.COLLECTIVE, Phase.GRADIENT_SYNC)

    @property
    def waiting(self) -> float:
        """Seconds it has waited: in a collective, since it entered; else, since it moved."""
        return self.idle if self.phase == Phase.COLLECTIVE else self.still

    @property
    def collective(self) -> tuple[int, int, str, int]:
        """Which collective it waits in: DDP's (after number ``coll``), or ``coll`` by op, size."""
        if self.phase == Phase.GRADIENT_SYNC:
            return 0, self.coll, "DDP's all-reduce of the gradients", -1
        return 1, self.coll, self.op, self.numel

    def doing(self) -> str:
        if self.phase == Phase.POINT_TO_POINT:
            with_ = "any rank" if self.peer < 0 else f"rank {self.peer}"
            return f"in {self.op} {'to' if self.op == 'send' else 'from'} {with_}"
        if self.phase == Phase.COLLECTIVE:
            size = f" of {self.numel} elements" if self.numel >= 0 else ""
            return f"in collective {self.op} #{self.coll}{size}"
        return PHASE_NAMES.get(self.phase, f"phase {int(self.phase)}")

    def state_words(self) -> str:
        return STATES.get(self.state, self.state)


STOPPED = ("T", "t")  # states in which a rank cannot progress: named at once


@dataclass(frozen=True)
class Judged:
    """What the job's views show (:func:`judge`)."""

    stalled: list[View] = field(default_factory=list)  # cannot progress while the others wait
    slow: list[View] = field(default_factory=list)  # waited for past their allowance, still running
    disagree: list[View] = field(default_factory=list)  # every rank, off one collective
    waited: float = 0.0  # how long the others have waited for them
    waited_for: list[View] = field(default_factory=list)  # other nodes' stalled ranks (decide)


def judge(views: list[View]) -> Judged:
    """The verdict on the job's ``views``, from evidence: a stopped rank is stalled at once; ranks
    that wait for each other in collectives that are not one (:func:`disagreement`), those off the
    common one; else the ranks behind every other (lowest step, fewest collectives, earliest phase),
    once the ranks ahead have waited for them past their allowance: stalled when nothing of them
    moved for as long, slow when something did. Nothing is judged while a rank has not marked."""
    if len(views) < 2 or not all(v.marked for v in views):
        return Judged()
    stopped = [v for v in views if v.stopped and v.idle > 0.4]
    if stopped:
        return Judged(stalled=stopped)
    if cycle := deadlock(views):
        return Judged(stalled=cycle, disagree=cycle)
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
    that are not one (collective #N is one op of one size on every rank), or the ranks behind wait
    in one the blocked ranks ahead went past; else none. Ranks all in the same one are left to the
    collective timeout."""
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


def _waits_for(v: View, views: list[View]) -> set[int]:
    """The ranks ``v`` waits for: its point-to-point call's peer; in a collective, every rank not
    in it."""
    if v.phase == Phase.POINT_TO_POINT:
        return {v.peer} if v.peer >= 0 else set()
    if v.in_collective:
        return {u.rank for u in views if not (u.in_collective and u.collective == v.collective)}
    return set()


def deadlock(views: list[View]) -> list[View]:
    """Ranks that wait for each other in a cycle that passes through a point-to-point call (a
    ``recv`` on both sides, a ``recv`` from a rank waiting in a collective), none moving past its
    allowance, by rank; else none. Cycles of collectives alone are :func:`disagreement`'s."""
    blocked = {v.rank: v for v in views if v.marked and v.blocked}
    if not any(v.phase == Phase.POINT_TO_POINT for v in blocked.values()):
        return []
    graph = {r: _waits_for(v, views) & set(blocked) for r, v in blocked.items()}
    for start in sorted(r for r, v in blocked.items() if v.phase == Phase.POINT_TO_POINT):
        path, at = [start], start
        while graph[at]:
            at = min(graph[at])  # the lowest rank it waits for: the same walk on every node
            if at in path:
                return sorted((blocked[r] for r in path[path.index(at) :]), key=lambda v: v.rank)
            path.append(at)
    return []


def deadlock_words(views: list[View]) -> str:
    """One line for ranks in a cycle of waits through point-to-point calls, and what to change."""
    each = ", ".join(f"rank {v.rank} {v.doing()}" for v in views)
    return (
        f"ranks {', '.join(str(v.rank) for v in views)} wait for each other: {each}: a deadlock "
        "(a blocking send or recv whose peer waits elsewhere; order them so that one side sends "
        "first, or post both with isend/irecv and wait on the two)"
    )


def odd_ones(views: list[View]) -> list[View]:
    """Of ranks that disagree on a collective, those to name: the ranks behind, in a collective the
    others went past; where all wait in collectives, those off the one most ranks are in (of equal
    counts, the lowest rank's). Every node picks the same ranks from the same view."""
    if not all(v.in_collective for v in views):
        lowest = min(v.position for v in views)
        return [v for v in views if v.position == lowest]
    counts = Counter(v.collective for v in views)
    # views are by rank: max() keeps the first of the highest count, the lowest rank's on a tie
    common = max(counts, key=counts.__getitem__)
    return [v for v in views if v.collective != common]


def disagreement_words(views: list[View], hosts: bool = False) -> str:
    """One line for ranks that disagree on a collective, and what to change; ``hosts``: named."""
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


def decide(node: int, views: list[View], named: frozenset[int] | set[int] = frozenset()) -> Judged:
    """What node ``node``'s agent does with the job's ``views``: name its own stalled and slow
    ranks; say which other node's stalled ranks its own wait for, once they are idle past their
    allowance too, or once that rank's agent has named it (``named``)."""
    j = judge(views)
    idle_here = any(v.over for v in views if v.node == node and v not in j.stalled)
    return replace(
        j,
        stalled=[v for v in j.stalled if v.node == node],
        slow=[v for v in j.slow if v.node == node],
        waited_for=[
            v for v in views if v.node != node and (v in j.stalled and idle_here or v.rank in named)
        ],
    )


@dataclass(frozen=True)
class Summary:
    node: int
    host: str
    count: int  # raised by every publication
    named: frozenset[int]  # the ranks its agent named as stalled in this attempt
    waiting: frozenset[int]  # the other nodes' ranks its agent said its ranks wait for
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
        [v.rank, v.local_rank, v.pid, v.step, v.coll, v.phase,
         OPS.index(v.op) if v.op in OPS else 0, round(v.idle, 1), round(v.allowance, 1), v.state,
         round(v.quiet, 1), v.numel, v.peer]
        for v in views
    ]  # fmt: skip
    doc = {"v": 3, "n": node, "h": host[:255], "c": count, "x": sorted(named),
           "w": sorted(waiting), "r": rows}  # fmt: skip
    return json.dumps(doc, separators=(",", ":")).encode()


def decode(data: bytes) -> Summary | None:
    """The summary in ``data``; None for anything else (another version's, cut short)."""
    try:
        doc = json.loads(data)
        node, host, count = int(doc["n"]), str(doc["h"]), int(doc["c"])
        named = frozenset(int(r) for r in doc["x"])
        waiting = frozenset(int(r) for r in doc["w"])
        views = []
        for row in doc["r"]:
            rank, local, pid, step, coll, phase, op, idle, allowance, state, quiet, n, peer = row
            name = OPS[op] if isinstance(op, int) and 0 <= op < len(OPS) else "collective"
            views.append(
                View(int(rank), node, host, int(local), int(pid), int(step), int(coll), int(phase),
                     name, float(idle), float(allowance), str(state)[:1], float(quiet), int(n),
                     int(peer))
            )  # fmt: skip
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    return Summary(node, host, count, named, waiting, views) if doc.get("v") == 3 else None
