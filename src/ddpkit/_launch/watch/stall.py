"""The agent's stall watch: a rank that stops making progress while the others wait for it, named
with every rank's state and stack, and killed (``on_stall="end"``). The rules: docs/launcher.md,
"When a job hangs"; across nodes: :mod:`ddpkit._launch.watch.verdict`."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ddpkit._errors import ConfigError
from ddpkit._launch import proctree
from ddpkit._launch.proctree import state_code
from ddpkit._launch.rendezvous.link import NodeLink
from ddpkit._launch.watch import verdict
from ddpkit._launch.watch.verdict import STATES, STOPPED, View
from ddpkit.distributed._channels import ask_stacks
from ddpkit.distributed._progress import MAGIC, OPS, RECORD, SIZE, Phase

TIMEOUT_ENV = "DDPKIT_STALL_TIMEOUT"  # the floor without --stall-timeout; 0: off
DEFAULT_FLOOR = 30.0
POLL_EVERY = 0.5  # seconds between two reads of the records

LONG_PHASES = (
    Phase.STARTING, Phase.SNAPSHOT, Phase.EVALUATION, Phase.MAIN_FIRST, Phase.EXPORT,
)  # fmt: skip
"""Phases that may keep a rank longer than its steps while the others wait for it."""
MOVED = (5, 4096)
"""CPU ticks and bytes read or written in :data:`WINDOW` s that count as moving (less: noise)."""
WINDOW = 2.0
EVIDENCE_AFTER = 1.0  # seconds a record stays unchanged before the rank's activity is read
LONG_SHARE = 0.5  # the long allowance is at most this share of the collective timeout
STEP_FACTOR = 10.0  # a rank gets at least this many times its median step
LONG_FACTOR = 10.0  # LONG_PHASES get LONG_FACTOR x the floor (LONG_SHARE of the timeout at most)


@dataclass(frozen=True, kw_only=True)
class StallPolicy:
    """When a rank counts as stalled, and what the agent does then."""

    floor: float = DEFAULT_FLOOR
    """Seconds without progress a rank always gets; 0 turns the watch off."""
    collective_timeout: float | None = None
    on_stall: str = "end"
    """``end``: kill the stalled rank, so the job ends (or restarts); ``warn``: only say so."""

    @property
    def on(self) -> bool:
        return self.floor > 0


@dataclass(frozen=True)
class Record:
    pid: int
    phase: int
    op: str
    step: int
    steps: int
    seq: int
    coll: int
    numel: int
    peer: int  # of its point-to-point call (-1: none or any)
    step_at: float
    last_step: float
    timeout: float = 0.0  # its process group's collective timeout (0: not known)


def read_record(path: Path) -> Record | None:
    """The rank's record at ``path``, read twice alike (it may be writing); None if none yet."""
    for _ in range(3):
        try:
            with open(path, "rb") as f:
                first, second = f.read(SIZE), os.pread(f.fileno(), SIZE, 0)
        except OSError:
            return None
        if first == second and len(first) == SIZE:
            fields = RECORD.unpack(first)
            magic, pid, op, phase, seq, step, steps, coll, numel, peer = fields[:10]
            if magic != MAGIC:
                return None
            name = OPS[op] if 0 <= op < len(OPS) else "collective"
            return Record(pid, phase, name, step, steps, seq, coll, numel, peer, *fields[10:])
    return None


def process_state(pid: int) -> str:
    """The state of process ``pid`` in words, from ``/proc/PID/stat``."""
    code = state_code(pid)
    return STATES.get(code, code)


@dataclass
class _Rank:
    rank: int
    local_rank: int
    pid: int
    record: Record | None = None
    changed_at: float = 0.0
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    moved_at: float = 0.0  # when its CPU time or I/O last moved
    samples: deque[tuple[float, int, int]] = field(default_factory=deque)  # (when, ticks, bytes)
    slow_said: float = 0.0  # when it was last named slow
    collective: Record | None = None  # its last record in a collective

    def quiet(self, now: float) -> float:
        return max(0.0, now - max(self.changed_at, self.moved_at))


@dataclass
class Stall:
    ranks: list[int]  # global
    headline: str  # which rank, for how long, doing what, and where the others wait
    report: list[str]  # the headline and a line per rank, with stacks
    disagreement: str = ""  # the line on ranks off one collective, where they are
    stopped: bool = False  # every rank named was stopped (SIGSTOP): a failure like any other


class Watch:
    """The stall watch of one node's ranks for one attempt; judged with the other nodes' ranks."""

    def __init__(
        self,
        folder: Path,
        policy: StallPolicy,
        stacks: bool | None,
        clock: Callable[[], float] = time.monotonic,
        activity: Callable[[int], tuple[int, int] | None] = proctree.activity,
    ) -> None:
        """``folder``: the ranks' progress records; ``stacks``: ask the ranks for their stacks
        (through their inboxes) to show where they are; ``activity(pid)``: CPU ticks and bytes read
        and written by a rank and its children."""
        self.folder, self.policy, self.stacks, self.clock = folder, policy, bool(stacks), clock
        self.activity = activity
        self.ranks: dict[int, _Rank] = {}
        self.stall: Stall | None = None
        self.host = socket.gethostname()
        self.node = 0
        self.multi = False  # several nodes: hosts are named
        self.link: NodeLink | None = None
        self.remote: list[View] = []  # the other nodes' ranks, while this node reads them
        self.grace = max(verdict.GRACE, policy.floor)
        """Seconds a remote rank this node saw stalled may go unnamed by its own agent (which
        alone can read its state, ask for its stack and kill it) before this node ends the job."""
        self.named: set[int] = set()  # this node's ranks its agent named
        self.said: set[int] = set()  # the other nodes' ranks this node said its own wait for
        self.awaited: list[View] = []  # those, as last seen (for the job's summary)
        self.since: dict[int, float] = {}  # a remote rank -> when this node first saw it stalled
        self.ending: tuple[Stall, float] | None = None  # the stall named here, and its deadline
        self._warned: set[tuple[int, ...]] = set()
        self._next_poll = 0.0
        self._published = 0

    def start_attempt(self, workers: dict[int, tuple[int, int]]) -> None:
        """A new attempt's workers: global rank -> (local rank, pid)."""
        now = self.clock()
        self.ranks = {
            g: _Rank(g, local, pid, changed_at=now, moved_at=now)
            for g, (local, pid) in workers.items()
        }
        self.stall, self.ending = None, None
        self.awaited = []
        for noted in (self.named, self.said, self.since, self._warned):
            noted.clear()

    def connect(
        self, link: NodeLink | None, node: int, count: int, addr: str | None = None
    ) -> None:
        """Publish this node's ranks (node ``node`` of ``count``, at ``addr``) through ``link``."""
        self.disconnect()
        self.node, self.multi = node, count > 1 and self.policy.on
        if addr and addr not in ("127.0.0.1", "::1", "localhost"):
            self.host = f"{socket.gethostname()} ({addr})"
        self.link = link if self.multi else None

    def disconnect(self) -> None:
        """Say that this node's ranks have exited, and stop publishing."""
        if self.link is not None:
            self._published += 1
            self.link.publish(
                verdict.encode(self.node, self.host, self._published, self.named, []), False
            )
            self.link = None

    def _trade(self, live: list[View]) -> set[int]:
        """Publish ``live``; read the others' into :attr:`remote` while one is half idle; the
        ranks the other nodes' agents named."""
        if self.link is None:
            return set()
        want = any(v.idle > v.allowance / 2 for v in live)
        self._publish(live, want)
        self.remote, named = self._views() if want else ([], set())
        return named

    def _publish(self, live: list[View], want: bool) -> None:
        if self.link is not None:
            self._published += 1
            summary = verdict.encode(
                self.node, self.host, self._published, self.named, live, self.said
            )
            self.link.publish(summary, want)

    def _summaries(self) -> list[tuple[verdict.Summary, float]]:
        """The other nodes' summaries last read, each with the seconds since it changed."""
        seen = self.link.summaries() if self.link is not None else {}
        out = []
        for node, (data, age) in seen.items():
            summary = verdict.decode(data)
            if summary is not None and summary.node == node:
                out.append((summary, age))
        return out

    def _views(self) -> tuple[list[View], set[int]]:
        """The other nodes' ranks, aged by this node's clock, and the ranks their agents named."""
        views: list[View] = []
        named: set[int] = set()
        for summary, age in self._summaries():
            named |= summary.named
            views += [
                replace(v, idle=v.idle + age, quiet=v.quiet + age if v.quiet >= 0 else v.quiet)
                if v.marked
                else v
                for v in summary.views
            ]
        return views, named

    def heard(self, ranks: list[int]) -> bool:
        """Whether every other node read has said its ranks wait for ``ranks``."""
        return all(set(ranks) <= summary.waiting for summary, _ in self._summaries())

    def overdue(self, waited_for: list[View], named: set[int], now: float) -> list[View]:
        """The remote ranks waited for past :attr:`grace` that their agents have not named."""
        # a rank no longer waited for moved: a wait starts again
        self.since = {v.rank: self.since.get(v.rank, now) for v in waited_for}
        return [
            v for v in waited_for if v.rank not in named and now - self.since[v.rank] > self.grace
        ]

    def read(self) -> None:
        now = self.clock()
        for r in self.ranks.values():
            record = read_record(self.folder / f"rank{r.rank}.progress")
            if record is None or record.pid != r.pid:
                continue  # not yet written by this attempt's process
            if r.record is None or record.seq != r.record.seq:
                r.changed_at = now
                if record.steps > 2 and (r.record is None or record.steps != r.record.steps):
                    r.durations.append(record.last_step)
            r.record = record
            if record.phase == Phase.COLLECTIVE:
                r.collective = record
            self._read_activity(r, now)

    def _read_activity(self, r: _Rank, now: float) -> None:
        """Whether ``r``'s CPU or I/O moved in the last :data:`WINDOW` s, while its record stays."""
        if now - r.changed_at < EVIDENCE_AFTER:
            r.samples.clear()
            return
        got = self.activity(r.pid)
        if got is None:
            return
        r.samples.append((now, *got))
        while len(r.samples) > 1 and r.samples[1][0] <= now - WINDOW:
            r.samples.popleft()
        _, ticks, chars = r.samples[0]
        if got[0] - ticks >= MOVED[0] or got[1] - chars >= MOVED[1]:
            r.moved_at = now
            r.samples.clear()
            r.samples.append((now, *got))

    def allowance(self, r: _Rank) -> float:
        p = self.policy
        # the median of the steps seen ending, the first left out (it warms up, with an allowance)
        median = statistics.median(r.durations) if r.durations else 0.0
        allowed = max(p.floor, STEP_FACTOR * median)
        first = r.record is None or r.record.steps <= 1
        if first or r.record is not None and r.record.phase in LONG_PHASES:
            allowed = max(allowed, LONG_FACTOR * p.floor)
        # named before the waiting ranks' collectives fail
        timeout = self._timeout(r)
        return min(allowed, LONG_SHARE * timeout) if timeout is not None else allowed

    def _timeout(self, r: _Rank) -> float | None:
        """The rank's collective timeout: its own group's, else the launcher's."""
        if r.record is not None and r.record.timeout > 0:
            return r.record.timeout
        return self.policy.collective_timeout

    def view(self, r: _Rank, now: float) -> View:
        rec = r.record
        step, coll, phase, op, numel, peer = (
            (rec.step, rec.coll, rec.phase, rec.op, rec.numel, rec.peer)
            if rec
            else (-1, 0, 0, "collective", -1, -1)
        )
        return View(
            r.rank, self.node, self.host, r.local_rank, r.pid, step, coll, phase, op,
            now - r.changed_at, self.allowance(r), state_code(r.pid), quiet=r.quiet(now),
            numel=numel, peer=peer,
        )  # fmt: skip

    def poll(self, running: set[int]) -> Stall | None:
        """Read the records (every :data:`POLL_EVERY` s); the stall among ``running``, said once."""
        now = self.clock()
        if self.ending is not None:
            self._end_when_heard(now)
            return None
        if not self.policy.on or self.stall is not None or now < self._next_poll:
            return None
        self._next_poll = now + POLL_EVERY
        self.read()
        live = [self.view(r, now) for g, r in self.ranks.items() if g in running]
        named = self._trade(live)
        judged = verdict.decide(self.node, live + self.remote, named)
        overdue = self.overdue(judged.waited_for, named, now)
        if judged.waited_for and not judged.stalled:
            stall = self._wait(judged.waited_for, overdue, live, now)
        elif judged.stalled:
            stall = self._name([self.ranks[v.rank] for v in judged.stalled], live, now)
        elif judged.slow:
            self._say_slow([self.ranks[v.rank] for v in judged.slow], judged.waited, now)
            return None
        else:
            return None
        if stall is not None and (cycle := verdict.deadlock(live + self.remote)):
            stall.disagreement = verdict.deadlock_words(cycle)
        elif stall is not None and (odd := verdict.disagreement(live + self.remote)):
            stall.disagreement = verdict.disagreement_words(odd, self.multi)
        return stall

    def _name(self, stalled: list[_Rank], live: list[View], now: float) -> Stall | None:
        """Name this node's ``stalled`` ranks once, and end them (``on_stall="end"``)."""
        key = (stalled[0].rank, stalled[0].record.seq if stalled[0].record else 0)
        if key in self._warned:
            return None
        self._warned.add(key)
        self.named |= {r.rank for r in stalled}
        stall = self._describe(stalled, now)
        print("\n".join(stall.report), file=sys.stderr, flush=True)
        if self.policy.on_stall == "end":
            self.stall = stall
            self.ending = (stall, now + verdict.HEARD_WAIT)
            self._publish(live, want=True)  # that it named them, at once
            self._end_when_heard(now)
        return stall

    def _end_when_heard(self, now: float) -> None:
        """Kill the named ranks once the others said where theirs wait, or ``HEARD_WAIT`` s on."""
        assert self.ending is not None
        stall, deadline = self.ending
        if now < deadline and not self.heard(stall.ranks):
            return
        self.ending = None
        ended = [
            r.pid
            for r in self.ranks.values()
            if r.rank in stall.ranks or process_state(r.pid).startswith("stopped")
        ]
        proctree.send(ended, signal.SIGKILL)

    def _wait(
        self, waited: list[View], overdue: list[View], live: list[View], now: float
    ) -> Stall | None:
        """Say once which remote ranks this node's wait for; end them once ``overdue``."""
        first = waited[0]
        key = (-1, first.rank, first.step, first.coll, bool(overdue))
        if key in self._warned:
            return None
        self._warned.add(key)
        names = ", ".join(f"rank {v.rank} on host {v.host}" for v in waited)
        headline = (
            f"ddpkit run: waiting for {names}: no progress for {first.idle:.1f} s (allowed "
            f"{first.allowance:.1f} s), {first.state_words()}, at step {first.step}, "
            f"{first.doing()}; "
            + "; ".join(self._at(v) for v in sorted(live, key=lambda v: v.rank))
        )
        end = self.policy.on_stall == "end" and bool(overdue)
        said = (
            f"  its node's agent has not named it {self.grace:.0f} s after this node "
            "saw it stalled; ending this node's workers (SIGKILL), and the job with them"
            if end
            else "  its node's agent names it, with its state and stack, and ends the job"
        )
        lines = [headline, said, *self._rank_lines(now, live)]
        print("\n".join(lines), file=sys.stderr, flush=True)
        self.said |= {v.rank for v in waited}
        self.awaited = waited
        self._publish(live, want=True)
        if not end:
            return None
        stall = Stall([v.rank for v in live], headline, lines)
        self.stall = stall
        proctree.send([v.pid for v in live], signal.SIGKILL)
        return stall

    def _say_slow(self, slow: list[_Rank], waited: float, now: float) -> None:
        """Name ranks waited for that still run, with stacks, once an allowance; never end them."""
        first = slow[0]
        allowance = self.allowance(first)
        if first.slow_said and now - first.slow_said < allowance:
            return
        for r in slow:
            r.slow_said = now
        rec, timeout = self.view(first, now), self._timeout(first)
        names = ", ".join(f"rank {r.rank}" for r in slow)
        headline = (
            f"ddpkit run: {names} slow: the other ranks have waited {waited:.1f} s for "
            f"{'it' if len(slow) == 1 else 'them'} (allowed {allowance:.1f} s); it runs (its CPU "
            f"or I/O moved {first.quiet(now):.1f} s ago), {rec.state_words()}, at step "
            f"{rec.step}, {rec.doing()}; not ended"
        )
        if timeout:
            headline += f" (the collective timeout, {timeout:.0f} s, ends the job if it lasts)"
        print("\n".join([headline, *self._rank_lines(now)]), file=sys.stderr, flush=True)

    def _at(self, v: View) -> str:
        host = f" on host {v.host}" if self.multi else ""
        return f"rank {v.rank}{host} at step {v.step}, {v.doing()}"

    def _describe(self, stalled: list[_Rank], now: float) -> Stall:
        names = ", ".join(f"rank {r.rank}" for r in stalled)
        first = stalled[0]
        rec = self.view(first, now)
        skip = {s.rank for s in stalled}
        others = [
            self.view(r, now)
            for r in self.ranks.values()
            if r.rank not in skip and r.record is not None
        ]
        others += [v for v in self.remote if v.marked]
        others.sort(key=lambda v: v.rank)
        ahead = "; ".join(self._at(v) for v in others)
        where = f" on host {self.host}" if self.multi else ""
        headline = (
            f"ddpkit run: {names} stalled: no progress for {first.quiet(now):.1f} s (allowed "
            f"{rec.allowance:.1f} s){where}, {rec.state_words()}, at step {rec.step}, {rec.doing()}"
            + (f"; {ahead}" if ahead else "")
        )
        lines = [headline]
        waiting = [v for v in others if v.phase == Phase.COLLECTIVE and v.coll > rec.coll]
        if waiting:
            op, seq = waiting[0].op, waiting[0].coll
            who = [f"{v.rank} (host {v.host})" if self.multi else str(v.rank) for v in waiting]
            lines.append(
                f"  collective {op} #{seq}: rank(s) {', '.join(who)} "
                f"wait in it; {names} ha{'ve' if len(stalled) > 1 else 's'} not arrived (entered "
                f"{rec.coll} collective(s))"
            )
        lines += self._rank_lines(now)
        ending = f"  ending the job: {names} killed (SIGKILL); --on-stall warn only says so"
        lines.append(
            ending if self.policy.on_stall == "end" else "  the job goes on (--on-stall warn)"
        )
        stopped = all(state_code(r.pid) in STOPPED for r in stalled)
        return Stall([r.rank for r in stalled], headline, lines, stopped=stopped)

    def _rank_lines(self, now: float, views: list[View] | None = None) -> list[str]:
        """A line per rank (``views``, by default every rank of the job's), with its stack (this
        node's) or where its agent last saw it."""
        if views is None:
            views = [self.view(r, now) for r in self.ranks.values()] + self.remote
        mine = [v for v in views if v.node == self.node and v.rank in self.ranks]
        dumps = self._stacks({v.rank: v.pid for v in mine if not v.stopped})
        lines = []
        for v in sorted(views, key=lambda v: v.rank):
            remote = v.node != self.node
            where = "no mark yet"
            if v.marked:
                where = f"step {v.step}, {v.doing()}, {v.idle:.0f} s since its last mark"
            if remote:
                where += " (as its node's agent last published it)"
            lines.append(
                f"  rank {v.rank} (local rank {v.local_rank}, host {v.host}, pid {v.pid}): "
                f"{v.state_words()}; {where}"
            )
            if not remote and v.stopped:
                lines.append("    (a stopped process cannot answer for its stack)")
            lines += [f"    {frame}" for frame in dumps.get(v.rank, [])]  # this node's ranks'
            if not remote and v.phase == Phase.DATA:
                lines += self._loader_lines(v.pid)
        return lines

    def _loader_lines(self, pid: int) -> list[str]:
        """A rank's loader workers (its processes but the guard): pid, state and stack."""
        workers = [c for c in proctree.descendants(pid) if not proctree.is_guard(c)]
        if not workers:
            return []
        dumps, lines = self._stacks({c: c for c in workers}), []
        for c in workers:
            lines.append(f"    its loader worker pid {c}: {process_state(c)}")
            lines += [f"      {frame}" for frame in dumps.get(c, [])]
        return lines

    def _stacks(self, pids: dict[int, int]) -> dict[int, list[str]]:
        return ask_stacks(pids) if self.stacks else {}

    def where(self) -> str:
        """Each rank's last mark in one line, with the other nodes' ranks this node's waited for."""
        now = self.clock()
        views = [self.view(r, now) for r in self.ranks.values() if r.record is not None]
        views += self.awaited
        said = " (stalled: this node's ranks waited for it)"
        return "; ".join(
            self._at(v) + (said if v.node != self.node else "")
            for v in sorted(views, key=lambda v: v.rank)
        )


def policy_from(
    floor: float | None,
    on_stall: str,
    env: dict[str, str] | None = None,
    collective_timeout: float | None = None,
) -> StallPolicy:
    """The policy of ``--stall-timeout`` (else :data:`TIMEOUT_ENV`), ``--on-stall``, the timeout."""
    if floor is None:
        text = (os.environ if env is None else env).get(TIMEOUT_ENV)
        floor = parse_floor(TIMEOUT_ENV, text) if text is not None else DEFAULT_FLOOR
    return StallPolicy(floor=floor, on_stall=on_stall, collective_timeout=collective_timeout)


def parse_floor(option: str, text: str) -> float:
    """Seconds for ``--stall-timeout``: 0 (off), or 1 to 30 days."""
    from ddpkit.distributed._environment import parse_seconds

    try:
        if float(text) == 0:
            return 0.0
    except ValueError:
        pass
    try:
        return parse_seconds(option, text)
    except ConfigError as err:
        raise ConfigError(f"{err}; or 0 to turn the stall watch off") from None
