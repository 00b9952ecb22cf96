"""The agent's side of in-place recovery (``ddpkit run --recover in-place``, docs/recovery.md):
:class:`InPlace`, polled before torchrun looks at the workers, holds the attempt while a failure is
recovered: every running worker is told (its inbox's ``incident G``), each leaves its step and says
so in ``recover/wait-G.RANK``; the agent then replaces the workers that exited and says go
(``recover/go-G``), or gives the failure back to torchrun's whole-job restart (``recover/end-G``,
with why). Across nodes, the agents agree through the job's store
(:mod:`ddpkit._launch.recover.nodes`). What it asks of the agent is :class:`Workers`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

from ddpkit import _fs as fs
from ddpkit._errors import PREEMPTED_EXIT_CODE, ConfigError
from ddpkit._launch import say
from ddpkit._launch.proctree import state_code
from ddpkit._launch.recover.nodes import Agreement, Joined, join, listed
from ddpkit._launch.recover.worker import read_json
from ddpkit._launch.rendezvous.link import PROBE_TIMEOUT, SUSPECT_AFTER, NodeLink
from ddpkit.distributed import _channels as channels
from ddpkit.platforms import _torchrun as torchrun

LEAVE_TIMEOUT = 10.0
"""Seconds every rank gets to leave its step once a failure is seen; a rank still in it then is
killed and replaced (``$DDPKIT_RECOVER_TIMEOUT`` sets another)."""
TIMEOUT_ENV = "DDPKIT_RECOVER_TIMEOUT"
STOPPED_AFTER = 1.0
"""Seconds a worker may stay stopped (SIGSTOP) before it is a failure: killed and replaced."""
NODE_WAITING = (
    "a new node waits in torch's rendezvous (it started before the loss was seen, or runs another "
    "--nproc): the job restarts with it"
)
WORD_GRACE = 5.0  # seconds more than a node's ranks get to leave, for its agent's word to arrive


class Workers(Protocol):
    """What in-place recovery asks of the agent that runs this node's workers."""

    def exit_codes(self) -> dict[int, int | None]:
        """Each worker's exit code, by global rank; None while it runs."""

    def pids(self) -> dict[int, int]:
        """Each worker's pid, by global rank."""

    def restarts_left(self) -> int:
        """How many more failures ``--max-restarts`` allows."""

    def restarts_used(self) -> int:
        """The failures recovered so far (``TORCHELASTIC_RESTART_COUNT``)."""

    def use_restart(self) -> None:
        """Count one against ``--max-restarts``."""

    def restarts_from(self, used: int) -> None:
        """Count ``used`` as made (a node that joined after them)."""

    def stop_restarting(self) -> None:
        """No restart after this attempt: the job ends with it."""

    def replace_worker(self, rank: int, env: dict[str, str]) -> None:
        """Start a new process for global rank ``rank``, whose process exited, with ``env``."""

    def kill(self, ranks: list[int], why: str) -> None:
        """SIGKILL the workers of ``ranks``, saying ``why`` ("rank(s) 2 WHY") and where each was
        (its stack)."""

    def stall_ended(self) -> bool:
        """Whether the stall watch ended the attempt (but for stopped ranks, a failure as any)."""

    def went_on(self) -> None:
        """The workers go on after a recovery in place: what watches them starts anew."""


@dataclass(frozen=True)
class Round:
    """The rendezvous round this node's workers run in: this node's address ``addr``, its workers'
    global ``ranks``; across nodes, its ``link`` to the others and the count of nodes waiting in
    torch's rendezvous (``waiting``)."""

    addr: str
    ranks: list[int]
    link: NodeLink | None = None
    waiting: Callable[[], int] = lambda: 0


@dataclass
class Incident:
    """A failure being recovered: recovery ``generation``, seen at ``seen`` (``time.time()``, for
    the records; every deadline counts from ``opened``, ``time.monotonic()``)."""

    generation: int
    seen: float
    opened: float = field(default_factory=time.monotonic)
    replaced: dict[int, int] = field(default_factory=dict)  # global rank -> exit code
    killed: dict[int, float] = field(default_factory=dict)  # rank killed -> when (monotonic)
    reported: bool = False  # across nodes: this node's word is on the store
    offered: float | None = None  # across nodes: when the decider offered the lost nodes' places
    lost: dict[int, str] | None = None  # across nodes: the nodes the decider found lost, and why


class InPlace:
    """The agent's side: polled before torchrun's look at the workers (:meth:`poll`)."""

    def __init__(
        self,
        where: Path,
        timeout: float = LEAVE_TIMEOUT,
        join_timeout: float = 120.0,
        nproc: int = 1,
        node_timeout: float = 30.0,
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
        self.node_timeout = node_timeout
        self.nproc = nproc  # this node's workers
        self.store: Any = None  # the workers' store after a recovery, served by the agent
        self.round: Round | None = None
        self.agreement: Agreement | None = None  # across nodes
        self.running = False  # the last poll found every worker running
        self.replaced = False
        """Set when this node was counted lost and a new node took its place: its agent ends."""
        self._stopped: dict[int, float] = {}  # rank -> when it was first seen stopped
        self._unanswered: float | None = None  # since when the job's store has not answered
        self.joined: Joined | None = None
        """The lost node's place this node took, until its workers start."""

    def start(self, round: Round) -> None:
        """The workers of a new attempt (the first, a whole restart, a new node's) start in
        ``round``; across nodes, counting recoveries on from the job's."""
        self.round, self.incident, self._stopped, self._unanswered = round, None, {}, None
        self.agreement = Agreement(round.link) if round.link is not None else None
        if self.agreement is not None:
            self.agreement.announce(round.ranks)
            self.adopt(max(self.generation, self.agreement.closed()))

    # -- what the rendezvous asks (rendezvous.backend.InPlaceRendezvous) -------------------------

    def take_place(self, base: Any, addr: str) -> Joined | None:
        """A lost node's place in the job, taken by this new node (:func:`~ddpkit._launch.recover.
        nodes.join`); None where none is open: torch's rendezvous follows."""
        wait = self.timeout + SUSPECT_AFTER + PROBE_TIMEOUT + WORD_GRACE
        self.joined = join(base, addr, self.nproc, wait, self.join_timeout, self.node_timeout)
        return self.joined

    def recovering(self) -> bool:
        """Whether a recovery is under way on this node."""
        return self.incident is not None

    def left_job(self) -> bool:
        """Whether this node left the job (counted lost and replaced, or cut from its store; why:
        :attr:`fallback`)."""
        return self.replaced

    def joined_start(self, place: Joined, workers: Workers) -> None:
        """A new node's workers start in the recovery that gave it the lost node's place: at its
        restart count, with its go record."""
        workers.restarts_from(place.go["restart_count"])
        fs.write_atomic(self.folder / f"go-{place.go['recovery']}", json.dumps(place.go).encode())
        self.adopt(place.go["recovery"])

    def poll(self, workers: Workers) -> bool:
        """True while a failure is recovered in place: torchrun must not look at the workers."""
        try:
            holding = self._poll(workers)
        except (RuntimeError, OSError, ValueError) as err:  # the job's store, across nodes
            if self.agreement is None:
                raise
            # one failed look is no loss (a store under load): --node-timeout of them are
            now = time.monotonic()
            self._unanswered = self._unanswered or now
            if now - self._unanswered > self.node_timeout:
                return self._store_lost(workers, err)
            return self.incident is not None
        self._unanswered = None
        return holding

    def _poll(self, workers: Workers) -> bool:
        codes = workers.exit_codes()
        self.running = all(c is None for c in codes.values())
        waiting = self._waiting()
        link = self.agreement
        stopped = self._stopped_long(workers, codes)
        why = self._why_not(codes, workers)
        if self.incident is None:
            failed = {r for r, c in codes.items() if c not in (None, 0)}
            local = bool(failed or waiting or stopped)
            remote = (
                not local
                and link is not None
                and (link.incident() > self.generation or bool(link.neighbour_lost()))
            )
            if not local and not remote:
                return False
            # given back at once (a pre-emption, a finished rank, no restart left): the ranks
            # are not cut from each other, torchrun stops them as without the option
            self._open(workers, link, tell=not why)
        incident = self.incident
        assert incident is not None
        if stopped and not why:  # it cannot leave its step: its state is in memory like the others'
            self._kill(workers, stopped, f"stopped (SIGSTOP) for {STOPPED_AFTER:g} s or more")
            return True
        outcome = link.outcome(incident.generation) if link is not None else None
        if outcome is None:
            exited = {r: c for r, c in codes.items() if c is not None}
            if not why and set(exited) | set(waiting) != set(codes):
                now = time.monotonic()
                late = sorted(set(codes) - set(exited) - set(waiting) - set(incident.killed))
                if late and now - incident.opened > self.timeout:
                    self._kill(workers, late, f"did not leave their step within {self.timeout:g} s "
                                              "of the failure")  # fmt: skip
                undying = [r for r in incident.killed if codes.get(r) is None
                           and now - incident.killed[r] > self.timeout]  # fmt: skip
                if not undying:
                    return True
                states = ", ".join(f"rank {r} {state_code(workers.pids()[r])}" for r in undying)
                why = f"killed rank(s) did not exit {self.timeout:g} s after SIGKILL ({states})"
            if why:
                outcome = {"end": why}
                if link is not None:
                    outcome = link.decide(incident.generation, outcome)
            else:
                incident.replaced = exited
                if link is None:
                    outcome = {"go": self._decide(workers, waiting)}
                else:
                    outcome = self._across(link, workers, waiting)
                    if outcome is None:
                        return True
        if "go" in outcome and self._go(workers, waiting, outcome["go"]):
            return True
        # the waiting ranks fail as without the option; torchrun takes over
        self._end(outcome.get("end") or self.fallback)
        return False

    def _open(self, workers: Workers, link: Agreement | None, tell: bool = True) -> None:
        """A failure seen: recovery G raised (on the job's store too), and every worker told where
        ``tell``."""
        self.incident = Incident(self.generation + 1, time.time())
        self.fallback = ""
        g = self.incident.generation
        if tell:
            # the file first: a worker that starts to read its inbox after the messages finds it
            fs.write_atomic(self.folder / "incident", str(g).encode())
            for pid in workers.pids().values():
                channels.send(pid, "incident", str(g))
        if link is not None:
            link.raise_incident(g)

    def _kill(self, workers: Workers, ranks: list[int], why: str) -> None:
        """The workers of ``ranks`` killed for ``why``, to be replaced with those that exited."""
        assert self.incident is not None
        self.incident.killed |= dict.fromkeys(ranks, time.monotonic())
        workers.kill(ranks, f"{why}: killed, to be replaced")

    def _stopped_long(self, workers: Workers, codes: dict[int, int | None]) -> list[int]:
        """The running workers stopped (SIGSTOP) :data:`STOPPED_AFTER` seconds, not yet killed."""
        now, pids = time.monotonic(), workers.pids()
        killed = set(self.incident.killed) if self.incident is not None else set()
        stopped = {
            r
            for r, c in codes.items()
            if c is None and r not in killed and state_code(pids[r]) == "T"
        }
        self._stopped = {r: self._stopped.get(r, now) for r in stopped}
        return sorted(r for r, since in self._stopped.items() if now - since >= STOPPED_AFTER)

    def _why_not(self, codes: dict[int, int | None], workers: Workers) -> str:
        if any(c == PREEMPTED_EXIT_CODE for c in codes.values()):
            return "a rank was pre-empted"
        if any(c == 0 for c in codes.values()):
            return "a rank had already finished"
        if workers.restarts_left() < 1:
            return "no restart left (--max-restarts)"
        if workers.stall_ended():
            return "the stall watch ended the attempt"
        return ""

    def _store_lost(self, workers: Workers, err: BaseException) -> bool:
        """The job's store does not answer this node: the node serving it is lost, or this node
        is cut off from it. In-place recovery cannot go on: this node's workers end, named."""
        why = (
            f"the job's rendezvous store does not answer this node ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:200] if str(err) else 'no detail'}) for "
            f"{self.node_timeout:g} s (--node-timeout): the node serving it was lost, or this node "
            "is cut off from it"
        )
        if self.incident is None:
            self.incident = Incident(self.generation + 1, time.time())
        self.fallback, self.replaced = why, True
        workers.stop_restarting()
        workers.kill(sorted(workers.pids()), "ended: this node leaves the job")
        self._end(why)
        return False

    def adopt(self, generation: int) -> None:
        """Count recoveries on from ``generation`` (the job's last, closed): the workers' too."""
        self.generation = generation
        fs.write_atomic(self.folder / "last", str(generation).encode())

    def finished(self) -> None:
        """The attempt ended: this node leaves the agreement (its agent ends its link)."""
        self.agreement = None

    def _waiting(self) -> dict[int, dict[str, Any]]:
        paths = self.folder.glob(f"wait-{self.generation + 1}.*")
        return {int(r["rank"]): r for r in map(read_json, paths) if r is not None}

    def _close_incident(self) -> None:
        assert self.incident is not None
        self.adopt(self.incident.generation)
        with contextlib.suppress(OSError, ConfigError):
            fs.remove(self.folder / "incident")
        self.incident = None
        self._stopped = {}

    def _end(self, why: str) -> None:
        """The incident given back: the waiting ranks fail with ``why``, as without the option."""
        assert self.incident is not None
        self.fallback, self.ended = why, True
        g = self.incident.generation
        fs.write_atomic(self.folder / f"end-{g}", why.encode())
        self._tell_waiting(g)
        if self.agreement is not None or self.replaced:  # torch may restart every node, unsaid
            say(f"not recovered in place (recovery {g}): {why}")
        self.finished()  # the job restarts whole: a new node joins its rendezvous
        self._close_incident()

    def _tell_waiting(self, generation: int) -> None:
        for record in self._waiting().values():
            channels.send(int(record["pid"]), "word", str(generation))

    def _decide(self, workers: Workers, waiting: dict[int, dict[str, Any]]) -> dict[str, Any]:
        """One node: the go record, with the workers' new store served here."""
        assert self.incident is not None
        host = self.round.addr if self.round is not None else "127.0.0.1"
        return self._go_record(
            workers, host, sorted(self.incident.replaced), [], self._times(waiting)
        )

    def _times(self, waiting: dict[int, dict[str, Any]]) -> list[dict[str, float]]:
        """When this node saw the failure, and when each of its ranks left and tore down."""
        assert self.incident is not None
        seen = self.incident.seen
        return [
            {"seen": seen, "left": r["left"], "torn_down": r["torn_down"]} for r in waiting.values()
        ] or [{"seen": seen}]

    def _go_record(
        self, workers: Workers, host: str, replaced: list[int], lost: list[int], times: list[dict]
    ) -> dict[str, Any]:
        """The go record of the incident: a fresh store for the workers (the old one holds the old
        groups' keys, its server may be lost) served on ``host``; the last one served ends."""
        from ddpkit._internals.store import serve_new_store

        assert self.incident is not None
        self.store, port = serve_new_store(host, timedelta(minutes=5))
        return {
            "recovery": self.incident.generation,
            "restart_count": workers.restarts_used() + 1,
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
        self, link: Agreement, workers: Workers, waiting: dict[int, dict[str, Any]]
    ) -> dict[str, Any] | None:
        """Across nodes: the outcome that stands once there is one, or None (wait)."""
        assert self.incident is not None
        incident = self.incident
        g = incident.generation
        if not incident.reported:
            link.set(f"{g}/node/{link.node}", {
                "exited": sorted(incident.replaced), "times": self._times(waiting),
            })  # fmt: skip
            incident.reported = True
        link.compare_set(f"{g}/decider", str(link.node))
        decider = int(link.get(f"{g}/decider") or b"-1")
        waited = time.monotonic() - incident.opened
        if decider != link.node:
            if lost := link.lost([decider]):
                return link.decide(
                    g, {"end": f"node {decider}, deciding the recovery, was lost ({lost[decider]})"}
                )
            if waited > self.timeout + SUSPECT_AFTER + self.join_timeout + WORD_GRACE:
                return link.decide(
                    g, {"end": f"no word from node {decider}, deciding the recovery"}
                )
            return None
        reports = {n: link.get_json(f"{g}/node/{n}") for n in range(link.nodes)}
        if incident.lost is None:
            missing = [n for n, r in reports.items() if r is None]
            if done := [n for n in missing if link.link.finished(n)]:
                return link.decide(g, {"end": f"node(s) {listed(done)} had already finished"})
            found = link.lost(missing)
            if set(missing) - set(found):
                if waited > self.timeout + self.node_timeout + WORD_GRACE:
                    late = listed(sorted(set(missing) - set(found)))
                    return link.decide(g, {"end": f"node(s) {late} did not say what their ranks "
                                                  f"did within {waited:.0f} s"})  # fmt: skip
                return None
            incident.lost = found
        lost = incident.lost
        for n in sorted(lost):
            # a node counted lost that speaks after all keeps its place, where none claimed it
            if reports[n] is not None and link.compare_set(f"{g}/claim/{n}", "-") == b"-":
                del lost[n]
        if lost and (why := self._unclaimed(link, g, lost)) is not None:
            return link.decide(g, {"end": why}) if why else None
        for n in lost:  # each new node probed where its claim says, before anyone looks
            if (address := link.claimer_probe(g, n)) is not None:
                link.link.take_probe(n, address)
        replaced = {r for rep in reports.values() if rep is not None for r in rep["exited"]}
        replaced.update(r for n in lost for r in link.get_json(f"ranks/{link.round}/{n}") or [])
        times = [t for rep in reports.values() if rep is not None for t in rep["times"]]
        assert self.round is not None
        go = self._go_record(workers, self.round.addr, sorted(replaced), sorted(lost), times)
        outcome = link.decide(g, {"go": go})
        if "go" not in outcome:
            self.store = None  # given back meanwhile: the store served for it ends
        return outcome

    def _unclaimed(self, link: Agreement, g: int, lost: dict[int, str]) -> str | None:
        """The lost nodes' places offered (once): None once a new node claimed each, "" to wait
        on, or why to give the recovery back."""
        assert self.incident is not None and self.round is not None
        if self.incident.offered is None:
            self.incident.offered = time.monotonic()
            link.set("vacant", {"recovery": g, "nodes": sorted(lost), "size": link.nodes,
                                "round": link.round})  # fmt: skip
            evidence = "; ".join(f"node {n}: {why}" for n, why in sorted(lost.items()))
            say(
                f"node(s) {listed(sorted(lost))} lost ({evidence}): start the same ddpkit run "
                f"command on a new node to take its place (waiting {self.join_timeout:g} s, "
                "--join-timeout)"
            )
        if all(link.get(f"{g}/claim/{n}") is not None for n in lost):
            return None
        if self.round.waiting():
            return NODE_WAITING
        if time.monotonic() - self.incident.offered > self.join_timeout:
            return (
                f"no new node took the place of lost node(s) {listed(sorted(lost))} within "
                f"--join-timeout ({self.join_timeout:g} s)"
            )
        return ""

    def _go(self, workers: Workers, waiting: dict[int, dict[str, Any]], go: dict[str, Any]) -> bool:
        """Go on after the incident by ``go``; False where this node was replaced instead."""
        assert self.incident is not None
        incident = self.incident
        if self.agreement is not None and self.agreement.node in go["lost_nodes"]:
            # counted lost while alive: a new node has its place, and this node's ranks end; its
            # agent ends the job here, leaving the rendezvous open
            self.fallback = "this node was counted lost and replaced by a new one"
            self.replaced = True
            workers.stop_restarting()
            self.agreement.link.close()  # its beat is the new node's now
            self.agreement = None
            workers.kill(sorted(workers.pids()), "ended: this node was replaced")
            return False
        workers.use_restart()
        if self.agreement is not None:
            self.agreement.link.forget(go["lost_nodes"])  # their new nodes' beats count from now
        g = incident.generation
        fs.write_atomic(self.folder / f"go-{g}", json.dumps(go).encode())
        self._tell_waiting(g)
        self._close_incident()  # ``last`` is g before a replacement looks for its record
        env = torchrun.attempt_env(go["restart_count"], go["master_addr"], go["master_port"])
        for rank in incident.replaced:
            workers.replace_worker(rank, env)
        workers.went_on()
        kinds = [
            f"rank {r} (killed by {signal_name(-c)})" if c < 0 else f"rank {r} (exit code {c})"
            for r, c in sorted(incident.replaced.items())
        ]
        kept = sorted(waiting)
        done = [f"replaced {', '.join(kinds)}"] if kinds else []
        if go["lost_nodes"]:
            done += [f"lost node(s) {listed(go['lost_nodes'])} replaced by new ones"]
        done += [f"rank(s) {listed(kept)} go on in their processes"] if kept else []
        say(
            f"recovering in place (recovery {g}, {workers.restarts_left()} restart(s) left): "
            + "; ".join(done)
        )
        return True


def signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def prepare(join_timeout: float = 120.0, nproc: int = 1, node_timeout: float = 30.0) -> InPlace:
    """The agent's side, its folder made in the job folder (:func:`~ddpkit.distributed._channels.
    recovers_in_place` says so to the workers)."""
    from ddpkit.distributed._environment import parse_seconds

    text = os.environ.get(TIMEOUT_ENV)
    timeout = parse_seconds(TIMEOUT_ENV, text) if text else LEAVE_TIMEOUT
    where = channels.channel(channels.RECOVER)
    assert where is not None, "the job folder is made first"
    fs.make_dirs(where)
    return InPlace(where, timeout, join_timeout, nproc, node_timeout)
