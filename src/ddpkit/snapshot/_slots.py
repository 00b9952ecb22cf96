"""What snapshots in memory keep on a node: each rank's two slot files in the job's folder of them
(``memory/`` of the job folder in shared memory, :mod:`ddpkit._launch.agent.jobdir`), and a slot's
format and checks (docs/snapshots.md, "Snapshots in memory"). Layout::

    <job folder>/memory/<run>-rank<r>-<i>.slot  rank r's slots 0 and 1

A slot is a commit record (its parts' offsets, lengths and checksums between ``begin`` and ``end``
generation numbers), a JSON manifest (the tensors' layout, what a resume checks), the JSON values,
and the raw tensors with a CRC-32C per MiB (:func:`block_crcs`). A slot counts only when ``begin``
(written first) equals ``end`` (written last).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit.distributed._channels import MEMORY, MEMORY_OFF, job_folder
from ddpkit.distributed._collectives import tensor_bytes
from ddpkit.platforms import _torchrun as torchrun
from ddpkit.snapshot._codec import checked_specs, layout, views
from ddpkit.snapshot._folders import NotRegular, open_regular

MOUNT_MORE = (
    "give the node more shared memory: in Kubernetes an emptyDir volume with medium: Memory "
    "mounted at /dev/shm (`ddpkit k8s` writes one), in Docker --shm-size"
)

# 1: no checksum of the data region; 2: CRC-32 of block sums (slots of either are not found)
MAGIC = b"DDPKMEM3"
HEADER = 4096
_RECORD = struct.Struct("<8sQQQQIQQIQQI")  # magic begin end, (off len crc) of manifest values data
BLOCK = 1 << 20
"""Bytes of the data region per CRC-32C: a 256th of its Hamming-distance-4 length."""
BEGIN_OFFSET, END_OFFSET = 8, 16  # of the generation numbers in the record
PART_LIMIT = 1 << 30
"""The most bytes of a slot's manifest or values (JSON parsed whole: millions of entries)."""


class MemoryUnavailable(RuntimeError):
    """Shared memory cannot hold the snapshot (full, or the folder gone)."""


class MemoryFull(MemoryUnavailable):
    """No room for a file of ``needed`` bytes in the job's memory folder (ENOSPC, ENOMEM, EFBIG)."""

    def __init__(self, message: str, needed: int) -> None:
        super().__init__(message)
        self.needed = needed


class BadSlot(ValueError):
    """A whole slot that does not check: its message names the slot and what is wrong."""


def memory_folder() -> tuple[Path | None, str]:
    """The job's folder of snapshots in memory on this node (in its job folder:
    :mod:`ddpkit.distributed._channels`) and the job's key (the folder's name, with torchrun's run
    id); else None, and why there is none."""
    job = job_folder()
    if job is None:
        return None, "no memory folder for the job (run under ddpkit run)"
    folder = job / MEMORY
    if not folder.is_dir():
        try:
            why = fs.read_bytes(job / MEMORY_OFF).decode(errors="replace")
        except (OSError, ConfigError):
            why = f"the job's memory folder {folder} is gone"
        return None, why
    return folder, f"{torchrun.run_id(os.environ)}:{job.name}"


def free_bytes(folder: str | os.PathLike[str]) -> int:
    """The bytes a file in ``folder`` may still take (its file system's, for an unprivileged
    user); OSError where it cannot be told."""
    info = os.statvfs(folder)
    return info.f_bavail * info.f_frsize


def room_warning(folder: str | os.PathLike[str], need: int) -> str | None:
    """A warning when the file system of ``folder`` has less free room than ``need`` bytes (a
    container's 64 MiB ``/dev/shm``)."""
    try:
        free = free_bytes(folder)
    except OSError:
        return None
    if free >= need:
        return None
    return (
        f"the shared memory holding {folder} has {free / 2**20:.0f} MiB free, less than the "
        f"{need / 2**20:.0f} MiB that the snapshots in memory of this node's ranks need at least "
        "(two copies of each rank's model, more with its optimizer's state): they will stop at "
        f"the first save; {MOUNT_MORE}"
    )


def run_key(run_dir: str | os.PathLike) -> str:
    """A short hash of the run directory's absolute path (its bytes: it may not be UTF-8)."""
    return hashlib.sha256(os.fsencode(Path(run_dir).absolute())).hexdigest()[:16]


def block_crcs(region: Any) -> bytes:
    """The table a slot keeps after its data region: the CRC-32C of each :data:`BLOCK` bytes of
    ``region`` (a contiguous CPU tensor, bytes or a memoryview), little-endian uint32s in order
    (why CRC-32C per MiB: docs/snapshots.md)."""
    import crc32c  # not at `import ddpkit`

    view = _bytes_of(region)
    crcs = [crc32c.crc32c(view[i : i + BLOCK]) for i in range(0, len(view), BLOCK)]
    return struct.pack(f"<{len(crcs)}I", *crcs)


def table_size(region_size: int) -> int:
    """The bytes of the table of :func:`block_crcs` of a data region of ``region_size`` bytes."""
    return 4 * -(-region_size // BLOCK)


def table_crc(table: bytes) -> int:
    """The record's CRC-32C of the table itself: a table damaged alone is named as such."""
    import crc32c

    return crc32c.crc32c(table)


def _bytes_of(region: Any) -> memoryview:
    if not isinstance(region, torch.Tensor):
        return memoryview(region).cast("B")
    flat = region.reshape(-1).view(torch.uint8)
    # `import ddpkit` and the launcher run without numpy: then the tensor's bytes are copied first
    try:
        import numpy  # noqa: F401
    except ModuleNotFoundError:
        return memoryview(tensor_bytes(flat))
    return flat.numpy().data  # shares the tensor's memory


@dataclass(frozen=True)
class Record:
    """A slot's commit record."""

    begin: int
    end: int
    manifest: tuple[int, int, int]  # offset, length, CRC-32
    values: tuple[int, int, int]
    data: tuple[int, int, int]  # offset, length, CRC-32C of its table (right after it)

    @property
    def whole(self) -> bool:
        return self.begin == self.end != 0

    def pack(self) -> bytes:
        return _RECORD.pack(MAGIC, self.begin, self.end, *self.manifest, *self.values, *self.data)

    @classmethod
    def unpack(cls, raw: bytes) -> Record | None:
        if len(raw) < _RECORD.size:
            return None
        magic, begin, end, mo, ml, mc, vo, vl, vc, do, dl, dc = _RECORD.unpack_from(raw)
        return cls(begin, end, (mo, ml, mc), (vo, vl, vc), (do, dl, dc)) if magic == MAGIC else None


def read_slot(path: Path, data: bool = False) -> tuple[Record, dict, dict, bytes] | None:
    """(record, manifest, values, the file's bytes if ``data`` else b"") of a whole slot file, or
    None if it is not whole. Without ``data`` only the record and values are read and the manifest's
    CRC checked; with it, the manifest's layout and the data's checksums too. A whole slot that does
    not check raises :class:`BadSlot`."""
    try:
        fd = open_regular(path)
    except NotRegular:
        raise BadSlot(f"{path} is not a regular file") from None
    except OSError:
        return None
    try:
        if data:
            with os.fdopen(os.dup(fd), "rb") as f:  # a loop of reads: one read stops at 2 GiB
                return parse_slot(f.read(), str(path))
        size = os.fstat(fd).st_size
        return _parse(
            os.pread(fd, HEADER, 0), size, lambda o, n: os.pread(fd, n, o), b"", str(path)
        )
    finally:
        os.close(fd)


def parse_slot(data: bytes, name: str = "a slot") -> tuple[Record, dict, dict, bytes] | None:
    """:func:`read_slot` of a slot's bytes (read from its file, or sent by a peer; ``name`` says
    which, in a :class:`BadSlot`)."""
    return _parse(data[:HEADER], len(data), lambda o, n: data[o : o + n], data, name)


def arrived(
    head: bytes, body: Any, name: str, known: dict[str, Any] | None = None
) -> tuple[Record, dict, dict]:
    """The record, manifest and values of a slot that arrived from another rank, its header
    ``head`` apart and its other bytes in ``body`` (the whole slot's length, a tensor or a buffer;
    its first :data:`HEADER` bytes are not read): its parts, layout and checksums checked, else
    :class:`BadSlot` (a slot not whole too). ``known``: the last manifest checked so, kept there (a
    manifest of the same bytes is not parsed and laid out again: its checksums are)."""
    view = _bytes_of(body)
    got = _parse(head, len(view), lambda o, n: bytes(view[o : o + n]), view, name, known)
    if got is None:
        raise BadSlot(f"{name}: its record does not say it is whole")
    return got[0], got[1], got[2]


def pack(values: dict[str, Any], tensors: Sequence[torch.Tensor]) -> bytes:
    """The bytes of a whole slot of ``tensors`` and the JSON-able ``values``, made in memory: what a
    rank sends in place of its slot file (:func:`parse_slot` reads it)."""
    specs, size = layout(tensors)
    spec_list = [[s.dtype, list(s.shape), s.offset] for s in specs]
    manifest = json.dumps({"specs": spec_list, "data_size": size}).encode()
    value_bytes = json.dumps(values).encode()
    values_offset = HEADER + len(manifest)
    data_offset = _round(values_offset + len(value_bytes), 4096)
    out = bytearray(data_offset + size + table_size(size))
    region = torch.frombuffer(out, dtype=torch.uint8)[data_offset : data_offset + size]
    copy_tensors(views(region, specs), tensors)
    table = block_crcs(region)
    out[HEADER:values_offset] = manifest
    out[values_offset : values_offset + len(value_bytes)] = value_bytes
    out[data_offset + size :] = table
    record = Record(
        1,
        1,
        (HEADER, len(manifest), zlib.crc32(manifest)),
        (values_offset, len(value_bytes), zlib.crc32(value_bytes)),
        (data_offset, size, table_crc(table)),
    )
    out[: _RECORD.size] = record.pack()
    return bytes(out)


def _parse(
    head: bytes,
    size: int,
    read: Callable[[int, int], bytes],
    data: bytes | memoryview,
    name: str,
    known: dict[str, Any] | None = None,
) -> tuple[Record, dict, dict, Any] | None:
    """The parts of a slot of ``size`` bytes whose record is ``head``, read by ``read(offset,
    length)``; ``data``: all its bytes, whose layout and checksums are then checked too (the
    layout once, where ``known`` holds the same manifest: :func:`arrived`)."""
    record = Record.unpack(head)
    if record is None or not record.whole:
        return None
    parts = []
    # the record has no checksum of its own: its lengths are checked before anything is read
    for what, (off, length, crc) in (("manifest", record.manifest), ("values", record.values)):
        if length > PART_LIMIT:
            raise BadSlot(
                f"{name}: its {what} holds {length} bytes, more than the {PART_LIMIT} a slot's may"
            )
        raw = read(off, length) if off + length <= size else None
        if raw is None or len(raw) != length:
            raise BadSlot(f"{name}: its {what} lies past the end of the file")
        if zlib.crc32(raw) != crc:
            raise BadSlot(f"{name}: its {what} fail their CRC-32")
        parts.append(raw)
    laid_out = known is not None and known.get("raw") == parts[0]
    try:
        if laid_out:
            manifest = known["manifest"]  # type: ignore[index]
        else:
            manifest = json.loads(parts[0]) if data else {}
        values = json.loads(parts[1])
    except (ValueError, RecursionError) as err:
        raise BadSlot(f"{name}: its manifest or values are not JSON ({err})") from None
    if not isinstance(manifest, dict) or not isinstance(values, dict):
        raise BadSlot(f"{name}: its manifest or values are not a record")
    if data:
        _check_data(data, record, manifest, name, laid_out)
        if known is not None:
            known.update(raw=parts[0], manifest=manifest)
    return record, manifest, values, data


def _check_data(
    data: bytes | memoryview, record: Record, manifest: dict, name: str, laid_out: bool = False
) -> None:
    """The manifest's layout inside the data region (``laid_out``: checked already, for this data
    size), and the region's table of CRC-32Cs entry by entry, before any tensor is viewed."""
    off, length, want = record.data
    end = off + length + table_size(length)
    if off < HEADER or end > len(data):
        raise BadSlot(
            f"{name}: its data region ({length} bytes at {off}) lies past the end of the file "
            f"({len(data)})"
        )
    if manifest.get("data_size") != length:
        raise BadSlot(f"{name}: its manifest's data size is not its record's ({length} bytes)")
    try:
        if not laid_out:
            checked_specs(manifest.get("specs"), length)
    except ValueError as err:
        raise BadSlot(f"{name}: {err}") from None
    table = bytes(data[off + length : end])
    if table_crc(table) != want:
        raise BadSlot(f"{name}: its table of the tensors' checksums fails its CRC-32C")
    if block_crcs(memoryview(data)[off : off + length]) != table:
        raise BadSlot(
            f"{name}: its tensors' bytes fail their checksum (changed since they were saved)"
        )


def tensors_of(data: bytes | memoryview, record: Record, manifest: dict) -> list[torch.Tensor]:
    """Copies of a slot's tensors, from :func:`read_slot`'s checked parts (its layout checked),
    each its own tensor (``torch.set_rng_state`` reads a tensor's storage from its start)."""
    off, length, _ = record.data
    region = torch.empty(0, dtype=torch.uint8)
    if length:
        region = torch.frombuffer(bytearray(data[off : off + length]), dtype=torch.uint8)
    return [v.clone() for v in views(region, checked_specs(manifest["specs"], length))]


@dataclass(frozen=True)
class Found:
    """A whole slot of this run on this node (of any rank), as read from its record and values."""

    path: Path
    rank: int
    step: int
    position: tuple[int, ...]
    world_size: int


class _Slot:
    """One slot file of this rank, mapped while its layout lasts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.record: Record | None = None
        self.fd: int | None = None
        self.file: torch.Tensor | None = None  # the whole file, mapped
        self.pinned: int | None = None  # the address registered with CUDA, if it is
        self.region: torch.Tensor | None = None  # its data region
        self.dests: list[torch.Tensor] = []
        self.layout_id: object = None
        self.manifest_bytes = b""
        self.values_capacity = self.values_offset = self.data_offset = self.data_size = 0

    @property
    def length(self) -> int:
        """The bytes of the file a reader needs: up to the end of the table of checksums."""
        return self.data_offset + self.data_size + table_size(self.data_size)

    def close(self) -> None:
        if self.pinned is not None:  # no copy is in flight: its commit was waited for
            torch.cuda.cudart().cudaHostUnregister(self.pinned)
            self.pinned = None
        self.file, self.region, self.dests, self.layout_id = None, None, [], None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Slots:
    """This rank's two slots for one run directory, in the job's folder on this node; no collective
    (:meth:`found` lists every rank's)."""

    def __init__(
        self, folder: str | os.PathLike, *, job: str, run: str, rank: int, world_size: int
    ) -> None:
        self.folder = Path(folder)
        self.job, self.run, self.rank, self.world_size = job, run, rank, world_size
        if not self.folder.is_dir():
            raise MemoryUnavailable(f"the job's memory folder {self.folder} is gone")
        self.slots = [_Slot(self.folder / f"{run}-rank{rank}-{i}.slot") for i in (0, 1)]
        self.generation = 0
        self.last: _Slot | None = None  # the slot the last save committed
        self.kept: _Slot | None = None  # the slot of the last save kept (not overwritten next)
        self.damaged: list[str] = []
        """What :meth:`found` last found wrong with whole slots it left out, naming each file."""
        for slot in self.slots:
            try:
                got = read_slot(slot.path)
            except BadSlot:
                got = None  # overwritten by the next saves; a resume says what is wrong with it
            if got is not None:
                slot.record = got[0]
                self.generation = max(self.generation, got[0].end)

    def _target(self) -> _Slot:
        """The slot to overwrite: not the one kept (:meth:`save`'s ``keep``) while it is whole,
        else not the newest whole one."""
        whole = [s for s in self.slots if s.record is not None and s.record.whole]
        if self.kept in whole:
            return next(s for s in self.slots if s is not self.kept)
        if len(whole) < 2:
            return next(s for s in self.slots if s not in whole)
        return min(whole, key=lambda s: s.record.end if s.record is not None else 0)

    def save(
        self,
        values: dict[str, Any],
        tensors: Sequence[torch.Tensor],
        manifest: dict[str, Any],
        layout_id: object,
        keep: bool = True,
    ) -> None:
        """Commit ``tensors`` (laid out as ``manifest["specs"]``, named ``layout_id``) with the
        JSON-able ``values`` into the older slot; :class:`MemoryUnavailable` if memory is full.
        :meth:`committed` then holds its bytes. ``keep=False``: the slot of the last save kept
        stays as it is (the next save overwrites this one's instead)."""
        slot, commit = self._begin(values, manifest, layout_id, keep)
        copy_tensors(slot.dests, tensors)
        commit()

    def save_from_device(
        self,
        values: dict[str, Any],
        tensors: Sequence[torch.Tensor],
        manifest: dict[str, Any],
        layout_id: object,
        stream: Any,
        keep: bool = True,
    ) -> Callable[[], None]:
        """:meth:`save` of tensors on a GPU, the host not held: the copies are queued on ``stream``
        (a CUDA stream) after the work queued so far, into the slot's pages pinned for the device
        (``cudaHostRegister``), and the current stream waits for them (the next step cannot change
        a tensor before its copy). Returns the commit, to call from any thread once: it waits for
        the copies, then checksums and commits as :meth:`save`."""
        slot, commit = self._begin(values, manifest, layout_id, keep)
        _pin(slot)
        current = torch.cuda.current_stream(stream.device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream), torch.no_grad():
            torch._foreach_copy_(list(slot.dests), list(tensors), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        current.wait_event(copied)

        def after_copies() -> None:
            copied.synchronize()
            commit()

        return after_copies

    def _begin(
        self, values: dict[str, Any], manifest: dict[str, Any], layout_id: object, keep: bool = True
    ) -> tuple[_Slot, Callable[[], None]]:
        """The older slot, mapped for ``manifest`` and made not whole, and its commit: the
        checksums of its data, its values, then its record (``end`` last)."""
        slot = self._target()
        ids = {"job": self.job, "run": self.run, "rank": self.rank, "world_size": self.world_size}
        value_bytes = json.dumps(ids | values).encode()
        if slot.layout_id != layout_id or len(value_bytes) > slot.values_capacity:
            self._map(slot, manifest, layout_id, len(value_bytes))
        if keep:  # once mapped: a save that found memory full leaves the choice of slot as it was
            self.kept = slot
        fd = slot.fd
        assert fd is not None and slot.region is not None  # mapped above
        self.generation += 1
        gen = self.generation
        self.last = None
        # begin first (the slot stops being whole), then everything, then end
        os.pwrite(fd, struct.pack("<Q", gen), BEGIN_OFFSET)
        slot.record = None

        def commit() -> None:
            assert slot.region is not None
            table = block_crcs(slot.region)
            os.pwrite(fd, value_bytes, slot.values_offset)
            os.pwrite(fd, table, slot.data_offset + slot.data_size)
            record = Record(
                gen,
                0,
                (HEADER, len(slot.manifest_bytes), zlib.crc32(slot.manifest_bytes)),
                (slot.values_offset, len(value_bytes), zlib.crc32(value_bytes)),
                (slot.data_offset, slot.data_size, table_crc(table)),
            )
            os.pwrite(fd, record.pack(), 0)
            os.pwrite(fd, struct.pack("<Q", gen), END_OFFSET)
            slot.record = Record(gen, gen, record.manifest, record.values, record.data)
            self.last = slot

        return slot, commit

    def committed(self) -> torch.Tensor | None:
        """The bytes of the slot the last :meth:`save` committed (its mapping, not a copy: valid
        until the save after next overwrites that slot), or None."""
        slot = self.last
        if slot is None or slot.file is None:
            return None
        return slot.file[: slot.length]

    def _map(
        self, slot: _Slot, manifest: dict[str, Any], layout_id: object, values_len: int
    ) -> None:
        """(Re)make ``slot``'s file for a new layout (:func:`map_file`)."""
        slot.close()
        slot.record = None  # its file is made again: not whole, even where this fails
        slot.manifest_bytes = json.dumps(manifest).encode()
        data_size = manifest["data_size"]
        slot.values_capacity = max(1 << 16, 4 * values_len)
        slot.values_offset = _round(HEADER + len(slot.manifest_bytes), 4096)
        slot.data_offset = _round(slot.values_offset + slot.values_capacity, 4096)
        slot.data_size = data_size
        fd, mapped = map_file(slot.path, slot.length, self.folder)
        try:
            os.pwrite(fd, slot.manifest_bytes, HEADER)
        except OSError as err:
            os.close(fd)
            raise MemoryUnavailable(f"cannot write {slot.path}: {err.strerror}") from None
        slot.fd, slot.layout_id, slot.file = fd, layout_id, mapped
        slot.region = mapped[slot.data_offset : slot.data_offset + data_size]
        slot.dests = views(slot.region, checked_specs(manifest["specs"], data_size))
        slot.record = None

    def found(self, any_size: bool = False) -> list[Found]:
        """The whole slots of this run and job on this node, every rank's, at this world size
        (``any_size``: at every world size)."""
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
            size = values.get("world_size")
            if size != self.world_size and not (any_size and type(size) is int and size > 0):
                continue
            rank, step, position = values.get("rank"), values.get("step"), values.get("position")
            if not (
                type(rank) is int
                and 0 <= rank < size
                and type(step) is int
                and isinstance(position, list)
                and len(position) == 3
                and all(type(p) is int for p in position)
                and position[1] == step
            ):
                self.damaged.append(f"{path}: its values do not say which rank and step it holds")
                continue
            out.append(Found(path, rank, step, tuple(position), size))
        return out

    def discard_except(self, keep: Path | None = None) -> None:
        """Make this rank's slots not whole, except ``keep`` (the state resumed from)."""
        self.kept = None
        for slot in self.slots:
            if slot.path != keep:
                unmake(slot.path)
                slot.record = None

    def remove(self) -> None:
        """Delete this rank's slot files (the run finished)."""
        for slot in self.slots:
            slot.close()
            with contextlib.suppress(OSError, ConfigError):
                fs.remove(slot.path)

    def close(self) -> None:
        for slot in self.slots:
            slot.close()


def map_file(path: Path, size: int, folder: Path) -> tuple[int, torch.Tensor]:
    """A file of ``size`` bytes (at least one) at ``path``, its header zeroed (not whole, whatever
    it held), open and mapped: (its descriptor, its bytes). Its pages are reserved
    (``posix_fallocate``) before they are mapped, so a full memory is :class:`MemoryFull` here,
    never SIGBUS in a copy."""
    size = max(size, HEADER + 1)
    try:
        fd = fs.open_fd(path, os.O_RDWR | os.O_CREAT, 0o600)
    except ConfigError as err:  # a link, or another user's file, in the job's folder
        raise MemoryUnavailable(f"cannot make {path}: {err}") from None
    try:
        os.pwrite(fd, bytes(HEADER), 0)  # not whole from here on, whatever the file holds
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        os.close(fd)
        with contextlib.suppress(OSError, ConfigError):
            fs.remove(path)
        if err.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise MemoryFull(
                f"no room for {size / 2**20:.1f} MiB in {folder} ({err.strerror}): " + MOUNT_MORE,
                size,
            ) from None
        raise MemoryUnavailable(f"cannot make {path}: {err.strerror}") from None
    storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=size)
    return fd, torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]


def unmake(path: Path) -> None:
    """Make the slot file at ``path`` not whole (its record's magic and generations zeroed), where
    it exists."""
    if not path.exists():
        return
    with contextlib.suppress(OSError, ConfigError):
        fd = fs.open_fd(path, os.O_WRONLY)
        try:
            os.pwrite(fd, bytes(24), 0)
        finally:
            os.close(fd)


def slot_bytes(path: Path) -> bytes | None:
    """The bytes of the slot file at ``path`` as they are (unchecked), None where it cannot be
    read."""
    try:
        fd = open_regular(path)
    except (OSError, NotRegular):
        return None
    try:
        with os.fdopen(os.dup(fd), "rb") as f:  # a loop of reads: one read stops at 2 GiB
            return f.read()
    finally:
        os.close(fd)


def _round(n: int, to: int) -> int:
    return -(-n // to) * to


def _pin(slot: _Slot) -> None:
    """Register ``slot``'s mapped pages with CUDA, so a device's copies go to them directly at full
    speed (torch's own checkpoint stager pins shared memory so); where it cannot, the copies go
    through a staging buffer, as to any pageable memory."""
    if slot.pinned is not None or slot.file is None or slot.file.numel() == 0:
        return
    address = slot.file.data_ptr()
    if int(torch.cuda.cudart().cudaHostRegister(address, slot.file.numel(), 0)) == 0:
        slot.pinned = address


def copy_tensors(dests: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copy ``sources`` into ``dests`` (the mapped slot) in one fused call."""
    if dests:
        with torch.no_grad():
            torch._foreach_copy_(list(dests), list(sources))
