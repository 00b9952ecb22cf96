"""The relay's cap on unfinished handshakes of all addresses, filled with silent connections from
many addresses on loopback (127/8 is all loopback, so each 127.0.1.x is an address of its own): a
node that answers at once still gets through, and a node turned away is told why."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from ddpkit._errors import ConfigError
from ddpkit._launch.rendezvous.auth import (
    BUSY_FULL,
    EVICTED,
    HELLO,
    PENDING,
    PER_ADDRESS,
    Busy,
    RelayServer,
    check_host,
    derive,
    join_host,
)

KEY = derive(b"0123456789abcdef0123456789abcdef", "relay")
ADDRESSES = PENDING // PER_ADDRESS + 1  # 65 addresses of 8 connections: more than the cap holds


def _silent(ip: str, server: RelayServer) -> tuple[socket.socket, bytes]:
    """A connection from ``ip`` that never answers, and the relay's first words to it (read before
    the next connection, so the relay has accepted each in turn: no wait, no race on the order)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.bind((ip, 0))
    sock.connect(server.address)
    return sock, sock.recv(len(HELLO) + 32)


@pytest.fixture
def flood() -> Iterator[list[socket.socket]]:
    held: list[socket.socket] = []
    yield held
    for sock in held:
        sock.close()


def _fill(server: RelayServer, held: list[socket.socket]) -> list[bytes]:
    firsts = []
    for i in range(ADDRESSES):
        for _ in range(PER_ADDRESS):
            sock, first = _silent(f"127.0.1.{i + 1}", server)
            held.append(sock)
            firsts.append(first)
    return firsts


def test_a_node_gets_through_a_relay_filled_by_silent_connections_from_65_addresses(flood, capfd):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=False)
    server = RelayServer(("127.0.0.1", 0), store.port, KEY, handshake_timeout=60.0)
    try:
        firsts = _fill(server, flood)
        # every one accepted: the cap holds 512 of 520
        assert all(first.startswith(HELLO) for first in firsts)
        # The 8 connections past the cap evicted the oldest handshake of an address holding the
        # most, the first of each of the first 8 addresses; each evicted peer is told so.
        for sock in flood[: PER_ADDRESS * PER_ADDRESS : PER_ADDRESS]:
            assert sock.recv(64) == EVICTED
        # A node starts its handshake, the flood reopens 64 connections meanwhile, then the node
        # answers: the reopened ones evict one another's addresses (8 each), never the node's single
        # handshake.
        node = socket.create_connection(server.address, timeout=30)
        hello = node.recv(len(HELLO) + 32, socket.MSG_PEEK)
        assert hello.startswith(HELLO)
        for i in range(64):
            sock, first = _silent(f"127.0.1.{i % ADDRESSES + 1}", server)
            flood.append(sock)
        join_host(node, KEY)
        node.close()
        check_host(server.address, KEY)  # the launcher's own check, from scratch
        err = capfd.readouterr().err
        assert "evicted: 512 unfinished handshakes of all addresses" in err, err
    finally:
        server.close()


def test_control_without_eviction_the_node_is_turned_away_and_told_the_relay_is_full(flood):
    # The relay before eviction: the cap filled by the flood keeps the node out for as long as it
    # lasts. The node's launcher names the relay being full, not "what listens is not `ddpkit run`".
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=False)
    server = RelayServer(("127.0.0.1", 0), store.port, KEY, handshake_timeout=60.0, evict=False)
    try:
        firsts = _fill(server, flood)
        assert firsts[PENDING:] == [BUSY_FULL] * (ADDRESSES * PER_ADDRESS - PENDING)
        with pytest.raises(
            ConfigError, match="turned this node away .*full of unfinished handshakes"
        ) as info:
            check_host(server.address, KEY)
        assert "not `ddpkit run`" not in str(info.value)
    finally:
        server.close()


def test_a_node_whose_handshake_is_evicted_says_so(flood):
    # A cap of 2 makes the node's own handshake the one evicted: its launcher says the words, not a
    # reset.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=False)
    server = RelayServer(("127.0.0.1", 0), store.port, KEY, handshake_timeout=60.0, pending=2)
    try:
        node = socket.create_connection(server.address, timeout=30)
        assert node.recv(len(HELLO) + 32, socket.MSG_PEEK).startswith(HELLO)
        for _ in range(2):  # the same address as the node's: the heaviest, oldest first
            flood.append(_silent("127.0.0.1", server)[0])
        with pytest.raises(Busy, match="evicted this node's"):
            join_host(node, KEY)
        node.close()
    finally:
        server.close()
