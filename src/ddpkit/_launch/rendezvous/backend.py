"""The rendezvous ``ddpkit run`` gives torchrun's agent (``--rdzv-backend ddpkit``): torch's dynamic
rendezvous on a store served on 127.0.0.1, reached across nodes through the relay, its state
HMAC-tagged (:class:`SignedStateBackend`)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as handler_registry
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousInfo,
    RendezvousStateError,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    Token,
    create_handler,
)

from ddpkit._errors import ConfigError
from ddpkit._internals.store import serve_new_store
from ddpkit._launch import say
from ddpkit._launch.rendezvous.auth import RelayClient, RelayServer, derive
from ddpkit._launch.rendezvous.link import NodeLink

BACKEND = "ddpkit"


@dataclass(frozen=True)
class JobAccess:
    """What one job's agent needs to open its store; never in torchrun's arguments or logs."""

    secret: bytes  # the job's secret (several nodes), or random bytes of this job (one node)
    relay_ip: str | None  # where the host's relay listens; None for a job on this machine only


@dataclass
class Joined:
    """A lost node's place taken by a new node (in-place recovery): node ``node`` of ``nodes`` of
    round ``round_name``, the recovery's ``go`` record, and this node's link to the others (beating
    since its claim)."""

    node: int
    nodes: int
    round_name: str
    go: dict[str, Any]
    link: NodeLink


class InPlaceRendezvous(Protocol):
    """What the rendezvous asks of in-place recovery
    (:class:`~ddpkit._launch.recover.inplace.InPlace`)."""

    def take_place(self, base: Any, addr: str) -> Joined | None:
        """A lost node's place in the job, taken by this new node, or None: torch's rendezvous
        follows."""

    def recovering(self) -> bool:
        """Whether a recovery is under way on this node."""

    def left_job(self) -> bool:
        """Whether this node left the job while it goes on (counted lost and replaced)."""


_jobs: dict[str, JobAccess] = {}  # rendezvous id -> access, for the jobs this process runs
_in_place: dict[str, InPlaceRendezvous] = {}  # rendezvous id -> the job's, where it has one
_relays: dict[str, list[Any]] = {}


def register(run_id: str, access: JobAccess, in_place: InPlaceRendezvous | None = None) -> None:
    """Make ``--rdzv-backend ddpkit --rdzv-id RUN_ID`` open its store with ``access``; with
    ``in_place``, a node starting while a node's place is open takes it."""
    handler_registry.register(BACKEND, _create_handler)
    _jobs[run_id] = access
    if in_place is not None:
        _in_place[run_id] = in_place


def unregister(run_id: str) -> None:
    _jobs.pop(run_id, None)
    _in_place.pop(run_id, None)
    for relay in _relays.pop(run_id, []):
        relay.close()


def _create_handler(params: RendezvousParameters) -> Any:  # a RendezvousHandler in all but name
    access = _jobs.get(params.run_id)
    if access is None:
        raise RendezvousConnectionError(
            f"no access registered for rendezvous {params.run_id!r} in this process"
        )
    store = _open_store(params, access)
    backend = SignedStateBackend(store, params.run_id, derive(access.secret, "state"))
    handler = create_handler(store, backend, params)
    in_place = _in_place.get(params.run_id)
    return WorkersStoreHandler(handler, params.local_addr, store, in_place, params.max_nodes)


class WorkersStoreHandler:
    """torch's dynamic rendezvous, whose node of rank 0 also serves, new at every round, the store
    the workers meet in (``MASTER_ADDR:MASTER_PORT``), on its address alone, on a socket bound
    before its port is published (torch publishes a free port that another program may take).
    Each round's keys go under a name of ddpkit's (:attr:`round_name`), which a node taking a lost
    node's place in a job that recovers in place (``in_place``) is given (``recover.join``).
    Every other attribute is the rendezvous's own."""

    _KEY = "ddpkit/workers_store"

    def __init__(
        self,
        inner: RendezvousHandler,
        local_addr: str | None,
        base: Any,
        in_place: InPlaceRendezvous | None = None,
        max_nodes: int = 1,
    ) -> None:
        self._inner = inner
        self.addr = local_addr or socket.getfqdn()  # the address torch gives this node
        self.base = base  # the job's store, outside any round
        self.round_name = ""
        self._in_place = in_place
        self._rounds = 0
        self._member = False  # this node joined a round, or took a lost node's place
        self._max_nodes = max_nodes
        self._size = 0  # the nodes of the job's round, as this node knows it
        self._store: Any = None

    def next_rendezvous(self) -> RendezvousInfo:
        self._rounds += 1
        if self._in_place is not None and self._rounds == 1:
            joined = self._in_place.take_place(self.base, self.addr)
            if joined is not None:
                self.round_name, self._member = joined.round_name, True
                self._size = joined.nodes
                go = joined.go
                master = RendezvousStoreInfo(go["master_addr"], go["master_port"])
                round_store = dist.PrefixStore(joined.round_name, self.base)
                return RendezvousInfo(round_store, joined.node, joined.nodes, master)
        info = self._inner.next_rendezvous()
        self._member, self._size = True, info.world_size
        store = info.store  # this round's keys only
        old, self._store = self._store, None  # the last round's store ends once the new one serves
        if info.rank == 0:
            try:
                self._store, port = serve_new_store(self.addr, timedelta(minutes=5))
            except OSError as err:
                raise ConfigError(
                    f"cannot serve the workers' store on {self.addr} ({err.strerror}): "
                    "--local-addr must be an address of this node"
                ) from None
            store.set(self._KEY, f"{port} {self.addr} {secrets.token_hex(8)}")
        del old
        served, addr, token = store.get(self._KEY).decode().split(" ", 2)
        self.round_name = f"ddpkit/round/{token}"
        master = RendezvousStoreInfo(master_addr=addr, master_port=int(served))
        store = dist.PrefixStore(self.round_name, self.base)
        return RendezvousInfo(store, info.rank, info.world_size, master)

    def nodes_waiting(self) -> int:
        """Nodes waiting in torch's rendezvous for the next round."""
        return int(self._inner.num_nodes_waiting())

    def num_nodes_waiting(self) -> int:
        # Recovering in place, a node waiting for the next round waits on while a failure is
        # recovered (torch would restart every worker in the middle of it), and while the job runs
        # on all its nodes: a lost node's place is taken in place, and torch's count of the
        # round's nodes (a lost one still in it until its keep-alive expires, its new one not)
        # would restart the job to take in a node it has no place for.
        if self._in_place is not None and (
            self._in_place.recovering() or self._size >= self._max_nodes
        ):
            return 0
        return self.nodes_waiting()

    use_agent_store = True  # every worker is a client of the store above, rank 0 too

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def shutdown(self) -> bool:
        self._store = None
        if not self._member or (self._in_place is not None and self._in_place.left_job()):
            # not of the job (refused a place) or replaced: the job goes on without this node,
            # and torch's shutdown would close the rendezvous to every node
            return True
        return self._inner.shutdown()


def _open_store(params: RendezvousParameters, access: JobAccess) -> dist.TCPStore:
    host, _, port_text = params.endpoint.rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    relays = _relays.setdefault(params.run_id, [])
    if access.relay_ip is None or params.get_as_bool("is_host", True):
        store, local_port = serve_new_store("127.0.0.1", timeout)
        if access.relay_ip is not None:
            try:
                relays.append(
                    RelayServer((access.relay_ip, port), local_port, derive(access.secret, "relay"))
                )
            except OSError as err:
                raise RendezvousConnectionError(
                    f"cannot listen on {access.relay_ip}:{port}: {err.strerror}"
                ) from None
        return store
    client = RelayClient((socket.gethostbyname(host), port), derive(access.secret, "relay"))
    relays.append(client)
    return dist.TCPStore("127.0.0.1", client.port, is_master=False, timeout=timeout)


class SignedStateBackend(RendezvousBackend):
    """torch's rendezvous state, stored with an HMAC tag and returned only when the tag matches
    (torch unpickles what a backend returns). A value whose tag does not match is replaced, by
    compare-and-set, with the last state this node read with a valid one, and the rendezvous goes
    on."""

    _EMPTY = b"-"  # the key's value before any state: a read blocks on a missing key
    _RESTORES = 20

    def __init__(self, store: dist.Store, run_id: str, key: bytes) -> None:
        self._store, self._key = store, key
        self._name = "torch.rendezvous." + run_id  # the key torch's c10d backend uses
        self._context = run_id.encode() + b"\0"  # a state signed for another job is not valid
        self._last_valid = self._EMPTY
        self._warned = False
        self._call("compare_set", self._name, "", self._EMPTY)

    @property
    def name(self) -> str:
        return BACKEND

    def get_state(self) -> tuple[bytes, Token] | None:
        return self._open(self._call("get", self._name))

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, bytes):
            current = self.get_state()
            return (*current, False) if current is not None else None
        sealed = self._seal(state)
        current = self._open(self._call("compare_set", self._name, token or self._EMPTY, sealed))
        if current is None and token is not None:
            # emptied (a forged value replaced): torch would take None for "written"
            current = self._open(self._call("compare_set", self._name, self._EMPTY, sealed))
        if current is None:
            return None
        return current[0], current[1], current[0] == state

    def _seal(self, state: bytes) -> bytes:
        tag = hmac.new(self._key, self._context + state, hashlib.sha256).hexdigest().encode()
        return tag + b":" + base64.b64encode(state)

    def _verify(self, stored: bytes) -> bytes | None:
        tag, sep, body = stored.partition(b":")
        if not sep:
            return None
        try:
            state = base64.b64decode(body, validate=True)
        except binascii.Error:
            return None
        expected = hmac.new(self._key, self._context + state, hashlib.sha256).hexdigest().encode()
        return state if hmac.compare_digest(tag, expected) else None

    def _open(self, stored: bytes) -> tuple[bytes, Token] | None:
        for _ in range(self._RESTORES):
            if stored == self._EMPTY:
                self._last_valid = stored
                return None
            state = self._verify(stored)
            if state is not None:
                self._last_valid = stored
                return state, stored
            if not self._warned:
                self._warned = True
                say(
                    "ignored a rendezvous state without this job's signature (written by a process "
                    "outside the job) and put back the last valid one"
                )
            stored = self._call("compare_set", self._name, stored, self._last_valid)
        raise RendezvousStateError(
            "the rendezvous state keeps being overwritten by a process outside the job"
        )

    def _call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as err:
            raise RendezvousConnectionError(
                f"the connection to the rendezvous store failed: {err}"
            ) from err
