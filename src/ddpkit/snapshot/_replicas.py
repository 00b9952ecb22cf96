"""Copies of each rank's state in the memory of ranks on other nodes (``SnapshotConfig(
replicas=K)``, docs/snapshots.md, "Copies on other nodes"): which ranks hold whose
(:func:`place`), the files that hold them (:class:`ReplicaFiles`), their transfer beside training
(:class:`Courier`), and the transfers of a restore (:func:`exchange`). Layout, beside the node's
own slots (:mod:`ddpkit.snapshot._slots`)::

    <job folder>/memory/<run>-replica<p>-<i>.slot  rank p's copies 0 and 1 (on another node)

A copy is a slot: the rank's slot as it was committed (``zero``, ``fsdp``: its state is its own),
or a slot of its own part alone (``ddp``: its buffers and random streams; the rest is on every
rank). It counts once it arrived whole and its CRC-32C per block checked, its record written last.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit.distributed._collectives import tensor_bytes
from ddpkit.snapshot import _codec as codec
from ddpkit.snapshot import _slots as slots_lib

CHUNK = 1 << 26
"""Bytes of a copy sent in one message (gloo's messages are best kept well under 2 GiB)."""
CLOSE_WAIT = 5.0
"""Seconds :meth:`Courier.close` waits for a transfer in flight to end."""
_SIZE, _HEAD, _BODY = 1, 2, 3  # message tags


@dataclass(frozen=True)
class Placement:
    """Where each rank's copies go: ``partners[r]``, the ranks (one on each of the K-1 nodes after
    rank r's) that hold rank r's copies; ``copies``: K, the rank's own included."""

    copies: int
    partners: tuple[tuple[int, ...], ...]

    def sources(self, rank: int) -> list[int]:
        """The ranks whose copies ``rank`` holds."""
        return [p for p, held in enumerate(self.partners) if rank in held]


def place(nodes: Sequence[Any], wanted: int | None) -> tuple[Placement | None, str]:
    """The placement of K = ``wanted`` copies (None: 2 where the job spans nodes) for ranks whose
    nodes are ``nodes[r]`` (a key a node's ranks share), and a line to say where the copies are
    fewer than asked ("" where there is none to say). Rank r, the i-th of its node, has its copies
    on the i-th rank of each of the K-1 nodes after its own (nodes in the order of their first
    rank): losing any K-1 nodes leaves a whole copy of every rank's state. None where no copy
    leaves a node: one node, K = 1, or nodes of different sizes."""
    on: dict[Any, list[int]] = {}
    for rank, node in enumerate(nodes):
        on.setdefault(node, []).append(rank)
    groups, k = list(on.values()), 2 if wanted is None else wanted
    if k <= 1 or (wanted is None and len(groups) == 1):
        return None, ""
    if len(groups) == 1:
        return None, f"replicas={k}: the job runs on one node, and each rank's copy stays on it"
    if len({len(g) for g in groups}) > 1:
        return None, (
            f"replicas={k}: the nodes run {', '.join(str(len(g)) for g in groups)} ranks, and a "
            "copy goes to the rank of the same place on another node: give every node the same "
            "--nproc; each rank's copy stays on its node"
        )
    note = ""
    if k > len(groups):
        note = f"replicas={k} on {len(groups)} nodes: {len(groups)} copies of each rank's state"
        k = len(groups)
    partners: list[tuple[int, ...]] = [()] * len(nodes)
    for g, ranks in enumerate(groups):
        for i, rank in enumerate(ranks):
            partners[rank] = tuple(groups[(g + j) % len(groups)][i] for j in range(1, k))
    return Placement(k, tuple(partners)), note


# -- the copies this rank holds --------------------------------------------------------------------


@dataclass
class _Copy:
    """One file of copies of a rank's state on this node, mapped while its size lasts."""

    path: Path
    position: tuple[int, ...] | None = None  # of the whole copy it holds, None when not whole
    fd: int | None = None
    mapped: torch.Tensor | None = None

    def close(self) -> None:
        self.mapped = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@dataclass
class Arrival:
    """Where a copy of ``source`` lands: its header apart (written last), its other bytes in
    ``body`` (the mapped file; a buffer of the heap where the file could not be made)."""

    source: int
    head: torch.Tensor
    body: torch.Tensor
    copy: _Copy | None


class ReplicaFiles:
    """The copies this rank holds of its ``sources``' state: two files each, the older one
    overwritten, in the job's folder of snapshots in memory on this node."""

    def __init__(
        self, folder: Path, *, job: str, run: str, world_size: int, sources: Sequence[int]
    ) -> None:
        self.folder, self.job, self.run, self.world_size = folder, job, run, world_size
        self.copies = {
            p: [_Copy(folder / f"{run}-replica{p}-{i}.slot") for i in (0, 1)] for p in sources
        }
        self.full: str | None = None
        """Why a copy could not be kept (memory full), once that happened."""
        self.make_room: Callable[[int], bool] = lambda needed: False
        """Called where memory is full for a copy of ``needed`` bytes: True if room may have been
        made (the copy is tried once more)."""
        self._known: dict[int, dict[str, Any]] = {}  # each source's manifest last checked
        self.damaged: list[str] = []
        """What :meth:`found` last found wrong with whole copies it left out."""
        self.found()

    def found(self) -> dict[int, list[tuple[int, ...]]]:
        """The positions of the whole copies held, by source rank (read from their files)."""
        out: dict[int, list[tuple[int, ...]]] = {}
        self.damaged = []
        for p, copies in self.copies.items():
            for copy in copies:
                copy.position = None
                try:
                    got = slots_lib.read_slot(copy.path)
                except slots_lib.BadSlot as err:
                    self.damaged.append(str(err))
                    continue
                if got is not None and (where := self._position(got[2], p)) is not None:
                    copy.position = where
                    out.setdefault(p, []).append(where)
        return out

    def _position(self, values: dict[str, Any], source: int) -> tuple[int, ...] | None:
        """The position of a copy whose values are ``values``: None where they are another job's,
        run's, world's or rank's."""
        got = _identity(values, self.job, self.run)
        if got is None or got.rank != source or got.world_size != self.world_size:
            return None
        return got.position

    def arriving(self, source: int, size: int) -> Arrival:
        """The place of ``source``'s next copy, of ``size`` bytes: the file that holds no whole
        copy, else the older; made not whole first. Memory full: a buffer of the heap, the copy
        then dropped (:attr:`full` says why)."""
        copies = self.copies[source]
        copy = min(copies, key=lambda c: (c.position is not None, c.position or ()))
        head = torch.empty(slots_lib.HEADER, dtype=torch.uint8)
        for again in (False, True):
            if self.full is not None:
                break
            try:
                if copy.mapped is None or copy.mapped.numel() != size:
                    copy.close()
                    copy.fd, copy.mapped = slots_lib.map_file(copy.path, size, self.folder)
                else:  # not whole from here on
                    os.pwrite(copy.fd, bytes(slots_lib.HEADER), 0)  # type: ignore[arg-type]
                copy.position = None
                return Arrival(source, head, copy.mapped, copy)
            except slots_lib.MemoryFull as err:
                copy.close()
                if again or not self.make_room(err.needed):
                    self.full = str(err)
            except (slots_lib.MemoryUnavailable, OSError) as err:
                copy.close()
                self.full = str(err)
        scratch = torch.empty(max(size, slots_lib.HEADER), dtype=torch.uint8)
        return Arrival(source, head, scratch, None)

    def commit(self, arrival: Arrival) -> str | None:
        """Keep a copy that arrived whole: its layout and checksums checked, then its record
        written (``end`` last); else why not (the file stays not whole)."""
        copy = arrival.copy
        if copy is None or copy.fd is None:
            return None
        name = f"the copy of rank {arrival.source}'s state that arrived in {copy.path}"
        head = tensor_bytes(arrival.head)
        try:
            known = self._known.setdefault(arrival.source, {})
            _, _, values = slots_lib.arrived(head, arrival.body, name, known)
        except slots_lib.BadSlot as err:
            return str(err)
        position = self._position(values, arrival.source)
        if position is None:
            return f"{name}: its values are not rank {arrival.source}'s of this run"
        end = slots_lib.END_OFFSET
        os.pwrite(copy.fd, head[:end] + bytes(8) + head[end + 8 :], 0)  # whole once end is written
        os.pwrite(copy.fd, head[end : end + 8], end)
        copy.position = position
        return None

    def bytes_at(self, source: int, position: tuple[int, ...]) -> bytes | None:
        """The bytes of the whole copy of ``source``'s state at ``position``, None where none."""
        for copy in self.copies.get(source, []):
            if copy.position == position:
                return slots_lib.slot_bytes(copy.path)
        return None

    def discard_except(self, position: tuple[int, ...] | None) -> None:
        """Make every copy not whole but those at ``position``."""
        for copy in (c for copies in self.copies.values() for c in copies):
            if copy.position is not None and copy.position != position:
                slots_lib.unmake(copy.path)
                copy.position = None

    def close(self, remove: bool = False) -> None:
        for copy in (c for copies in self.copies.values() for c in copies):
            copy.close()
            if remove:
                with contextlib.suppress(OSError, ConfigError):
                    fs.remove(copy.path)


@dataclass(frozen=True)
class Held:
    """A whole copy of rank ``rank``'s state at ``position``, taken at ``world_size``, held in the
    file ``path`` on this node; ``own_part``: of its own part alone (``ddp``)."""

    path: Path
    rank: int
    world_size: int
    position: tuple[int, ...]
    own_part: bool = False


def _identity(values: dict[str, Any], job: str, run: str, path: Path = Path()) -> Held | None:
    """Whose copy a slot's ``values`` say it is, None where they are another job's or run's or do
    not say. A job's key is its run id and its folder on the node that wrote the slot: of a copy,
    the run id is compared (the folder it lies in is this job's)."""
    rank, size, position = values.get("rank"), values.get("world_size"), values.get("position")
    if values.get("run") != run or type(rank) is not int or type(size) is not int:
        return None
    if str(values.get("job")).rpartition(":")[0] != job.rpartition(":")[0]:
        return None
    if not (isinstance(position, list) and len(position) == 3 and 0 <= rank < size):
        return None
    if not all(type(p) is int for p in position) or position[1] != values.get("step"):
        return None
    return Held(path, rank, size, tuple(position), values.get("part") == "own")


def held_copies(folder: Path, job: str, run: str) -> tuple[list[Held], list[str]]:
    """Every whole copy of other ranks' states of ``run`` held in ``folder`` at any world size
    (a job restarted at another size keeps its old world's copies), and what is wrong with the
    whole ones left out."""
    out, damaged = [], []
    for path in sorted(folder.glob(f"{run}-replica*-*.slot")):
        try:
            got = slots_lib.read_slot(path)
        except slots_lib.BadSlot as err:
            damaged.append(str(err))
            continue
        if got is not None and (held := _identity(got[2], job, run, path)) is not None:
            out.append(held)
    return out, damaged


def parsed_copy(
    data: bytes | None, name: str, rank: int, position: tuple[int, ...]
) -> tuple[slots_lib.Record, dict, dict, bytes] | None:
    """A slot that arrived from another rank, checked (``BadSlot``), its values those of ``rank``'s
    state at ``position``; None where it did not arrive whole."""
    got = slots_lib.parse_slot(data, name) if data is not None else None
    if got is None:
        return None
    values = got[2]
    if values.get("rank") != rank or values.get("position") != list(position):
        raise slots_lib.BadSlot(
            f"{name}: it holds rank {values.get('rank')}'s state at {values.get('position')}, "
            f"not rank {rank}'s at {list(position)}"
        )
    return got


def own_part_of(
    part: tuple[slots_lib.Record, dict, dict, bytes], saved: dict[tuple[Any, ...], Any]
) -> Any:
    """A rank's own values, from a copy of its own part (``MemoryStore._save`` under ``ddp``),
    its own tensors of the strategy's state put into ``saved``."""
    record, manifest, values, data = part
    tensors = slots_lib.tensors_of(data, record, manifest)
    if values.get("part") != "own" or len(tensors) != 1 or tensors[0].dtype != torch.uint8:
        raise slots_lib.BadSlot("it is not a copy of a rank's own part")
    blob = codec.decode_blob(tensor_bytes(tensors[0]))
    for key, tensor in blob["strategy_own"].items():
        saved[tuple(json.loads(key))] = tensor
    return blob["own"]


# -- the transfer beside training ------------------------------------------------------------------


@dataclass
class Round:
    """What one transfer did: the ``step`` it carried (``carried``: False for a commit alone), its
    ``seconds``, the CPU seconds its thread took (``cpu``) and the bytes this rank ``sent``; the
    ranks that ``stopped`` keeping copies (memory full: every rank then stops), the copies that
    arrived ``damaged`` (not kept, named), an ``error`` (a rank lost)."""

    step: int
    carried: bool = True
    seconds: float = 0.0
    cpu: float = 0.0
    sent: int = 0
    stopped: list[int] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    error: BaseException | None = None


Payload = torch.Tensor | Callable[[], torch.Tensor]
"""A copy to send: a contiguous uint8 tensor, or what makes it (called in the courier's thread)."""


class Courier:
    """Sends this rank's copy of each save to its partners and takes its sources' copies into
    ``files``, in a thread of its own on a gloo ``group`` of its own (two threads issuing
    collectives on one group could pair a message of one with the other's), one round per save:
    every rank submits the same rounds, in order, and each round begins with every rank's word
    whether it still keeps copies (one all-gather). A round first runs the save's commit where the
    save left it to the thread (copies from a GPU). Without a ``placement`` it only commits."""

    def __init__(
        self,
        placement: Placement | None,
        rank: int,
        world_size: int,
        group: Any,
        files: ReplicaFiles | None,
    ) -> None:
        self.placement = placement
        self.partners = placement.partners[rank] if placement is not None else ()
        self.sources = placement.sources(rank) if placement is not None else []
        self.rank, self.world_size, self.group, self.files = rank, world_size, group, files
        self._jobs: queue.SimpleQueue[tuple[int, Any, Any, bool] | None] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[Round] = queue.SimpleQueue()
        self.in_flight: int | None = None
        """The step of the round submitted and not yet settled."""
        self._thread = threading.Thread(target=self._serve, name="ddpkit-replicas", daemon=True)
        self._thread.start()

    def submit(
        self,
        step: int,
        payload: Payload | None,
        commit: Callable[[], None] | None = None,
        *,
        send: bool = True,
    ) -> None:
        """After ``commit()`` (where given), send ``payload``, this rank's copy of ``step``,
        unchanged until the round is settled, in a round of its own; None: this rank stops keeping
        copies. ``send=False`` (on every rank alike): the commit alone, no round."""
        assert self.in_flight is None, "settle the round in flight first"
        self.in_flight = step
        self._jobs.put((step, payload, commit, send))

    def settle(self) -> Round | None:
        """The round in flight, once it ended (None where none is in flight)."""
        if self.in_flight is None:
            return None
        self.in_flight = None
        return self._results.get()

    def close(self) -> None:
        """End the thread once its round is done (:data:`CLOSE_WAIT` seconds at most: a round
        whose peers are gone ends with their connections)."""
        self._jobs.put(None)
        self._thread.join(CLOSE_WAIT)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            step, payload, commit, send = job
            result = Round(step, carried=send and self.placement is not None)
            t0, cpu0 = time.perf_counter(), time.thread_time()
            try:
                if commit is not None:
                    commit()
                if self.placement is not None and send:
                    self._round(result, payload() if callable(payload) else payload)
            except Exception as err:  # noqa: BLE001  (a rank lost: said where the step waits)
                result.error = err
            result.seconds = time.perf_counter() - t0
            result.cpu = time.thread_time() - cpu0
            self._results.put(result)

    def _round(self, result: Round, payload: torch.Tensor | None) -> None:
        flag = torch.tensor([0 if payload is None else 1], dtype=torch.int64)
        flags = [torch.empty(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(flags, flag, group=self.group)
        result.stopped = [r for r, f in enumerate(flags) if int(f) == 0]
        if result.stopped or payload is None or self.files is None:
            return
        # the size and the header in one message (each wait is a turn of the GIL from the step)
        opening = torch.empty(8 + slots_lib.HEADER, dtype=torch.uint8)
        opening[:8] = torch.tensor([payload.numel()], dtype=torch.int64).view(torch.uint8)
        opening[8:] = payload[: slots_lib.HEADER]
        heard = {p: torch.empty(8 + slots_lib.HEADER, dtype=torch.uint8) for p in self.sources}
        _wait_all(
            [self._send(opening, d, _HEAD) for d in self.partners]
            + [self._recv(heard[p], p, _HEAD) for p in self.sources]
        )
        arrivals = []
        for p, got in heard.items():
            arrival = self.files.arriving(p, int(got[:8].view(torch.int64)))
            arrival.head.copy_(got[8:])
            arrivals.append(arrival)
        pieces = max([-(-(payload.numel() - slots_lib.HEADER) // CHUNK)] + [
            -(-(a.body.numel() - slots_lib.HEADER) // CHUNK) for a in arrivals
        ])  # fmt: skip
        for index in range(pieces):
            self._exchange_chunk(result.step, index, payload, arrivals)
        result.sent = payload.numel() * len(self.partners)
        for arrival in arrivals:
            if (why := self.files.commit(arrival)) is not None:
                result.damaged.append(why)

    def _exchange_chunk(
        self, step: int, index: int, payload: torch.Tensor, arrivals: list[Arrival]
    ) -> None:
        """The ``index``-th :data:`CHUNK` of every copy past its header, sent and received."""
        start = slots_lib.HEADER + index * CHUNK
        works = []
        if start < payload.numel():
            piece = payload[start : start + CHUNK]
            works += [self._send(piece, d, _BODY) for d in self.partners]
        for a in arrivals:
            if start < a.body.numel():
                works.append(self._recv(a.body[start : start + CHUNK], a.source, _BODY))
        _wait_all(works)

    def _peer(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def _send(self, tensor: torch.Tensor, rank: int, tag: int) -> Any:
        return dist.isend(tensor, self._peer(rank), group=self.group, tag=tag)

    def _recv(self, tensor: torch.Tensor, rank: int, tag: int) -> Any:
        return dist.irecv(tensor, self._peer(rank), group=self.group, tag=tag)


def _wait_all(works: list[Any]) -> None:
    for work in works:
        work.wait()


# -- the transfers of a restore --------------------------------------------------------------------


def exchange(
    plan: dict[int, int], parts: dict[int, list[bytes | None]], rank: int, group: Any
) -> list[bytes | None] | None:
    """Point to point, each holder of ``plan`` (needy rank -> holder) sends each of its needy
    ranks ``parts[needy]`` (read on the holder; None where it could not be read): this rank's parts
    as received where it is needy (None for a part its holder could not read), else None. Every
    rank calls it with the same ``plan``."""
    width = 2  # a copy, and the holder's own slot under it where the copy is an own part
    sizes_out = {
        r: torch.tensor([len(x) if x is not None else -1 for x in p] + [-1] * (width - len(p)),
                        dtype=torch.int64)
        for r, p in parts.items()
    }  # fmt: skip
    holder = plan.get(rank)
    sizes_in = torch.full((width,), -1, dtype=torch.int64)
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    works = [dist.isend(s, peer(r), group=group, tag=_SIZE) for r, s in sizes_out.items()]
    if holder is not None:
        works.append(dist.irecv(sizes_in, peer(holder), group=group, tag=_SIZE))
    _wait_all(works)
    received = [torch.empty(max(int(n), 0), dtype=torch.uint8) for n in sizes_in.tolist()]
    works = []
    for r, p in parts.items():
        for x in p:
            if x:  # a part sent whole, in one message: a restore is not paced by a step
                works.append(
                    dist.isend(torch.frombuffer(bytearray(x), dtype=torch.uint8), peer(r),
                               group=group, tag=_BODY)
                )  # fmt: skip
    if holder is not None:
        works += [
            dist.irecv(buf, peer(holder), group=group, tag=_BODY)
            for buf, n in zip(received, sizes_in.tolist())
            if n > 0
        ]
    _wait_all(works)
    if holder is None:
        return None
    return [tensor_bytes(buf) if n >= 0 else None for buf, n in zip(received, sizes_in.tolist())]
