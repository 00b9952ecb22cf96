"""Snapshots in node-local shared memory that outlive the worker process: one rank's double-buffered
store.

A worker killed at any instant leaves its state in files on a memory file system (``/dev/shm``), in
the job's folder the launcher's agent makes and removes (:mod:`ddpkit.snapshot._memory.folder`). The
restarted worker finds it there without touching the disk. Each rank keeps two slot files,
``<run>-rank<r>-<i>.slot`` (``<run>``: a hash of the run directory, ``i`` = 0, 1).

Double buffering: a save overwrites the older of the rank's two slots, so the newer stays whole
while the copy runs. Each slot file starts with a commit record::

    magic | begin | end
    | offsets, lengths and CRC-32s of the manifest and the values
    | the data region's offset, length and the CRC-32C of its table

and ends with the data region and its table, a CRC-32C per MiB of it
(:func:`~ddpkit.snapshot._memory.slot.block_crcs`).

``begin`` is set to the save's generation before anything else is written, ``end`` to the same
number after everything else is: a slot counts only when ``begin == end``, so a kill during the copy
leaves it not whole, and the other slot is the newest whole one. (A process killed by a signal stops
at an instruction boundary: every store before it reached the page cache, none after it did, so
``end`` cannot land without the copy before it. A lost node loses the files anyway: that case is
served by peers, :mod:`ddpkit.snapshot._memory.resume`.)

A slot holds its tensors raw, each at an aligned offset of the data region; a *manifest* (JSON: each
tensor's dtype, shape and offset, and what the resume check compares), written when the layout
changes; and the *values* of this save (JSON, :mod:`ddpkit.snapshot._codec`: the step, the keys
below, the non-tensor values).

A slot that is whole but does not check (a checksum that fails, a manifest whose tensors lie outside
the data region, values that are not what a save writes) is damaged: :func:`read_slot` raises
:class:`BadSlot` naming the file and what is wrong, before any tensor is viewed, and a resume falls
back to the slot before it or to the disk (:mod:`ddpkit.snapshot._memory.resume`).

Keys: a slot is found only when its job key (the agent's random key and torchrun's run id), run key
(the run directory's hash), world size and rank are this worker's: a slot of another job, of an
earlier job on the node (its folder was another), or of another run directory of the same job is
never loaded.

Memory full: a slot's pages are reserved with ``posix_fallocate`` before they are mapped, so a full
``/dev/shm`` raises ENOSPC there (:class:`MemoryUnavailable`), never SIGBUS in the middle of the
copy.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit.snapshot._memory import folder as memory_folder
from ddpkit.snapshot._memory.slot import (
    BEGIN_OFFSET,
    END_OFFSET,
    HEADER,
    BadSlot,
    Record,
    block_crcs,
    read_slot,
    table_crc,
    table_size,
)
from ddpkit.snapshot._region import Spec, views


class MemoryUnavailable(RuntimeError):
    """Shared memory cannot hold the snapshot (full, or the folder gone); disk snapshots carry on
    alone."""


def run_key(run_dir: str | os.PathLike) -> str:
    """A short hash of the run directory's absolute path: two Trainers of one job never share
    slots."""
    return hashlib.sha256(str(Path(run_dir).absolute()).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Found:
    """A whole slot of this run on this node (of any rank), as read from its record and values."""

    path: Path
    rank: int
    generation: int
    step: int
    position: tuple[int, ...]
    world_size: int
    peers: bool
    job: str


class _Slot:
    """One slot file of this rank, mapped while its layout lasts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.record: Record | None = None
        self.fd: int | None = None
        self.region: torch.Tensor | None = None  # the data region, mapped
        self.dests: list[torch.Tensor] = []
        self.layout_id: object = None
        self.manifest_bytes = b""
        self.values_capacity = self.values_offset = self.data_offset = self.data_size = 0

    def close(self) -> None:
        self.region, self.dests, self.layout_id = None, [], None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class MemoryStore:
    """This rank's two slots for one run directory, in the job's folder on this node.

    ``save`` copies the state into the older slot and commits it; ``found`` lists the whole slots of
    this run on this node (every rank's: a rank that took another's place after a restart may use
    them, see :mod:`ddpkit.snapshot._memory.resume`). No collective here: every method acts on this
    rank's files alone.
    """

    def __init__(
        self, folder: str | os.PathLike, *, job: str, run: str, rank: int, world_size: int
    ) -> None:
        self.folder = Path(folder)
        self.job, self.run, self.rank, self.world_size = job, run, rank, world_size
        if not self.folder.is_dir():
            raise MemoryUnavailable(f"the job's memory folder {self.folder} is gone")
        self.slots = [_Slot(self.folder / f"{run}-rank{rank}-{i}.slot") for i in (0, 1)]
        self.generation = 0
        self.damaged: list[str] = []
        """What :meth:`found` last found wrong with whole slots it left out (each names its
        file)."""
        for slot in self.slots:
            try:
                got = read_slot(slot.path)
            except BadSlot:
                got = None  # overwritten by the next saves; a resume says what is wrong with it
            if got is not None:
                slot.record = got[0]
                self.generation = max(self.generation, got[0].end)

    def _target(self) -> _Slot:
        """The slot to overwrite: not the newest whole one."""
        whole = [s for s in self.slots if s.record is not None and s.record.whole]
        if len(whole) < 2:
            return next(s for s in self.slots if s not in whole)
        return min(whole, key=lambda s: s.record.end if s.record is not None else 0)

    def save(
        self,
        values: dict[str, Any],
        tensors: Sequence[torch.Tensor],
        manifest: dict[str, Any],
        layout_id: object,
    ) -> None:
        """Commit ``tensors`` (laid out as ``manifest["specs"]``, a layout named by ``layout_id``)
        with the JSON-able ``values`` into the older slot. Raises :class:`MemoryUnavailable` if
        memory is full."""
        slot = self._target()
        values = {
            "job": self.job,
            "run": self.run,
            "rank": self.rank,
            "world_size": self.world_size,
            **values,
        }
        value_bytes = json.dumps(values).encode()
        if slot.layout_id != layout_id or len(value_bytes) > slot.values_capacity:
            self._map(slot, manifest, layout_id, len(value_bytes))
        fd = slot.fd
        assert fd is not None  # mapped above
        self.generation += 1
        gen = self.generation
        # Commit protocol: begin first (the slot stops being whole), then everything, then end.
        os.pwrite(fd, struct.pack("<Q", gen), BEGIN_OFFSET)
        slot.record = None
        copy_tensors(slot.dests, tensors)
        assert slot.region is not None  # mapped with the dests
        table = block_crcs(slot.region)
        m_off = HEADER
        v_off = slot.values_offset
        os.pwrite(fd, value_bytes, v_off)
        os.pwrite(fd, table, slot.data_offset + slot.data_size)
        record = Record(
            gen,
            0,
            (m_off, len(slot.manifest_bytes), zlib.crc32(slot.manifest_bytes)),
            (v_off, len(value_bytes), zlib.crc32(value_bytes)),
            (slot.data_offset, slot.data_size, table_crc(table)),
        )
        os.pwrite(fd, record.pack(), 0)
        os.pwrite(fd, struct.pack("<Q", gen), END_OFFSET)
        slot.record = Record(gen, gen, record.manifest, record.values, record.data)

    def _map(
        self, slot: _Slot, manifest: dict[str, Any], layout_id: object, values_len: int
    ) -> None:
        """(Re)make ``slot``'s file for a new layout; its pages are reserved before they are
        mapped."""
        slot.close()
        slot.manifest_bytes = json.dumps(manifest).encode()
        specs = [Spec(d, tuple(shape), o) for d, shape, o in manifest["specs"]]
        data_size = manifest["data_size"]
        slot.values_capacity = max(1 << 16, 4 * values_len)
        slot.values_offset = _round(HEADER + len(slot.manifest_bytes), 4096)
        slot.data_offset = _round(slot.values_offset + slot.values_capacity, 4096)
        slot.data_size = data_size
        size = slot.data_offset + max(data_size + table_size(data_size), 1)
        try:
            fd = fs.open_fd(slot.path, os.O_RDWR | os.O_CREAT, 0o600)
        except ConfigError as err:  # a link, or another user's file, in the job's folder
            raise MemoryUnavailable(f"cannot make {slot.path}: {err}") from None
        try:
            # The slot is not whole from here on (its end is cleared), whatever the new file holds.
            os.pwrite(fd, bytes(HEADER), 0)
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            os.pwrite(fd, slot.manifest_bytes, HEADER)
        except OSError as err:
            os.close(fd)
            with contextlib.suppress(OSError):
                fs.remove(slot.path)
            if err.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise MemoryUnavailable(
                    f"no room for {size / 2**20:.1f} MiB in {self.folder} ({err.strerror}): "
                    + memory_folder.MOUNT_MORE
                ) from None
            raise MemoryUnavailable(f"cannot make {slot.path}: {err.strerror}") from None
        storage = torch.UntypedStorage.from_file(str(slot.path), shared=True, nbytes=size)
        mapped = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
        slot.fd, slot.layout_id = fd, layout_id
        slot.region = mapped[slot.data_offset : slot.data_offset + data_size]
        slot.dests = views(slot.region, specs)
        slot.record = None

    def found(self) -> list[Found]:
        """The whole slots of this run and job on this node, every rank's, at this world size."""
        out, self.damaged = [], []
        for path in sorted(self.folder.glob(f"{self.run}-rank*-*.slot")):
            try:
                got = read_slot(path)
            except BadSlot as err:
                self.damaged.append(str(err))
                continue
            if got is None:
                continue
            record, _, values, _ = got
            if values.get("job") != self.job or values.get("run") != self.run:
                continue
            if values.get("world_size") != self.world_size:
                continue
            rank, step, position = values.get("rank"), values.get("step"), values.get("position")
            if not (
                isinstance(rank, int)
                and _is_int(rank)
                and 0 <= rank < self.world_size
                and isinstance(step, int)
                and _is_int(step)
                and isinstance(position, list)
                and len(position) == 3
                and all(map(_is_int, position))
                and position[1] == step
            ):
                self.damaged.append(f"{path}: its values do not say which rank and step it holds")
                continue
            found = Found(
                path,
                rank,
                record.end,
                step,
                tuple(position),
                self.world_size,
                bool(values.get("peers")),
                self.job,
            )
            out.append(found)
        return out

    def discard_except(self, keep: Path | None = None) -> None:
        """Make this rank's slots not whole, except ``keep``: after a resume, only the state resumed
        from (or none) may be found again, so that a later restart never picks a slot of an
        abandoned course."""
        for slot in self.slots:
            if slot.path == keep or not slot.path.exists():
                continue
            with contextlib.suppress(OSError, ConfigError):
                fd = fs.open_fd(slot.path, os.O_WRONLY)
                try:
                    os.pwrite(fd, bytes(24), 0)
                finally:
                    os.close(fd)
            slot.record = None

    def remove(self) -> None:
        """Delete this rank's slot files (the run finished: its last state is on disk, or not
        needed)."""
        for slot in self.slots:
            slot.close()
            with contextlib.suppress(OSError, ConfigError):
                fs.remove(slot.path)

    def close(self) -> None:
        for slot in self.slots:
            slot.close()


def _is_int(value: Any) -> bool:
    return type(value) is int


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def copy_tensors(dests: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copy ``sources`` into ``dests`` (the mapped slot). One fused call: a copy per tensor costs ~1
    us of dispatch each, which shows on small models (measured: 25 us against 12 us for the DDP
    tutorials' CNN)."""
    if dests:
        with torch.no_grad():
            torch._foreach_copy_(list(dests), list(sources))
