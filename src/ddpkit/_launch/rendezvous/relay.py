"""The rendezvous host's relay: admits a peer that proves it holds the job's secret, then carries
its traffic to the store on 127.0.0.1 (the protocol: :mod:`ddpkit._launch.rendezvous.auth`).

The endpoint is reachable by anyone on the network, so what a peer can make the relay hold is
bounded:

- every handshake runs in one selector thread, so a genuine node is answered as soon as its bytes
  arrive, never queued behind connections that are slow, silent or send garbage;
- a handshake has :data:`~ddpkit._launch.rendezvous.auth.HANDSHAKE_TIMEOUT` seconds in all from the
  connection, not per read: a peer that sends one byte every few seconds is dropped at the deadline;
- one address may hold at most :data:`PER_ADDRESS` unfinished handshakes; a connection beyond that
  is told so and closed at once, so one address cannot fill the others' room;
- all addresses together hold at most :data:`PENDING`; a connection beyond that evicts the oldest
  handshake of the address that holds the most (``RelayServer._victim``), so that silent connections
  from many addresses, reopened as soon as they are dropped, cannot keep a node that answers at once
  out;
- a peer turned away or evicted is told so in words (``BUSY_ADDRESS``, ``BUSY_FULL`` of
  :mod:`ddpkit._launch.rendezvous.auth`), which its launcher says instead of blaming the endpoint;
- every dropped connection is said on the host's stderr, at once for the first from an address (for
  each reason), then as a count at most once a minute, so that the user of a rendezvous that will
  not form sees who holds it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import selectors
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

from ddpkit._launch.rendezvous.auth import (
    ANSWER,
    BUSY_ADDRESS,
    BUSY_FULL,
    EVICTED,
    HANDSHAKE_TIMEOUT,
    FramedSocket,
    Refused,
    Session,
    check_answer,
    greeting,
    refuse,
    say,
    splice,
)

PER_ADDRESS = 8
"""Unfinished handshakes one peer address may hold; further connections from it are closed at
once."""
PENDING = 512
"""Unfinished handshakes of all addresses together (each is one socket, no thread)."""
LOG_INTERVAL = 60.0
"""Seconds between two lines about the connections dropped from one address."""
# (address, reason) pairs said; past that, one line says further ones are not shown
_LOGGED_ADDRESSES = 256


@dataclass
class _Pending:
    """A connection that has not finished the handshake yet."""

    sock: socket.socket
    address: str
    nonce: bytes
    deadline: float
    answer: bytearray = field(default_factory=bytearray)


@dataclass
class _Drops:
    """The connections dropped from one address for one reason that the host has not said yet."""

    count: int = 0
    said_at: float | None = None


def address_key(ip: str) -> str:
    """The unit a cap counts: the address, or its /64 for IPv6 (one host commonly holds a whole
    /64)."""
    try:
        addr = ipaddress.ip_address(ip.removeprefix("::ffff:"))
    except ValueError:
        return ip
    if addr.version == 6:
        return str(ipaddress.ip_network(f"{addr}/64", strict=False))
    return str(addr)


class RelayServer:
    """The rendezvous host's relay on ``address``, in front of the store at
    ``127.0.0.1:store_port``."""

    def __init__(
        self,
        address: tuple[str, int],
        store_port: int,
        key: bytes,
        handshake_timeout: float = HANDSHAKE_TIMEOUT,
        per_address: int = PER_ADDRESS,
        log_interval: float = LOG_INTERVAL,
        pending: int = PENDING,
        evict: bool = True,
    ) -> None:
        """``evict=False`` turns a connection beyond ``pending`` away instead (the relay before
        eviction, kept for its test's control)."""
        self._store_port, self._key = store_port, key
        self._timeout, self._per_address, self._log_interval = (
            handshake_timeout,
            per_address,
            log_interval,
        )
        if pending < 1:
            raise ValueError(
                f"pending={pending}: the relay holds at least one unfinished handshake"
            )
        self._cap, self._evict = pending, evict
        self._pending: dict[socket.socket, _Pending] = {}
        self._per: Counter[str] = Counter()
        self._drops: dict[tuple[str, str], _Drops] = {}
        # whether drops from addresses past the first _LOGGED_ADDRESSES were seen
        self._drops_unshown = False
        self._sock = socket.create_server(address, backlog=128)
        self._sock.setblocking(False)
        self.address = self._sock.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, daemon=True, name="ddpkit-relay")
        self._thread.start()

    def close(self) -> None:
        """Stop listening and drop the unfinished handshakes (admitted peers keep their
        connections)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        try:
            while not self._closed:
                soonest = min((p.deadline for p in self._pending.values()), default=None)
                wait = None if soonest is None else max(0.0, soonest - time.monotonic())
                for key, _ in self._selector.select(wait):
                    if key.fileobj is self._sock:
                        self._accept()
                    else:
                        pending = self._pending.get(key.fileobj)  # type: ignore[call-overload]
                        if pending is not None:
                            self._read(pending)
                now = time.monotonic()
                for pending in [p for p in self._pending.values() if p.deadline <= now]:
                    self._drop(
                        pending,
                        f"no complete handshake within {self._timeout:g} s (slow or silent)",
                    )
        finally:
            for pending in list(self._pending.values()):
                self._forget(pending)
                pending.sock.close()
            self._selector.close()
            for s in (self._sock, self._wake_r, self._wake_w):
                s.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            # out of file descriptors: the deadlines free some; do not spin meanwhile
            except OSError:
                time.sleep(0.05)
                return
            where = address_key(peer[0])
            if self._per[where] >= self._per_address:
                self._turn_away(conn, where, BUSY_ADDRESS, "too many unfinished handshakes at once")
                continue
            if len(self._pending) >= self._cap:
                if not self._evict:
                    self._turn_away(
                        conn,
                        where,
                        BUSY_FULL,
                        f"{self._cap} unfinished handshakes of all addresses",
                    )
                    continue
                victim = self._victim()
                self._forget(victim)
                self._note(
                    victim.address, f"evicted: {self._cap} unfinished handshakes of all addresses"
                )
                refuse(victim.sock, EVICTED)
            nonce, hello = greeting()
            conn.setblocking(False)
            try:
                conn.send(hello)  # a fresh connection's send buffer holds these few bytes whole
            except OSError:
                conn.close()
                continue
            pending = _Pending(conn, where, nonce, time.monotonic() + self._timeout)
            self._pending[conn] = pending
            self._per[where] += 1
            self._selector.register(conn, selectors.EVENT_READ)

    def _victim(self) -> _Pending:
        """The handshake to evict when all addresses together hold the cap: the oldest of the
        address holding the most.

        The oldest overall would do against one churning address, but silent connections from 65
        addresses, each reopened when evicted, evict one another in a loop; a node whose answer is
        one round trip away then survives only while fewer than :data:`PENDING` reopenings land
        within that round trip. Taking from the heaviest address, a node that holds one handshake is
        never evicted while any address holds two: the flood would need as many addresses as the cap
        (and IPv6 counts a /64 as one), each holding one connection."""
        heaviest = max(self._per.values())
        return next(p for p in self._pending.values() if self._per[p.address] == heaviest)

    def _turn_away(self, conn: socket.socket, where: str, words: bytes, reason: str) -> None:
        """Close a fresh connection with the words its node says (it has sent nothing, so no reset
        eats them)."""
        self._note(where, reason)
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            conn.send(words)
        conn.close()

    def _read(self, pending: _Pending) -> None:
        try:
            data = pending.sock.recv(ANSWER - len(pending.answer))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            if pending.answer:  # it said something, and not a proof: a client of another protocol
                self._refuse(pending)
            else:  # a port probe (a node waiting for the host to start), or a reset
                self._forget(pending)
                pending.sock.close()
            return
        pending.answer += data
        if len(pending.answer) < ANSWER:
            return
        try:
            proof, session = check_answer(self._key, pending.nonce, bytes(pending.answer))
        except Refused:
            self._refuse(pending)
            return
        self._forget(pending)
        threading.Thread(
            target=self._connect,
            args=(pending.sock, proof, session),
            daemon=True,
            name="ddpkit-relay",
        ).start()

    def _connect(self, conn: socket.socket, proof: bytes, session: Session) -> None:
        """Send the relay's proof and carry the admitted peer's traffic to the store."""
        try:
            conn.setblocking(True)
            conn.settimeout(self._timeout)
            conn.sendall(proof)
            conn.settimeout(None)
            store = socket.create_connection(("127.0.0.1", self._store_port))
        except OSError:
            conn.close()
            return
        splice(FramedSocket(conn, session), store)

    def _refuse(self, pending: _Pending) -> None:
        self._forget(pending)
        self._note(pending.address, "it does not hold the job's secret", refused=True)
        refuse(pending.sock)

    def _drop(self, pending: _Pending, reason: str) -> None:
        self._forget(pending)
        self._note(pending.address, reason)  # said before the peer sees the close
        pending.sock.close()

    def _forget(self, pending: _Pending) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(pending.sock)
        if self._pending.pop(pending.sock, None) is not None:
            self._per[pending.address] -= 1
            if not self._per[pending.address]:
                del self._per[pending.address]

    def _note(self, where: str, reason: str, refused: bool = False) -> None:
        """Say a dropped connection: the first from an address for each reason at once, then a count
        of the further ones at most every ``log_interval`` seconds (a flood does not flood the
        log)."""
        drops = self._drops.get((where, reason))
        if drops is None:
            # kept no further: a flood of addresses grows nothing
            if len(self._drops) >= _LOGGED_ADDRESSES:
                if not self._drops_unshown:
                    say(
                        "dropping connections to the rendezvous from further addresses too (not "
                        "shown)"
                    )
                self._drops_unshown = True
                return
            drops = self._drops[(where, reason)] = _Drops()
        drops.count += 1
        now = time.monotonic()
        if drops.said_at is None:
            say(
                f"{'refused' if refused else 'dropped'} a connection to the rendezvous from "
                f"{where}: {reason} (further ones from {where} are counted every "
                f"{self._log_interval:g} s)"
            )
        elif now - drops.said_at >= self._log_interval:
            say(
                f"dropped {drops.count} connections to the rendezvous from {where} in "
                f"{now - drops.said_at:.0f} s: {reason}"
            )
        else:
            return
        drops.count, drops.said_at = 0, now
