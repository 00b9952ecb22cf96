"""In-place recovery across nodes: the agents agree on each recovery through the job's rendezvous
store (:class:`Agreement`), and a node started in a lost node's place takes it (:func:`join`).

Keys, under :data:`KEY` (outside any round: a new node knows none): ``incident`` (the newest
recovery any node raised), ``G/node/N`` (what node N's ranks did in recovery G), ``G/decider`` (the
first node to have said it), ``G/claim/N`` (the new node in lost node N's place, ``host port pid
token`` with the address its agent answers probes at, or ``-``: node N spoke after all),
``G/outcome`` (the go, or why the recovery is given back: written once, the first stands),
``vacant`` (the places offered), ``job`` (the round and size of a job on all its nodes),
``ranks/R/N`` (node N's global ranks in round R).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import time
from typing import Any

from ddpkit._errors import ConfigError
from ddpkit._launch import say
from ddpkit._launch.rendezvous.backend import Joined
from ddpkit._launch.rendezvous.link import BoundedStore, NodeLink, read

KEY = "ddpkit/recover/"


class Agreement:
    """This node's part in the agents' agreement on each recovery, through its ``link``."""

    def __init__(self, link: NodeLink) -> None:
        self.link, self.store = link, link.store
        self.node, self.nodes, self.round = link.node, link.nodes, link.round

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, None where unset: one round trip, never a wait."""
        return read(self.store, KEY + key)

    def get_json(self, key: str) -> Any:
        value = self.get(key)
        return json.loads(value) if value is not None else None

    def set(self, key: str, value: Any) -> None:
        self.store.set(KEY + key, value if isinstance(value, str) else json.dumps(value))

    def compare_set(self, key: str, value: str) -> bytes:
        """``key`` set to ``value`` where unset; the value that stands."""
        return self.store.compare_set(KEY + key, "", value)

    def incident(self) -> int:
        """The newest recovery any node raised, 0 before any."""
        return int(self.get("incident") or b"0")

    def raise_incident(self, generation: int) -> None:
        current = self.get("incident")
        if current is None or int(current) < generation:
            self.store.compare_set(KEY + "incident", current or "", str(generation))

    def outcome(self, generation: int) -> dict[str, Any] | None:
        """Recovery ``generation``'s outcome, ``{"go": record}`` or ``{"end": why}``; None yet."""
        return self.get_json(f"{generation}/outcome")

    def claimer_probe(self, generation: int, node: int) -> str | None:
        """Where the new node that claimed lost node ``node``'s place in recovery ``generation``
        answers probes (``host port``, from its claim: :func:`_claim`); None where none says."""
        host, port, *_ = [*(self.get(f"{generation}/claim/{node}") or b"").decode().split(), "", ""]
        return f"{host} {port}" if port.isdigit() else None

    def decide(self, generation: int, outcome: dict[str, Any]) -> dict[str, Any]:
        """``outcome`` for recovery ``generation`` where none was written (with the round it was
        decided in); the one that stands."""
        written = json.dumps(outcome | {"round": self.round})
        return json.loads(self.compare_set(f"{generation}/outcome", written))

    def closed(self) -> int:
        """The newest recovery the nodes closed (went on or gave back), 0 before any."""
        g = self.incident()
        return g if not g or self.outcome(g) is not None else g - 1

    def lost(self, among: list[int]) -> dict[int, str]:
        """The nodes of ``among`` lost, with the evidence (:meth:`NodeLink.lost`)."""
        return self.link.lost(among)

    def neighbour_lost(self) -> dict[int, str]:
        """The next node, where it is lost: each node watches one, every node is watched."""
        return self.link.lost([(self.node + 1) % self.nodes])

    def announce(self, ranks: list[int]) -> None:
        """This node's global ranks in the round; node 0 says the job runs on all its nodes."""
        self.set(f"ranks/{self.round}/{self.node}", ranks)
        if self.node == 0:
            self.set("job", {"round": self.round, "size": self.nodes})


def join(
    store: Any, addr: str, nproc: int, wait: float, join_timeout: float, node_timeout: float
) -> Joined | None:
    """For a node of ``nproc`` workers starting in a job that recovers in place: the place of a
    lost node, claimed, once the job's agents say go; None where no place is open (or none opens
    within ``wait`` seconds of a recovery under way, or the job's store stops answering): torch's
    rendezvous follows."""
    reader = _Reader(BoundedStore(store))
    listener: socket.socket | None = None
    mine: NodeLink | None = None
    try:
        found = _vacancy(reader, store, wait, join_timeout, node_timeout)
        if found is None:
            return None
        generation, vacant = found
        # the probes' listener before the claim, its address in it: the others probe this node
        # from the go on, never the lost node's address, however long this node takes to beat
        listener = socket.create_server((addr or "127.0.0.1", 0), backlog=1024)
        probe_at = f"{addr or listener.getsockname()[0]} {listener.getsockname()[1]}"
        place = _claim(reader, probe_at, nproc, generation, vacant)
        if place is None:
            return None  # of another size: torch's rendezvous takes it in at a whole restart
        say(f"taking the place of lost node {place} (recovery {generation})")
        # beating from now: the others must not count the place lost again while this node starts
        mine = NodeLink(store, vacant["round"], place, vacant["size"], addr, node_timeout, listener)
        listener = None  # the link's
        deadline = time.monotonic() + join_timeout
        while time.monotonic() < deadline:
            outcome = reader.get_json(f"{generation}/outcome")
            if outcome is not None and "go" in outcome:
                joined = Joined(place, vacant["size"], vacant["round"], outcome["go"], mine)
                mine = None  # the agent's now
                return joined
            if outcome is not None:
                break
            time.sleep(0.02)
        return None
    except (RuntimeError, OSError) as err:  # the store's host lost, or this node cut from it
        say(
            f"the job's store stopped answering while this node waited for a place "
            f"({type(err).__name__}: {err}); torch's rendezvous follows"
        )
        return None
    finally:
        if mine is not None:
            with contextlib.suppress(Exception):
                mine.close()
        if listener is not None:
            listener.close()
        reader.conn.close()


class _Reader:
    """The agreement's keys read by a node that has no place yet, on a connection of its own."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def get_json(self, key: str) -> Any:
        value = read(self.conn, KEY + key)
        return json.loads(value) if value is not None else None

    def incident(self) -> int:
        return int(read(self.conn, KEY + "incident") or b"0")

    def finished(self, round_name: str, node: int) -> bool:
        """Whether ``node`` of round ``round_name`` said its workers succeeded (its link's key)."""
        return read(self.conn, f"ddpkit/nodes/{round_name}/done/{node}") is not None


def _vacancy(
    reader: _Reader, store: Any, wait: float, join_timeout: float, node_timeout: float
) -> tuple[int, dict[str, Any]] | None:
    """The recovery under way and the places it offers, once offered; None where there is no
    recovery under way. A job running on all its nodes is waited on up to ``join_timeout``, for a
    place to open; one whose node does not answer, up to ``node_timeout`` more than ``wait``, for
    the others to judge it lost."""
    job = reader.get_json("job")
    alive = job is not None and _all_alive(store, job)
    # a node of the job that does not answer: its loss is being judged (a node started right after
    # a cut comes before the verdict), and its place opens then
    judged = job is not None and not alive
    if alive:  # a place opens when a node is lost: taken here, the job goes on without a restart
        say(
            f"the job runs on all its {job['size']} node(s): waiting for one's place "
            f"(--join-timeout, {join_timeout:g} s)"
        )
    elif judged:
        say(f"a node of the job does not answer: waiting {wait + node_timeout:g} s for its place")
    deadline = time.monotonic() + (
        join_timeout if alive else wait + (node_timeout if judged else 0)
    )
    next_look, first = 0.0, reader.incident()
    while True:
        generation = reader.incident()
        outcome = reader.get_json(f"{generation}/outcome") if generation else None
        if generation and outcome is None:
            vacant = reader.get_json("vacant")
            if vacant is not None and vacant["recovery"] == generation:
                return generation, vacant
        elif not alive and not judged:
            return None  # no recovery under way
        elif (
            outcome is not None
            and "end" in outcome
            and (generation > first or (job is not None and outcome.get("round") == job["round"]))
        ):
            # given back while this node waited, or in the job's round before it came (the job
            # has not restarted since): the whole restart takes it in
            say(f"the job's recovery {generation} was given back ({outcome['end']}): joining "
                "torchrun's rendezvous, for the job's whole restart")  # fmt: skip
            return None
        elif time.monotonic() >= next_look:  # once a second: each look is a node's key
            next_look = time.monotonic() + 1.0
            if all(reader.finished(job["round"], n) for n in range(job["size"])):
                raise ConfigError("the job finished while this node waited for a node's place")
        if time.monotonic() > deadline:
            if alive:
                say(
                    f"no node's place opened within --join-timeout ({join_timeout:g} s): waiting "
                    "in torchrun's rendezvous, to join the job at its next whole restart"
                )
            return None
        time.sleep(0.05)


def _claim(
    reader: _Reader, probe_at: str, nproc: int, generation: int, vacant: dict[str, Any]
) -> int | None:
    """The lost node's place this node claimed (with ``probe_at``, ``host port``, where its agent
    answers probes), None where none of its size is open."""
    claim = f"{probe_at} {os.getpid()} {secrets.token_hex(8)}"  # two new nodes never hold one
    sizes = {n: len(reader.get_json(f"ranks/{vacant['round']}/{n}") or []) for n in vacant["nodes"]}
    for n, size in sizes.items():
        if size != nproc:
            say(f"not taking the place of lost node {n}: it ran {size} worker(s), this node "
                f"{nproc} (--nproc)")  # fmt: skip
        elif reader.conn.compare_set(f"{KEY}{generation}/claim/{n}", "", claim) == claim.encode():
            return n
    if set(sizes.values()) == {nproc}:
        # in torch's rendezvous it would wait for a place the job never has: every restart
        # would take it in and leave a node out again
        raise ConfigError(
            f"the place of lost node(s) {listed(vacant['nodes'])} was taken by another new node "
            f"(recovery {generation}): this node is not needed now; start it again to join the "
            "job at a later restart"
        )
    return None


def _all_alive(store: Any, job: dict[str, Any]) -> bool:
    """Whether every node of ``job`` (its round and size) has an agent that answers a probe."""
    reader = NodeLink(store, job["round"])
    return all(reader.alive(n) for n in range(job["size"]))


def listed(numbers: Any) -> str:
    return ", ".join(map(str, numbers))
