"""Letting only a job's own nodes into its rendezvous: the job's secret, and a relay that checks it.

torch's c10d rendezvous store is a TCPStore that accepts any connection and has no notion of a client's identity,
and torch unpickles the rendezvous state it reads from it: anyone who reached the endpoint could write a value
that ran code in every agent. Under ``ddpkit run`` the store listens on 127.0.0.1 only. Other nodes reach it
through a relay on the endpoint's port (:class:`RelayServer`) which, before one byte of the peer's reaches the
store, has the peer prove that it holds the job's secret (an HMAC-SHA256 challenge-response with fresh nonces
on both sides, so that the host proves it too), and then carries the store's traffic in frames that each bear
an HMAC under a key of that session, so that bytes altered or injected on the way end the connection. On the
other nodes the agent's store client talks to a local end of the relay (:class:`RelayClient`), which admits
connections from its own process only. Nothing is encrypted: the rendezvous state holds addresses, not data.

Written here because the standard library has nothing that fits: TLS with a pre-shared key needs Python 3.13,
and ``multiprocessing.connection``'s authkey handshake uses HMAC-MD5 before Python 3.12 and hands over a
connection whose ``recv()`` unpickles.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import stat
import struct
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ddpkit.errors import ConfigError

SECRET_ENV = "DDPKIT_RDZV_SECRET"
"""Environment variable holding the job's secret, the same on every node (or ``--rdzv-secret-file``)."""
MIN_SECRET_CHARS = 32
MAKE_SECRET = "python -c 'import secrets; print(secrets.token_hex(32))'"

HELLO = b"ddpkit rendezvous relay 1\n"
_NONCE = 32
_TAG = 32  # HMAC-SHA256
_REFUSED = b"refused: not this job's secret".ljust(_TAG, b"\n")
_MAX_FRAME = 1 << 20  # the relay writes at most 64 KiB per frame; anything larger is not ours
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a peer has to prove itself before the relay drops it (a silent connection holds nothing for long)."""
_PENDING = 16  # handshakes at once; further connections are dropped until one ends


def load_secret(path: str | None, env: Mapping[str, str] | None = None) -> bytes:
    """The job's secret from ``path`` (``--rdzv-secret-file``), else from :data:`SECRET_ENV`.

    A file that other users can read is refused, as ssh refuses such a key; so is a secret too short to resist
    guessing. Raises :class:`ConfigError` saying how to make one.
    """
    env = os.environ if env is None else env
    if path:
        source = f"--rdzv-secret-file {path}"
        try:
            mode = os.stat(path).st_mode
            text = Path(path).read_bytes().strip()
        except OSError as err:
            raise ConfigError(f"{source}: {err.strerror}; write the job's secret there ({MAKE_SECRET})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{source} can be read by other users (mode {stat.S_IMODE(mode):o}): chmod 600 {path}")
    elif env.get(SECRET_ENV):
        source, text = SECRET_ENV, env[SECRET_ENV].strip().encode()
    else:
        raise ConfigError(
            f"a job on several nodes needs a secret that only its nodes know: export {SECRET_ENV}=$({MAKE_SECRET}) "
            "with the same value on every node, or pass --rdzv-secret-file FILE (readable only by you)"
        )
    if len(text) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"{source}: the secret has {len(text)} characters, too few to resist guessing; use at "
            f"least {MIN_SECRET_CHARS} ({MAKE_SECRET})"
        )
    return text


def derive(secret: bytes, purpose: str) -> bytes:
    """A key for one use of the secret, so that a tag made for one use is worth nothing in another."""
    return hmac.new(secret, b"ddpkit rendezvous: " + purpose.encode(), hashlib.sha256).digest()


def _tag(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed", len(buf))
        buf += chunk
    return bytes(buf)


class Refused(ConnectionError):
    """The other end does not hold this job's secret."""


class NotARelay(ConnectionError):
    """What answered at the endpoint is not a ``ddpkit run`` rendezvous relay."""


@dataclass(frozen=True)
class Session:
    """Keys of one authenticated connection, one per direction."""

    send_key: bytes
    recv_key: bytes


def accept_peer(sock: socket.socket, key: bytes) -> Session:
    """The relay's side of the handshake: the peer proves it holds ``key``, then this side proves it too."""
    ours = secrets.token_bytes(_NONCE)
    sock.sendall(HELLO + ours)
    try:
        answer = _recv_exact(sock, _NONCE + _TAG)
    except EOFError as err:
        if err.args[1]:  # it said something, and not a proof: a client of another protocol (a plain store's)
            raise Refused("the peer closed the connection without proving it holds the job's secret") from None
        raise
    theirs, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _tag(key, b"node", ours, theirs)):
        raise Refused("the peer does not hold the job's secret")  # the caller answers with refuse()
    sock.sendall(_tag(key, b"host", ours, theirs))
    return Session(_tag(key, b"host->node", ours, theirs), _tag(key, b"node->host", ours, theirs))


def refuse(sock: socket.socket) -> None:
    """Tell a peer that failed the handshake so (a node with another secret then says what is wrong), and close."""
    with contextlib.suppress(OSError):
        sock.sendall(_REFUSED)
    sock.close()


def join_host(sock: socket.socket, key: bytes) -> Session:
    """A node's side of the handshake; raises :class:`Refused` or :class:`NotARelay` naming what went wrong."""
    try:
        hello = _recv_exact(sock, len(HELLO) + _NONCE)
    except EOFError:
        raise NotARelay("the endpoint closed the connection without a word") from None
    if not hello.startswith(HELLO):
        raise NotARelay("the endpoint does not speak ddpkit's rendezvous protocol")
    theirs, ours = hello[len(HELLO) :], secrets.token_bytes(_NONCE)
    sock.sendall(ours + _tag(key, b"node", theirs, ours))
    try:
        answer = _recv_exact(sock, _TAG)
    except EOFError:
        raise Refused("the rendezvous host closed the connection during the handshake") from None
    if answer == _REFUSED:
        raise Refused("the rendezvous host does not accept this node's secret")
    if not hmac.compare_digest(answer, _tag(key, b"host", theirs, ours)):
        raise Refused("the rendezvous host could not prove that it holds the job's secret")
    return Session(_tag(key, b"node->host", theirs, ours), _tag(key, b"host->node", theirs, ours))


class FramedSocket:
    """A socket whose every message bears an HMAC over its sequence number and bytes (no replay, no reorder).

    One thread sends and one receives: each direction keeps its own counter.
    """

    def __init__(self, sock: socket.socket, session: Session) -> None:
        self.sock, self._session = sock, session
        self._sent = self._received = 0

    def send(self, data: bytes) -> None:
        header = struct.pack(">Q I", self._sent, len(data))
        self.sock.sendall(header[8:] + data + _tag(self._session.send_key, header, data))
        self._sent += 1

    def recv(self) -> bytes:
        (size,) = struct.unpack(">I", _recv_exact(self.sock, 4))
        if size > _MAX_FRAME:
            raise Refused(f"a frame of {size} bytes: not from a relay of this job")
        data = _recv_exact(self.sock, size)
        tag = _recv_exact(self.sock, _TAG)
        header = struct.pack(">Q I", self._received, size)
        if not hmac.compare_digest(tag, _tag(self._session.recv_key, header, data)):
            raise Refused("a frame whose tag does not match: altered or injected on the way")
        self._received += 1
        return data


def _splice(framed: FramedSocket, plain: socket.socket) -> None:
    """Carry bytes both ways between ``plain`` and ``framed`` on two threads; when one way ends, close both."""
    # A store request is several small writes; with Nagle's algorithm each relayed piece waits for the ACK of
    # the one before (a round trip through the relay took 12 ms instead of 0.1 ms).
    for s in (framed.sock, plain):
        with contextlib.suppress(OSError):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close() -> None:
        for s in (framed.sock, plain):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def outward() -> None:
        with contextlib.suppress(OSError):
            while data := plain.recv(1 << 16):
                framed.send(data)
        close()

    def inward() -> None:
        with contextlib.suppress(OSError, EOFError):  # Refused is an OSError: a bad frame ends the connection
            while True:
                plain.sendall(framed.recv())
        close()

    for target in (outward, inward):
        threading.Thread(target=target, daemon=True, name="ddpkit-relay").start()


def _say(message: str) -> None:
    print(f"ddpkit run: {message}", file=sys.stderr, flush=True)


class RelayServer:
    """The rendezvous host's relay: admits a peer that proves it holds the secret, then carries its traffic to the
    store at ``127.0.0.1:store_port``."""

    def __init__(self, address: tuple[str, int], store_port: int, key: bytes) -> None:
        self._store_port, self._key = store_port, key
        self._slots = threading.BoundedSemaphore(_PENDING)
        self._refusals = 0
        self._sock = socket.create_server(address, backlog=128)
        self.address = self._sock.getsockname()[:2]
        threading.Thread(target=self._accept, daemon=True, name="ddpkit-relay").start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()  # a flood of connections that do not finish the handshake
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True, name="ddpkit-relay").start()

    def _serve(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT)
            session = accept_peer(conn, self._key)
            conn.settimeout(None)
            store = socket.create_connection(("127.0.0.1", self._store_port))
        except Refused:
            self._refusals += 1
            if self._refusals <= 10:
                _say(
                    f"refused a connection to the rendezvous from {peer[0]}:{peer[1]}: it does not hold the "
                    "job's secret" + ("" if self._refusals < 10 else " (further refusals are not shown)")
                )
            refuse(conn)
            return
        except (OSError, EOFError):  # a port probe (a node waiting for the host), a timeout, a reset
            conn.close()
            return
        finally:
            self._slots.release()
        _splice(FramedSocket(conn, session), store)


def _from_this_process(peer: tuple[str, int]) -> bool:
    """True when the local TCP connection from ``peer`` was opened by a socket of this very process."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            with socket.socket(fileno=os.dup(int(name))) as s:
                if s.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                addr, port = s.getsockname()[:2]
        except OSError:
            continue
        # torch's store client connects from an IPv6 socket: ::ffff:127.0.0.1 is 127.0.0.1.
        if port == peer[1] and addr.removeprefix("::ffff:") == peer[0]:
            return True
    return False


class RelayClient:
    """A node's local end of the relay: a port on 127.0.0.1 for this process's store client, whose traffic it
    carries to the rendezvous host after the handshake. Connections from other processes (another user of this
    machine) are closed unanswered."""

    def __init__(self, host: tuple[str, int], key: bytes) -> None:
        self._host, self._key = host, key
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True, name="ddpkit-relay").start()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            if not _from_this_process(peer):
                conn.close()
                continue
            try:
                upstream = socket.create_connection(self._host, timeout=HANDSHAKE_TIMEOUT)
                session = join_host(upstream, self._key)
                upstream.settimeout(None)
            except (OSError, EOFError) as err:
                _say(f"cannot reach the rendezvous at {self._host[0]}:{self._host[1]}: {err}")
                conn.close()
                continue
            _splice(FramedSocket(upstream, session), conn)


def check_host(host: tuple[str, int], key: bytes) -> None:
    """Handshake once with the rendezvous host, so that a wrong secret is one clear error before any worker."""
    where = f"{host[0]}:{host[1]}"
    try:
        with socket.create_connection(host, timeout=HANDSHAKE_TIMEOUT) as sock:
            join_host(sock, key)
    except NotARelay as err:
        raise ConfigError(
            f"what listens at the rendezvous endpoint {where} is not `ddpkit run` ({err}): a plain torchrun, or "
            "another program; pick a free port for --rdzv-endpoint, the same on every node"
        ) from None
    except Refused as err:
        raise ConfigError(
            f"the rendezvous at {where} did not admit this node ({err}): give every node the same secret "
            f"({SECRET_ENV} or --rdzv-secret-file)"
        ) from None
    except OSError as err:
        raise ConfigError(
            f"the rendezvous at {where} failed during the handshake ({err}): check --rdzv-endpoint"
        ) from None
