"""Letting only a job's own nodes into its rendezvous: the job's secret, and a relay that checks it.

torch's c10d rendezvous store is a TCPStore that accepts any connection and has no notion of a
client's identity, and torch unpickles the rendezvous state it reads from it: anyone who reached the
endpoint could write a value that ran code in every agent. Under ``ddpkit run`` the store listens on
127.0.0.1 only. Other nodes reach it through a relay on the endpoint's port
(:mod:`ddpkit._launch.rendezvous.relay`) which, before one byte of the peer's reaches the store, has
the peer prove that it holds the job's secret (an HMAC-SHA256 challenge-response with fresh nonces
on both sides, so that the host proves it too), and then carries the store's traffic in frames that
each bear an HMAC under a key of that session, so that bytes altered or injected on the way end the
connection. On the other nodes the agent's store client talks to a local end of the relay
(:class:`RelayClient`), which admits connections from its own process only. Nothing is encrypted:
the rendezvous state holds addresses, not data.

Written here because the standard library has nothing that fits: TLS with a pre-shared key needs
Python 3.13, and ``multiprocessing.connection``'s authkey handshake uses HMAC-MD5 before Python 3.12
and hands over a connection whose ``recv()`` unpickles.
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

from ddpkit._errors import ConfigError

SECRET_ENV = "DDPKIT_RDZV_SECRET"
"""Environment variable holding the job's secret, the same on every node (or
``--rdzv-secret-file``)."""
SECRET_FILE_ENV = "DDPKIT_RDZV_SECRET_FILE"
"""The default of ``--rdzv-secret-file``: where a container finds a mounted secret (a Kubernetes
Secret volume, ``defaultMode: 0440`` with the pod's ``fsGroup``, as ``ddpkit k8s`` writes it)."""
MIN_SECRET_CHARS = 32
MAKE_SECRET = "python -c 'import secrets; print(secrets.token_hex(32))'"

HELLO = b"ddpkit rendezvous relay 1\n"
_NONCE = 32
_TAG = 32  # HMAC-SHA256
_REFUSED = b"refused: not this job's secret".ljust(_TAG, b"\n")
EVICTED = b"evicted: the relay is full".ljust(_TAG, b"\n")
"""The relay's last words to a peer whose unfinished handshake it evicted (in place of its
proof)."""
BUSY = b"ddpkit rendezvous relay busy: "
BUSY_ADDRESS = BUSY + b"address\n"
"""The relay's only words to a connection beyond its unfinished handshakes from one address (in
place of ``HELLO``)."""
BUSY_FULL = BUSY + b"full\n"
"""... beyond its unfinished handshakes of all addresses (a relay that does not evict)."""
_BUSY_WORDS = {
    BUSY_ADDRESS: "its relay already holds as many unfinished handshakes from this node's address "
    "as it takes",
    BUSY_FULL: "its relay is full of unfinished handshakes from other addresses",
}
_MAX_FRAME = 1 << 20  # the relay writes at most 64 KiB per frame; anything larger is not ours
HANDSHAKE_TIMEOUT = 10.0
"""Seconds a peer has, from its connection, to finish the whole handshake before the relay drops
it."""
ANSWER = _NONCE + _TAG
"""Bytes a node sends the relay in the handshake: its nonce and its proof."""


def load_secret(path: str | None, env: Mapping[str, str] | None = None) -> bytes:
    """The job's secret from ``path`` (``--rdzv-secret-file``, else :data:`SECRET_FILE_ENV`), else
    from :data:`SECRET_ENV`.

    A file that other users can read is refused, as ssh refuses such a key; so is a secret too short
    to resist guessing. Raises :class:`ConfigError` saying how to make one.
    """
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
        # bytes the locale could not decode, kept as surrogates by Python
        except UnicodeEncodeError:
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
    """Whether ``path`` (opened, ``info`` its fstat) is a key of a Kubernetes Secret volume, mounted
    for this pod's ``fsGroup``, exactly as the kubelet lays it out: ``path`` a link to
    ``..data/<name>``, ``..data`` a link to a folder ``..<timestamp>`` beside it that holds the
    file, owned by root, mode 0440, its group one of this process's groups (the ``fsGroup``, which
    the kubelet gives to the pod's containers only).

    Group-readable is private there: only the pod's containers are in that group, and the kubelet
    writes the volume, so no user of the container put a copy there. Any other group-readable file
    stays refused, and so does a world-readable one (``defaultMode: 0444``)."""
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
    """(the stripped contents, the status) of the regular file at ``path``.

    Opened without blocking and checked to be a regular file before any read: a FIFO would block the
    launch forever waiting for a writer, and a device could be read without end.
    """
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
    """A key for one use of the secret, so that a tag made for one use is worth nothing in
    another."""
    return hmac.new(secret, b"ddpkit rendezvous: " + purpose.encode(), hashlib.sha256).digest()


def _tag(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_upto(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes, or fewer where the other end closed first."""
    try:
        return _recv_exact(sock, n)
    except EOFError as err:
        return err.args[1]


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


def greeting() -> tuple[bytes, bytes]:
    """(the relay's nonce, the first bytes it sends a peer)."""
    ours = secrets.token_bytes(_NONCE)
    return ours, HELLO + ours


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
    """Tell a peer that failed the handshake so (a node with another secret then says what is
    wrong), or that its handshake was evicted (:data:`EVICTED`), and close."""
    with contextlib.suppress(OSError):
        sock.sendall(words)
    sock.close()


def join_host(sock: socket.socket, key: bytes) -> Session:
    """A node's side of the handshake; raises :class:`Refused` or :class:`NotARelay` naming what
    went wrong."""
    hello = _recv_upto(sock, len(HELLO) + _NONCE)
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
    """A socket whose every message bears an HMAC over its sequence number and bytes (no replay, no
    reorder).

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


def splice(framed: FramedSocket, plain: socket.socket) -> None:
    """Carry bytes both ways between ``plain`` and ``framed`` on two threads; when one way ends,
    close both."""
    # A store request is several small writes; with Nagle's algorithm each relayed piece waits for
    # the ACK of the one before (a round trip through the relay took 12 ms instead of 0.1 ms).
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
        # Refused is an OSError: a bad frame ends the connection
        with contextlib.suppress(OSError, EOFError):
            while True:
                plain.sendall(framed.recv())
        close()

    for target in (outward, inward):
        threading.Thread(target=target, daemon=True, name="ddpkit-relay").start()


def say(message: str) -> None:
    print(f"ddpkit run: {message}", file=sys.stderr, flush=True)


def _from_this_process(peer: tuple[str, int]) -> bool:
    """True when the local TCP connection from ``peer`` was opened by a socket of this very
    process."""
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
    """A node's local end of the relay: a port on 127.0.0.1 for this process's store client, whose
    traffic it carries to the rendezvous host after the handshake. Connections from other processes
    (another user of this machine) are closed unanswered."""

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
    """Handshake once with the rendezvous host, so that a wrong secret is one clear error before any
    worker."""
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
