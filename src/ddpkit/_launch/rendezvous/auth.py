"""Letting only a job's own nodes into its rendezvous (docs/many-machines.md, "Who gets in"): the
job's secret; the host's relay (:class:`RelayServer`), which has a peer prove it holds the secret
before one byte reaches the store, then carries HMAC-tagged frames (:class:`FramedSocket`); a
node's local end (:class:`RelayClient`). Nothing is encrypted."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import os
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from ddpkit._errors import ConfigError
from ddpkit._launch import say
from ddpkit._launch.proctree import sockets

SECRET_ENV = "DDPKIT_RDZV_SECRET"  # the job's secret, the same on every node
SECRET_FILE_ENV = "DDPKIT_RDZV_SECRET_FILE"  # the default of --rdzv-secret-file (a mounted Secret)
MIN_SECRET_CHARS = 32
MAKE_SECRET = "python -c 'import secrets; print(secrets.token_hex(32))'"

HELLO = b"ddpkit rendezvous relay 1\n"
_NONCE = 32
_TAG = 32  # HMAC-SHA256
_REFUSED = b"refused: not this job's secret".ljust(_TAG, b"\n")
# the relay's words for an evicted handshake (in place of its proof) and a full relay (of HELLO)
EVICTED = b"evicted: the relay is full".ljust(_TAG, b"\n")
BUSY = b"ddpkit rendezvous relay busy: "
BUSY_ADDRESS = BUSY + b"address\n"
BUSY_FULL = BUSY + b"full\n"
_BUSY_WORDS = {
    BUSY_ADDRESS: "its relay already holds as many unfinished handshakes from this node's address "
    "as it takes",
    BUSY_FULL: "its relay is full of unfinished handshakes from other addresses",
}
_MAX_FRAME = 1 << 20  # the relay writes at most 64 KiB per frame; anything larger is not ours
HANDSHAKE_TIMEOUT = 10.0  # seconds a peer has, from its connection, for the whole handshake
ANSWER = _NONCE + _TAG  # what a node sends in the handshake: its nonce and its proof


def load_secret(path: str | None, env: Mapping[str, str] | None = None) -> bytes:
    """The job's secret from ``path`` (``--rdzv-secret-file``, else :data:`SECRET_FILE_ENV`), else
    from :data:`SECRET_ENV`: a file other users can read, or a secret too short to resist guessing,
    is a :class:`ConfigError` saying how to make one."""
    env = os.environ if env is None else env
    option = "--rdzv-secret-file" if path else SECRET_FILE_ENV
    path = path or env.get(SECRET_FILE_ENV)
    if path:
        source = f"{option} {path if len(path) <= 80 else path[:80] + '...'}"
        text, info = _read_secret_file(path, source)
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO) and not _kubelet_secret(path, info):
            raise ConfigError(
                f"{source} can be read by other users (mode {stat.S_IMODE(info.st_mode):o}): chmod "
                f"600 {path} (a Kubernetes Secret volume: defaultMode: 0440 with the pod's "
                "fsGroup, as ddpkit k8s writes it)"
            )
    elif env.get(SECRET_ENV):
        source = SECRET_ENV
        try:
            text = env[SECRET_ENV].strip().encode()
        except UnicodeEncodeError:  # bytes the locale could not decode
            raise ConfigError(
                f"{SECRET_ENV} holds bytes that are not text in this locale: use a secret of "
                f"letters and digits, the same on every node ({MAKE_SECRET})"
            ) from None
    else:
        raise ConfigError(
            "a job that meets at --rdzv-endpoint needs a secret that only its nodes know: export "
            f"{SECRET_ENV}=$({MAKE_SECRET}) with the same value on every node, or pass "
            "--rdzv-secret-file FILE (readable only by you); a job of one node needs no "
            "--rdzv-endpoint"
        )
    if len(text) < MIN_SECRET_CHARS:
        raise ConfigError(
            f"{source}: the secret has {len(text)} characters, too few to resist guessing; use at "
            f"least {MIN_SECRET_CHARS} ({MAKE_SECRET})"
        )
    return text


_MAX_SECRET_FILE = 1 << 16


def _kubelet_secret(path: str, info: os.stat_result) -> bool:
    """Whether ``path`` (opened, ``info`` its fstat) is a key of a Kubernetes Secret volume mounted
    for this pod's ``fsGroup``, exactly as the kubelet lays it out (``path -> ..data/<name>``,
    ``..data -> ..<timestamp>``, the file root's, mode 0440, its group one of this process's):
    group-readable is private there."""
    if info.st_uid != 0 or stat.S_IMODE(info.st_mode) != 0o440:
        return False
    if info.st_gid != os.getegid() and info.st_gid not in os.getgroups():
        return False
    folder, name = os.path.split(path)
    try:
        if os.readlink(path) != f"..data/{name}":
            return False
        data = os.readlink(os.path.join(folder, "..data"))
        real = os.stat(os.path.join(folder, data, name), follow_symlinks=False)
    except OSError:
        return False
    dated = data.startswith("..") and data not in ("..", "..data") and "/" not in data
    return (
        dated
        and stat.S_ISREG(real.st_mode)
        and (real.st_dev, real.st_ino) == (info.st_dev, info.st_ino)
    )


def _read_secret_file(path: str, source: str) -> tuple[bytes, os.stat_result]:
    """(the stripped contents, the status) of the regular file at ``path``, checked first."""
    how = f"write the job's secret there ({MAKE_SECRET})"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
        raise ConfigError(f"{source}: {getattr(err, 'strerror', None) or err}; {how}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{source} is not a regular file; {how}")
        if info.st_size > _MAX_SECRET_FILE:
            raise ConfigError(f"{source} holds {info.st_size} bytes, not a secret; {how}")
        try:
            data = os.read(fd, _MAX_SECRET_FILE + 1)
        except OSError as err:
            raise ConfigError(f"{source}: {err.strerror}; {how}") from None
    finally:
        os.close(fd)
    return data.strip(), info


def derive(secret: bytes, purpose: str) -> bytes:
    """A key for one use of the secret: a tag made for one use is worth nothing in another."""
    return hmac.new(secret, b"ddpkit rendezvous: " + purpose.encode(), hashlib.sha256).digest()


def _tag(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("connection closed", bytes(buf))
        buf += chunk
    return bytes(buf)


class Refused(ConnectionError):
    """The other end does not hold this job's secret."""


class Busy(ConnectionError):
    """The rendezvous host's relay turned this node away, or evicted its handshake: it was full."""


class NotARelay(ConnectionError):
    """What answered at the endpoint is not a ``ddpkit run`` rendezvous relay."""


@dataclass(frozen=True)
class Session:
    """Keys of one authenticated connection, one per direction."""

    send_key: bytes
    recv_key: bytes


def check_answer(key: bytes, ours: bytes, answer: bytes) -> tuple[bytes, Session]:
    """The relay's side of the handshake, given the peer's :data:`ANSWER`: (the relay's proof to
    send back, the session). Raises :class:`Refused` when the peer does not hold ``key`` (the caller
    answers with refuse())."""
    theirs, proof = answer[:_NONCE], answer[_NONCE:]
    if len(answer) != ANSWER or not hmac.compare_digest(proof, _tag(key, b"node", ours, theirs)):
        raise Refused("the peer does not hold the job's secret")
    session = Session(
        _tag(key, b"host->node", ours, theirs), _tag(key, b"node->host", ours, theirs)
    )
    return _tag(key, b"host", ours, theirs), session


def refuse(sock: socket.socket, words: bytes = _REFUSED) -> None:
    """Tell a peer that failed the handshake (or was evicted: :data:`EVICTED`) so, and close."""
    with contextlib.suppress(OSError):
        sock.sendall(words)
    sock.close()


def join_host(sock: socket.socket, key: bytes) -> Session:
    """A node's side of the handshake; :class:`Refused` or :class:`NotARelay` say what failed."""
    try:
        hello = _recv_exact(sock, len(HELLO) + _NONCE)
    except EOFError as err:  # fewer: the other end closed first
        hello = err.args[1]
    if hello in _BUSY_WORDS:
        raise Busy(_BUSY_WORDS[hello])
    if len(hello) < len(HELLO) + _NONCE:
        raise NotARelay("the endpoint closed the connection without a word")
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
    if answer == EVICTED:
        raise Busy(
            "its relay, full of unfinished handshakes, evicted this node's before it finished"
        )
    if not hmac.compare_digest(answer, _tag(key, b"host", theirs, ours)):
        raise Refused("the rendezvous host could not prove that it holds the job's secret")
    return Session(_tag(key, b"node->host", theirs, ours), _tag(key, b"host->node", theirs, ours))


class FramedSocket:
    """A socket whose every message bears an HMAC over its number and bytes; one sender."""

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


PEER_SILENT = 10.0
"""Seconds the relay's connection across the network may go unanswered (its data unacknowledged,
or no answer to keepalive probes when idle) before it is closed: a node cut from the network, or
powered off, sends no reset, and a store operation through it would wait for ever."""


def _bounded(sock: socket.socket) -> None:
    """Close ``sock`` once its peer has not answered for :data:`PEER_SILENT` seconds (Linux; the
    kernel answers for a busy peer process, so only a peer that is gone or unreachable counts)."""
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (
        ("TCP_KEEPIDLE", PEER_SILENT / 2), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", PEER_SILENT / 2),
        ("TCP_USER_TIMEOUT", PEER_SILENT * 1000),  # ms: data sent and never acknowledged
    ):  # fmt: skip
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), int(value)))
    for level, option, value in options:
        with contextlib.suppress(OSError):
            sock.setsockopt(level, option, value)


def splice(framed: FramedSocket, plain: socket.socket) -> None:
    """Carry bytes both ways between ``plain`` and ``framed``; when one way ends, or ``framed``'s
    peer stops answering (:func:`_bounded`), close both: the store client waiting on ``plain``
    gets an error instead of waiting for an answer that never comes."""
    _bounded(framed.sock)
    # a store request is several small writes: Nagle's algorithm would hold each for an ACK
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
        with contextlib.suppress(OSError, EOFError):
            while True:
                plain.sendall(framed.recv())
        close()

    for target in (outward, inward):
        threading.Thread(target=target, daemon=True, name="ddpkit-relay").start()


def _from_this_process(peer: tuple[str, int]) -> bool:
    """True when the local connection from ``peer`` was opened by this very process."""
    for fd in sockets():
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                if s.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                addr, port = s.getsockname()[:2]
        except OSError:
            continue
        # torch's store client connects from an IPv6 socket: ::ffff:127.0.0.1 is 127.0.0.1
        if port == peer[1] and addr.removeprefix("::ffff:") == peer[0]:
            return True
    return False


class RelayClient:
    """A node's local end of the relay, for this process's store client alone."""

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
                say(f"cannot reach the rendezvous at {self._host[0]}:{self._host[1]}: {err}")
                conn.close()
                continue
            splice(FramedSocket(upstream, session), conn)


def check_host(host: tuple[str, int], key: bytes) -> None:
    """Handshake once with the host: a wrong secret is one clear error before any worker."""
    where = f"{host[0]}:{host[1]}"
    try:
        with socket.create_connection(host, timeout=HANDSHAKE_TIMEOUT) as sock:
            join_host(sock, key)
    except Busy as err:
        raise ConfigError(
            f"the rendezvous at {where} turned this node away ({err}): connections that never "
            "finish the handshake fill it (the host's stderr names their addresses); stop them, "
            "or let only the job's nodes reach the port, and start this node again"
        ) from None
    except NotARelay as err:
        raise ConfigError(
            f"what listens at the rendezvous endpoint {where} is not `ddpkit run` ({err}): a plain "
            "torchrun, or another program; pick a free port for --rdzv-endpoint, the same on "
            "every node"
        ) from None
    except Refused as err:
        raise ConfigError(
            f"the rendezvous at {where} did not admit this node ({err}): give every node the same "
            f"secret ({SECRET_ENV} or --rdzv-secret-file)"
        ) from None
    except OSError as err:
        raise ConfigError(
            f"the rendezvous at {where} failed during the handshake ({err}): check --rdzv-endpoint"
        ) from None


PER_ADDRESS = 8  # unfinished handshakes one address may hold
PENDING = 512  # unfinished handshakes of all addresses (a socket each, no thread)
LOG_INTERVAL = 60.0  # seconds between two lines about the connections dropped from one address
_LOGGED_ADDRESSES = 256  # (address, reason) pairs said; past that, further ones are not shown


@dataclass
class _Pending:
    """A connection that has not finished the handshake."""

    sock: socket.socket
    address: str
    nonce: bytes
    deadline: float
    answer: bytearray = field(default_factory=bytearray)


@dataclass
class _Drops:
    """The connections dropped from one address for one reason, not said yet."""

    count: int = 0
    said_at: float | None = None


def address_key(ip: str) -> str:
    """The unit a cap counts: the address, or its /64 for IPv6 (one host's, commonly)."""
    try:
        addr = ipaddress.ip_address(ip.removeprefix("::ffff:"))
    except ValueError:
        return ip
    if addr.version == 6:
        return str(ipaddress.ip_network(f"{addr}/64", strict=False))
    return str(addr)


class RelayServer:
    """The rendezvous host's relay on ``address``, in front of the store at
    ``127.0.0.1:store_port``: every handshake served in one selector thread as its bytes arrive,
    within ``handshake_timeout`` seconds in all; at most ``per_address`` unfinished ones from one
    address and ``pending`` in all, past which the oldest of the address holding the most is
    evicted; every dropped connection said, once per address and reason, then counted."""

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
        """``evict=False`` turns a connection beyond ``pending`` away (a test's control)."""
        self._store_port, self._key, self._timeout = store_port, key, handshake_timeout
        self._per_address, self._log_interval = per_address, log_interval
        self._cap, self._evict = pending, evict
        self._pending: dict[socket.socket, _Pending] = {}
        self._per: Counter[str] = Counter()
        self._drops: dict[tuple[str, str], _Drops] = {}
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
        """Stop listening and drop the unfinished handshakes (admitted peers stay)."""
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
                    self._forget(pending)
                    why = f"no complete handshake within {self._timeout:g} s (slow or silent)"
                    self._note(pending.address, why)  # said before the peer sees the close
                    pending.sock.close()
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
            except OSError:  # out of descriptors: the deadlines free some; no spin meanwhile
                time.sleep(0.05)
                return
            where = address_key(peer[0])
            if self._per[where] >= self._per_address:
                self._turn_away(conn, where, BUSY_ADDRESS, "too many unfinished handshakes at once")
                continue
            if len(self._pending) >= self._cap:
                full = f"{self._cap} unfinished handshakes of all addresses"
                if not self._evict:
                    self._turn_away(conn, where, BUSY_FULL, full)
                    continue
                victim = self._victim()
                self._forget(victim)
                self._note(victim.address, f"evicted: {full}")
                refuse(victim.sock, EVICTED)
            nonce = secrets.token_bytes(_NONCE)
            conn.setblocking(False)
            try:
                conn.send(HELLO + nonce)  # a fresh connection's buffer holds these few bytes whole
            except OSError:
                conn.close()
                continue
            pending = _Pending(conn, where, nonce, time.monotonic() + self._timeout)
            self._pending[conn] = pending
            self._per[where] += 1
            self._selector.register(conn, selectors.EVENT_READ)

    def _victim(self) -> _Pending:
        """The handshake to evict when all addresses together hold the cap: the oldest of the
        address holding the most, so a node that holds one is never evicted while any holds
        two."""
        heaviest = max(self._per.values())
        return next(p for p in self._pending.values() if self._per[p.address] == heaviest)

    def _turn_away(self, conn: socket.socket, where: str, words: bytes, reason: str) -> None:
        """Close a fresh connection with the words its node says (it sent nothing: no reset)."""
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
            if pending.answer:  # something, not a proof: a client of another protocol
                self._refuse(pending)
            else:  # a port probe, or a reset
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
        args = (pending.sock, proof, session)
        threading.Thread(target=self._connect, args=args, daemon=True, name="ddpkit-relay").start()

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

    def _forget(self, pending: _Pending) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(pending.sock)
        if self._pending.pop(pending.sock, None) is not None:
            self._per[pending.address] -= 1
            if not self._per[pending.address]:
                del self._per[pending.address]

    def _note(self, where: str, reason: str, refused: bool = False) -> None:
        """Say a dropped connection: at once per address and reason, then counted."""
        drops = self._drops.get((where, reason))
        if drops is None:
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
