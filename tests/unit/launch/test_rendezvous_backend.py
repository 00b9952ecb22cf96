"""The rendezvous of ``ddpkit run``: a forged state is never unpickled, the relay admits only the
job's secret.

Real TCPStores and sockets on 127.0.0.1, torch's own rendezvous handler on top; the same attack on
torch's c10d backend is the control. Across network namespaces, end to end:
``tests/test_multinode.py``.
"""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import socket
import stat
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from ddpkit._errors import ConfigError
from ddpkit._internals.store import serve_store
from ddpkit._launch.rendezvous.auth import (
    BUSY_ADDRESS,
    PER_ADDRESS,
    SECRET_ENV,
    FramedSocket,
    RelayClient,
    RelayServer,
    Session,
    check_host,
    derive,
    join_host,
    load_secret,
)
from ddpkit._launch.rendezvous.backend import SignedStateBackend, WorkersStoreHandler

SECRET = b"0123456789abcdef0123456789abcdef"


class FileMaker:
    """Unpickled, creates ``path``: a stand-in for any code an attacker would run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _loopback_store() -> dist.TCPStore:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    return serve_store(listener.detach(), "127.0.0.1", port, timedelta(seconds=10))


def _params(store: dist.TCPStore) -> RendezvousParameters:
    return RendezvousParameters(
        backend="any",
        endpoint=f"127.0.0.1:{store.port}",
        run_id="job",
        min_nodes=1,
        max_nodes=1,
        join_timeout=10,
        last_call_timeout=1,
    )


def _forge(store: dist.TCPStore, marker: Path) -> bytes:
    """What an attacker who reaches the store writes: a pickle under the key of the rendezvous
    state."""
    value = base64.b64encode(pickle.dumps(FileMaker(marker)))
    store.set("torch.rendezvous.job", value)
    return value


def _signed(store: dist.TCPStore, secret: bytes = SECRET) -> SignedStateBackend:
    return SignedStateBackend(store, "job", derive(secret, "state"))


def test_a_forged_rendezvous_state_is_never_unpickled_and_the_rendezvous_goes_on(tmp_path, capfd):
    store = _loopback_store()
    backend = _signed(store)
    agent = create_handler(store, backend, _params(store))
    try:
        info = agent.next_rendezvous()  # a real round: the state now holds this node as rank 0
        assert (info.rank, info.world_size) == (0, 1)
        valid = store.get("torch.rendezvous.job")
        forged = _forge(store, tmp_path / "pwned")
        # What the agent's state holder calls on its next sync (it serves reads from a cache for a
        # second).
        state, token = backend.get_state()
        assert "ignored a rendezvous state without this job's signature" in capfd.readouterr().err
        assert not (tmp_path / "pwned").exists()
        # the valid state, put back
        assert store.get("torch.rendezvous.job") == token == valid != forged
        assert type(pickle.loads(state)).__name__ == "_RendezvousState"
        # Another agent, which has read no state yet, through torch's handler: nothing runs either.
        forged = _forge(store, tmp_path / "pwned2")
        assert create_handler(store, _signed(store), _params(store)).num_nodes_waiting() == 0
        assert not (tmp_path / "pwned2").exists()
        # A state signed with another job's key is no better than none.
        other = _signed(_loopback_store(), b"another secret, of another job")
        store.set("torch.rendezvous.job", other._seal(pickle.dumps(FileMaker(tmp_path / "pwned3"))))
        assert create_handler(store, _signed(store), _params(store)).num_nodes_waiting() == 0
        assert not (tmp_path / "pwned3").exists()
        # The rendezvous goes on: the first agent closes it, and a new reader sees it closed.
        agent.set_closed()
        assert create_handler(store, _signed(store), _params(store)).is_closed()
    finally:
        agent.shutdown()


def test_control_the_same_forgery_runs_code_under_torchs_c10d_backend(tmp_path):
    store = _loopback_store()
    agent = create_handler(store, C10dRendezvousBackend(store, "job"), _params(store))
    assert agent.next_rendezvous().world_size == 1
    _forge(store, tmp_path / "pwned")
    handler = create_handler(store, C10dRendezvousBackend(store, "job"), _params(store))
    with pytest.raises(Exception):  # noqa: B017 - the unpickled object is a file, not a state: torch fails after the fact
        handler.num_nodes_waiting()
    assert (tmp_path / "pwned").exists()


def _listening(port: int) -> bool:
    with contextlib.closing(socket.socket()) as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_the_workers_store_is_bound_before_its_port_is_published_and_new_each_round():
    store = _loopback_store()
    handler = WorkersStoreHandler(
        create_handler(store, _signed(store), _params(store)), "127.0.0.1", store
    )
    try:
        first = handler.next_rendezvous().bootstrap_store_info
        # Listening when the agent learns the port: no window for another program to take it.
        assert first.master_addr == "127.0.0.1" and _listening(first.master_port)
        client = dist.TCPStore(
            "127.0.0.1", first.master_port, is_master=False, timeout=timedelta(seconds=10)
        )
        client.set("rank 3's address", "a worker of the first attempt")
        second = handler.next_rendezvous().bootstrap_store_info  # a restart's round
        assert second.master_port != first.master_port and _listening(second.master_port)
        assert not _listening(first.master_port)  # the first attempt's store has ended
        client = dist.TCPStore(
            "127.0.0.1", second.master_port, is_master=False, timeout=timedelta(seconds=10)
        )
        assert not client.check(["rank 3's address"])  # no key of the attempt before
    finally:
        handler.shutdown()
    assert not _listening(second.master_port)


def test_a_local_addr_not_of_this_node_is_named_when_the_workers_store_cannot_bind():
    store = _loopback_store()
    # 192.0.2.1: TEST-NET-1, never an address of this machine
    handler = WorkersStoreHandler(
        create_handler(store, _signed(store), _params(store)), "192.0.2.1", store
    )
    try:
        with pytest.raises(ConfigError, match="--local-addr must be an address of this node"):
            handler.next_rendezvous()
    finally:
        handler.shutdown()


def test_control_torchs_rendezvous_publishes_a_port_nobody_holds(monkeypatch):
    # What rank 0's worker had to bind seconds later, after the agent had started every worker.
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    store = _loopback_store()
    handler = create_handler(store, _signed(store), _params(store))
    try:
        published = handler.next_rendezvous().bootstrap_store_info.master_port
        assert not _listening(published)
    finally:
        handler.shutdown()


@pytest.fixture
def relay():
    """(store, relay server in front of it): the rendezvous host's side, on 127.0.0.1."""
    store = _loopback_store()
    server = RelayServer(("127.0.0.1", 0), store.port, derive(SECRET, "relay"))
    yield store, server
    server.close()


def test_a_node_with_the_secret_reaches_the_store_through_the_relay(relay):
    store, server = relay
    local = RelayClient(server.address, derive(SECRET, "relay"))
    try:
        client = dist.TCPStore(
            "127.0.0.1", local.port, is_master=False, timeout=timedelta(seconds=10)
        )
        client.set("from-node", "1")
        assert store.get("from-node") == b"1"
        assert client.compare_set("from-node", "1", "2") == b"2"
        # the launcher's check before any worker starts
        check_host(server.address, derive(SECRET, "relay"))
    finally:
        local.close()


def test_a_peer_without_the_secret_is_refused_before_it_reaches_the_store(relay, capfd):
    store, server = relay
    with pytest.raises(ConfigError, match="did not admit this node"):
        check_host(server.address, derive(b"not the secret of this job at all", "relay"))
    # A plain store client (torchrun's agent, or anyone) at the relay's port: refused, nothing
    # written.
    with pytest.raises((RuntimeError, dist.DistError)):
        outsider = dist.TCPStore(
            "127.0.0.1", server.address[1], is_master=False, timeout=timedelta(seconds=1)
        )
        outsider.set("torch.rendezvous.job", b"anything")
    assert not store.check(["torch.rendezvous.job"])
    assert "refused a connection to the rendezvous from 127.0.0.1" in capfd.readouterr().err


def test_a_frame_altered_on_the_way_ends_the_connection(relay):
    store, server = relay
    with socket.create_connection(server.address) as sock:
        session = join_host(sock, derive(SECRET, "relay"))  # a genuine session...
        forged = Session(send_key=derive(b"an on-path attacker", "x"), recv_key=session.recv_key)
        # ...and a frame not made with its key
        FramedSocket(sock, forged).send(b"bytes injected into it")
        sock.settimeout(10)
        assert sock.recv(1) == b""  # closed by the relay


def test_the_local_end_of_the_relay_serves_its_own_process_only(relay):
    _, server = relay
    local = RelayClient(server.address, derive(SECRET, "relay"))
    try:
        # Another process of this machine (another user) connects to the node's local port: closed
        # unanswered.
        code = (
            "import socket, sys; s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); "
            "s.settimeout(10); print(repr(s.recv(64)))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(local.port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.stdout.strip() == "b''", out.stderr
        # Control: from this process, the same port leads to the store.
        client = dist.TCPStore(
            "127.0.0.1", local.port, is_master=False, timeout=timedelta(seconds=10)
        )
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        local.close()


def test_the_secret_comes_from_a_private_file_or_the_environment(tmp_path):
    with pytest.raises(ConfigError, match=f"export {SECRET_ENV}="):
        load_secret(None, {})
    with pytest.raises(ConfigError, match="too few to resist guessing"):
        load_secret(None, {SECRET_ENV: "short"})
    assert load_secret(None, {SECRET_ENV: SECRET.decode() + "\n"}) == SECRET
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="can be read by other users .* chmod 600"):
        load_secret(str(path), {})
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    assert load_secret(str(path), {SECRET_ENV: "ignored, the file wins"}) == SECRET
    with pytest.raises(ConfigError, match="No such file"):
        load_secret(str(tmp_path / "missing"), {})


def _from(ip: str, server: RelayServer) -> socket.socket:
    """A connection to the relay from ``ip``, a loopback address other than the node's (127/8 is all
    loopback)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((ip, 0))
    sock.connect(server.address)
    return sock


def test_a_genuine_node_joins_while_another_address_holds_64_slow_silent_or_garbage_connections(
    capfd,
):
    """Connections from 127.0.0.2 that never finish the handshake hold none of the room a node
    needs: the node is admitted at once, the host names the address, and a slow peer is dropped at
    the handshake's deadline although it keeps sending a byte now and then."""
    store = _loopback_store()
    server = RelayServer(
        ("127.0.0.1", 0), store.port, derive(SECRET, "relay"), handshake_timeout=3.0
    )
    stop = threading.Event()
    hostile = [_from("127.0.0.2", server) for _ in range(64)]
    slow, garbage = hostile[0::3], hostile[1::3]  # the rest are silent
    for sock in garbage:
        # fewer bytes than a proof: the relay waits for the rest
        sock.sendall(b"GET / HTTP/1.0\r\n")

    def drip() -> None:  # one byte per second from every slow peer: under the deadline of each read
        while not stop.wait(1.0):
            for sock in slow:
                with contextlib.suppress(OSError):
                    sock.send(b"x")

    dripping = threading.Thread(target=drip, daemon=True)
    dripping.start()
    local = RelayClient(server.address, derive(SECRET, "relay"))
    try:
        check_host(server.address, derive(SECRET, "relay"))  # the launcher's own check
        client = dist.TCPStore(
            "127.0.0.1", local.port, is_master=False, timeout=timedelta(seconds=10)
        )
        client.set("from-node", "1")
        assert store.get("from-node") == b"1"
        err = capfd.readouterr().err
        assert "from 127.0.0.2" in err and "too many unfinished handshakes" in err, err
        # served while every hostile peer is still held: not queued behind their deadline
        assert "no complete handshake" not in err, err
        # The slow peers, still sending, are dropped at the deadline of the whole handshake.
        for sock in slow[:PER_ADDRESS]:
            sock.settimeout(10)
            with contextlib.suppress(ConnectionResetError):
                while sock.recv(4096):
                    pass
        assert (
            "dropped a connection to the rendezvous from 127.0.0.2: no complete handshake within 3 "
            "s" in (capfd.readouterr().err)
        )
    finally:
        stop.set()
        dripping.join()
        local.close()
        server.close()
        for sock in hostile:
            sock.close()


def test_dropped_connections_are_said_once_per_address_then_counted(capfd):
    store = _loopback_store()
    server = RelayServer(
        ("127.0.0.1", 0), store.port, derive(SECRET, "relay"), per_address=1, log_interval=3600
    )
    # the first holds the one slot, 4 are dropped
    held = [_from("127.0.0.3", server) for _ in range(5)]
    try:
        # The second address is said at once as well; its proof has the wrong secret.
        with pytest.raises(ConfigError, match="did not admit this node"):
            check_host(server.address, derive(b"not the secret of this job at all", "relay"))
        for sock in held[1:]:
            sock.settimeout(10)
            assert sock.recv(64) == BUSY_ADDRESS  # told why, and closed at once
            assert sock.recv(64) == b""
        check_host(server.address, derive(SECRET, "relay"))  # the room of 127.0.0.1 is its own
        err = capfd.readouterr().err
        lines = [line for line in err.splitlines() if "127.0.0.3" in line]
        assert (
            len(lines) == 1 and "dropped a connection to the rendezvous from 127.0.0.3" in lines[0]
        ), lines
        assert (
            "refused a connection to the rendezvous from 127.0.0.1: it does not hold the job's "
            "secret" in err
        )
    finally:
        server.close()
        for sock in held:
            sock.close()


def test_drops_from_ever_new_addresses_keep_a_bounded_record_and_are_said_once(capfd, monkeypatch):
    # A host flooded from many addresses (a scan) keeps no record past the first few hundred: said
    # once, then nothing more is kept or printed. Pure bookkeeping: the relay's record is fed
    # directly.
    from ddpkit._launch.rendezvous import auth as relay_module

    monkeypatch.setattr(relay_module, "_LOGGED_ADDRESSES", 4)
    store = _loopback_store()
    server = RelayServer(("127.0.0.1", 0), store.port, derive(SECRET, "relay"), log_interval=3600)
    try:
        for i in range(50):
            server._note(f"127.0.1.{i}", "it sent garbage")
        assert len(server._drops) == 4
        err = capfd.readouterr().err
        assert err.count("dropped a connection to the rendezvous from") == 4
        assert err.count("from further addresses too (not shown)") == 1
    finally:
        server.close()
