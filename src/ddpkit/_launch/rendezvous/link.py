"""The agents of one job across nodes, linked through its rendezvous store for one round (one
:class:`NodeLink` each): one thread beats, publishes its node's summary for the stall watch and
reads the others' while asked; another takes the probes of the other nodes. Whether another node
is lost is judged on evidence (:meth:`NodeLink.lost`), never on a beat's silence alone: a busy
agent, a loaded store or a slow network delays beats without losing a node. Durations are measured
by the reader's own clock, never compared across machines."""

from __future__ import annotations

import contextlib
import errno
import queue
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

BEAT = 0.2
"""Seconds between two beats of a node's agent."""
SUSPECT_AFTER = 1.0
"""Seconds a beat may stand still before its node's agent is probed (and between two probes)."""
PROBE_TIMEOUT = 2.0
"""Seconds a probe waits for a connection to a node's agent."""
NODE_TIMEOUT = 30.0
"""Seconds a beat may stand still, whatever probes say, before its node counts as lost: an agent
that answers probes but never beats (stopped). ``--node-timeout`` sets another."""
STORE_TIMEOUT = 5.0
"""Seconds a link's store operation may take before it is abandoned with its connection."""
SUMMARY_READS = 20.0
"""The most reads of the others' summaries a second, over the whole job (past 4 nodes, each node's
reads are spaced out)."""
MAX_SUMMARY = 65536  # a longer summary is not read (1,024 ranks write about 42 KB)

_NONE = b"\0none"  # compare_set's answer for a missing key, when asked to expect it


def _connect(store: Any, timeout: float) -> Any:
    """A new client connection to ``store``'s server, its operations bounded by ``timeout``
    seconds; where this torch cannot make one (no ``clone`` before torch 2.7, and a
    ``PrefixStore`` does not say its prefix), ``store`` itself: its connection shared, its own
    timeout left as it is (the caller's bound still holds, see :class:`BoundedStore`)."""
    clone = getattr(store, "clone", None)
    if clone is not None:
        conn = clone()
    elif hasattr(store, "host"):  # a TCPStore
        import torch.distributed as dist

        conn = dist.TCPStore(store.host, store.port, is_master=False, timeout=store.timeout)
    else:
        return store
    conn.set_timeout(timedelta(seconds=timeout))
    return conn


class BoundedStore:
    """A connection to a TCPStore's server whose every operation returns, or raises
    :class:`TimeoutError`, within ``timeout`` seconds. torch's own timeout bounds only the wait for
    a missing key: a host whose kernel answers but whose store does not (its process stopped)
    would hold the caller for ever. The operations run in order on a thread of the connection's
    own; one past the bound is left to it, and the next opens a new connection on a new thread."""

    def __init__(self, store: Any, timeout: float = STORE_TIMEOUT) -> None:
        self._base, self._timeout = store, timeout
        self._runner: _Runner | None = None

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.call(name, *args)

    def call(self, name: str, *args: Any, timeout: float | None = None) -> Any:
        """The store's ``name(*args)``, within ``timeout`` seconds (the store's bound if None)."""
        runner = self._runner
        if runner is None:
            runner = self._runner = _Runner(self._base, self._timeout)
        try:
            return runner.call(name, args, self._timeout if timeout is None else timeout)
        except Exception:
            # past the bound, or a broken connection: a new one next time
            self._runner = None
            runner.stop()
            raise

    def close(self) -> None:
        """End the connection's thread, waiting for an operation under way up to the bound: a
        thread still inside torch's store when the process exits aborts it."""
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.stop()
            runner.thread.join(timeout=self._timeout)


class _Runner:
    """One thread and its connection to a TCPStore's server, running operations in order."""

    def __init__(self, base: Any, timeout: float) -> None:
        self._todo: queue.SimpleQueue[
            tuple[str, tuple[Any, ...], threading.Event, list[Any]] | None
        ]
        self._todo = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._run, args=(base, timeout), name="ddpkit-store", daemon=True
        )
        self.thread.start()

    def _run(self, base: Any, timeout: float) -> None:
        conn = None
        while (task := self._todo.get()) is not None:
            name, args, done, out = task
            try:
                if conn is None:
                    conn = _connect(base, timeout)
                out.append((True, getattr(conn, name)(*args)))
            except BaseException as err:  # noqa: BLE001  (raised in the caller's thread)
                out.append((False, err))
            done.set()

    def call(self, name: str, args: tuple[Any, ...], timeout: float) -> Any:
        done, out = threading.Event(), list[Any]()
        self._todo.put((name, args, done, out))
        if not done.wait(timeout):
            raise TimeoutError(f"the job's store did not answer within {timeout:g} s")
        ok, value = out[0]
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self._todo.put(None)  # the thread ends once its operation under way returns, if ever


def read(store: Any, key: str) -> bytes | None:
    """The value of ``key``, None where unset: one round trip, never a wait."""
    value = store.compare_set(key, _NONE, _NONE)
    return None if value == _NONE else value


def probe(address: tuple[str, int], timeout: float = PROBE_TIMEOUT) -> tuple[str, bool] | None:
    """Whether a node's agent is there: None where its listener took a connection (the kernel
    takes it for a busy, starved or stopped agent too); else the evidence, in words, and whether
    it is conclusive (refused or unreachable) or one look (no answer in time)."""
    try:
        with socket.create_connection(address, timeout=timeout):
            return None
    except ConnectionRefusedError:
        return f"its agent refused a connection at {address[0]}:{address[1]} (gone)", True
    except TimeoutError:
        return f"its agent did not answer at {address[0]}:{address[1]} within {timeout:g} s", False
    except OSError as err:
        if err.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN):
            return f"its node is unreachable ({err.strerror}) at {address[0]}:{address[1]}", True
        return None  # not evidence of a loss (this node's own trouble)


@dataclass
class _Beat:
    count: bytes
    since: float  # by this node's clock, when the count last changed
    probed: float = 0.0  # when the last probe started
    probing: bool = False
    evidence: str | None = None  # what the probes found, None: the agent answered
    unanswered: int = 0  # probes in a row that got no answer in time


class NodeLink:
    """Node ``node`` of ``nodes``' link for round ``round_name`` on the job's ``store`` (a reader
    only with ``node`` -1), its agent reachable for probes at ``addr``. Keys, under
    ``ddpkit/nodes/<round>/``: ``beat/N`` (a count), ``probe/N`` (``host port``), ``summary/N``
    (the stall watch's), ``done/N`` (its workers succeeded: its silence is no loss)."""

    def __init__(
        self,
        store: Any,
        round_name: str,
        node: int = -1,
        nodes: int = 0,
        addr: str = "",
        node_timeout: float = NODE_TIMEOUT,
        listener: socket.socket | None = None,
    ) -> None:
        """``listener``: the probes' listening socket, where the agent made it already (a new
        node's, whose address went with its claim of a lost node's place)."""
        self.store = BoundedStore(store)  # this thread's (the agent's poll); the beat has its own
        self._base = store
        self.round, self.node, self.nodes = round_name, node, nodes
        self.node_timeout = node_timeout
        self.prefix = f"ddpkit/nodes/{round_name}/"
        self._beats: dict[int, _Beat] = {}
        self._probes: dict[int, tuple[str, int] | None] = {}
        self._lock = threading.Lock()
        self._outgoing: bytes | None = None
        self._want = False
        self._seen: dict[int, tuple[bytes, float]] = {}  # node -> summary, when it changed
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        if node >= 0:
            # the kernel takes a probe's connection whatever the agent does; a thread that never
            # touches the store closes it, and a full backlog (1024) needs hours of probes
            self._listener = listener or socket.create_server(
                (addr or "127.0.0.1", 0), backlog=1024
            )
            host, port = self._listener.getsockname()[:2]
            # the store has just answered the rendezvous: only its loss fails this, not its load
            key = f"{self.prefix}probe/{node}"
            self.store.call("set", key, f"{addr or host} {port}", timeout=node_timeout)
            threading.Thread(target=self._accept, name="ddpkit-probes", daemon=True).start()
            self._thread = threading.Thread(target=self._run, name="ddpkit-link", daemon=True)
            self._thread.start()

    # -- this node's side: the threads -------------------------------------------------------------

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    def _run(self) -> None:
        beat, summary = f"{self.prefix}beat/{self.node}", f"{self.prefix}summary/{self.node}"
        every_read = max(BEAT, self.nodes / SUMMARY_READS)
        store, sent, read_at = BoundedStore(self._base), None, 0.0
        stopping = False
        while True:  # once more after the stop: the last summary written
            with self._lock:
                data, want = self._outgoing, self._want
            try:
                # a connection of its own: a slow read of the agent's never holds a beat back
                store.add(beat, 1)
                if data is not None and data != sent:
                    store.set(summary, data)
                    sent = data
                now = time.monotonic()
                if want and now >= read_at:
                    read_at = now + every_read
                    self._read_summaries(store)
                elif not want and self._seen:
                    with self._lock:
                        self._seen.clear()  # read afresh, and aged from then, at the next wait
            except Exception:  # noqa: BLE001  (a broken connection: a new one at the next beat)
                pass
            if stopping:
                store.close()
                return
            stopping = self._stop.wait(BEAT)

    def _read_summaries(self, store: Any) -> None:
        others = [n for n in range(self.nodes) if n != self.node]
        keys = [f"{self.prefix}summary/{n}" for n in others]
        # a get blocks on a missing key: one check for all, then one per key
        present = (
            others if store.check(keys) else [n for n, k in zip(others, keys) if store.check([k])]
        )
        values = store.multi_get([f"{self.prefix}summary/{n}" for n in present])  # one round trip
        now = time.monotonic()
        with self._lock:
            for n, raw in zip(present, values, strict=True):
                data = bytes(raw)
                if len(data) <= MAX_SUMMARY and self._seen.get(n, (None, 0.0))[0] != data:
                    self._seen[n] = (data, now)

    def publish(self, summary: bytes, want: bool) -> None:
        """Write this node's ``summary`` at the next beat; read the others' while ``want``."""
        with self._lock:
            self._outgoing, self._want = summary, want

    def summaries(self) -> dict[int, tuple[bytes, float]]:
        """The other nodes' summaries last read, each with the seconds since it changed (by this
        node's clock)."""
        now = time.monotonic()
        with self._lock:
            return {node: (data, now - at) for node, (data, at) in self._seen.items()}

    def close(self, finished: bool = False, last: bytes | None = None) -> None:
        """Stop beating (``finished``: this node's workers succeeded, its silence is no loss),
        writing ``last`` as its summary first."""
        if last is not None:
            with self._lock:
                self._outgoing, self._want = last, False
        if finished:
            with contextlib.suppress(Exception):
                self.store.set(f"{self.prefix}done/{self.node}", "1")
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * STORE_TIMEOUT)
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # its accept() returns
            listener.close()
        self.store.close()

    # -- the other nodes -----------------------------------------------------------------------

    def finished(self, node: int) -> bool:
        """Whether ``node`` said its workers succeeded."""
        return read(self.store, f"{self.prefix}done/{node}") is not None

    def lost(self, among: Iterable[int]) -> dict[int, str]:
        """The nodes of ``among`` that are lost, each with the evidence: a beat that stood still
        :data:`SUSPECT_AFTER` seconds (by this reader's clock, from its first look at least) and an
        agent gone or unreachable (its address refuses, or two probes in a row got no answer), or a
        beat that stood still ``node_timeout`` seconds. A node that never beat, or that finished,
        is not judged. A suspect is probed at most every :data:`SUSPECT_AFTER` seconds, from a
        thread of its own: this returns at once, a suspect's verdict at a later call."""
        now, out = time.monotonic(), {}
        for node in among:
            count = read(self.store, f"{self.prefix}beat/{node}")
            if count is None:  # not started yet: no verdict
                continue
            last = self._beats.get(node)
            if last is None or last.count != count:
                self._beats[node] = _Beat(count, now)
                continue
            silent = now - last.since
            if silent > self.node_timeout and not self.finished(node):
                out[node] = f"no beat for {silent:.0f} s (--node-timeout {self.node_timeout:g} s)"
            elif silent > SUSPECT_AFTER:
                if last.evidence is not None and not self.finished(node):
                    out[node] = f"no beat for {silent:.1f} s, and {last.evidence}"
                elif not last.probing and now - last.probed >= SUSPECT_AFTER:
                    self._probe(node, last)
        return out

    def _probe(self, node: int, beat: _Beat) -> None:
        address = self._probe_address(node)
        if address is None:
            return
        beat.probing, beat.probed = True, time.monotonic()

        def run() -> None:
            found = probe(address)
            if found is None:
                beat.unanswered = 0
            elif found[1] or beat.unanswered >= 1:  # conclusive, or a second in a row
                beat.evidence = found[0]
            else:
                beat.unanswered += 1
            beat.probing = False

        threading.Thread(target=run, name="ddpkit-probe", daemon=True).start()

    def _probe_address(self, node: int) -> tuple[str, int] | None:
        if node not in self._probes:
            raw = read(self.store, f"{self.prefix}probe/{node}")
            host, _, port = (raw or b"").decode().partition(" ")
            self._probes[node] = (host, int(port)) if port.isdigit() else None
        return self._probes[node]

    def take_probe(self, node: int, address: str) -> None:
        """Probe ``node`` at ``address`` (``host port``) from now on: a new node's, given with its
        claim of a lost node's place, so that no look ever probes the lost node's."""
        self.store.call("set", f"{self.prefix}probe/{node}", address, timeout=self.node_timeout)
        self._probes.pop(node, None)

    def forget(self, nodes: Iterable[int]) -> None:
        """Judge ``nodes`` afresh (a new node in a lost one's place): from the next look on."""
        for node in nodes:
            self._beats.pop(node, None)
            self._probes.pop(node, None)

    def alive(self, node: int) -> bool:
        """Whether ``node``'s agent answers a probe now (waits up to :data:`PROBE_TIMEOUT`)."""
        address = self._probe_address(node)
        return address is not None and probe(address) is None
