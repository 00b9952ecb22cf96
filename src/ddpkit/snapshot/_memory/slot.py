"""The file format of a memory snapshot's slot, and its checks: a commit record, a manifest, the
values and the data region, each with its checksum (the data region's: a CRC-32C per block,
:func:`block_crcs`; the format: :mod:`ddpkit.snapshot._memory.store`). Reading a slot checks
everything before any tensor is viewed; a whole slot that does not check raises :class:`BadSlot`.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddpkit.distributed._collectives import tensor_bytes
from ddpkit.snapshot._region import Spec, checked_specs, views

# 1: no checksum of the data region; 2: CRC-32 of block sums, no table (slots of either are not
# found).
MAGIC = b"DDPKMEM3"
HEADER = 4096
# magic begin end manifest, values, data: (off len crc) each
_RECORD = struct.Struct("<8sQQQQIQQIQQI")
# Bytes of the data region per CRC-32C: a 256th of CRC-32C's distance-4 length (268,435,451 bytes,
# see block_crcs); a table of 4 bytes per MiB, and one Python call per ~0.1 ms of CRC.
BLOCK = 1 << 20
BEGIN_OFFSET, END_OFFSET = 8, 16  # offsets of the generation numbers in the record
# Each of the manifest and the values is JSON parsed whole (about 10 s a GiB): the manifest has ~40
# bytes a tensor and the values a few per number of the run's own state, so a GiB is millions of
# either.
PART_LIMIT = 1 << 30


class BadSlot(ValueError):
    """A whole slot that does not check: its message names the slot and what is wrong."""


def block_crcs(region: Any) -> bytes:
    """The table a slot keeps after its data region: the CRC-32C of each ``BLOCK`` bytes of
    ``region`` (a contiguous CPU tensor, bytes or a memoryview; the last block may be shorter),
    little-endian uint32s in order.

    Why CRC-32C per block: its polynomial 0x1EDC6F41 (Koopman's 0x8F6E37A0) has Hamming distance 4
    up to 2,147,483,615 data bits (Koopman, "32-Bit Cyclic Redundancy Codes for Internet
    Applications", DSN 2002, and his CRC tables: it has the factor x+1, so every odd number of
    flipped bits is seen, and x's period modulo it is 2**31 - 1, so two flips are seen in any
    codeword up to that many bits). Every change of 1, 2 or 3 bits within a block of at most
    268,435,451 bytes, and every burst of up to 32 bits (degree 32), moves the block's CRC; a change
    that spans blocks moves the CRC of each block it touches (at most 3 bits or one burst in each),
    so comparing every entry of the table sees it. One CRC of a larger region could not: with 32
    check bits, distance 4 holds to at most 2**31 bits whatever the code. (The block sums before,
    CRC-32 of wrapping int64 sums of 4 KiB blocks, let +x in one word and -x in another of the same
    block through.)

    Blocks are independent and the CRC releases the GIL from 32 KiB on, so the table can be made in
    pieces or on threads; one thread does it in less time than the copy it checks
    (bench/memory_checksum.py).
    """
    import crc32c  # here, not at the top: `import ddpkit` does not load it

    view = _bytes_of(region)
    crcs = [crc32c.crc32c(view[i : i + BLOCK]) for i in range(0, len(view), BLOCK)]
    return struct.pack(f"<{len(crcs)}I", *crcs)


def table_size(region_size: int) -> int:
    """The bytes of the table of :func:`block_crcs` of a data region of ``region_size`` bytes."""
    return 4 * -(-region_size // BLOCK)


def table_crc(table: bytes) -> int:
    """The record's check of the table itself (its CRC-32C): a table damaged alone is named as
    such."""
    import crc32c

    return crc32c.crc32c(table)


def _bytes_of(region: Any) -> memoryview:
    """A flat byte view of ``region`` (a contiguous CPU tensor, bytes or a memoryview)."""
    if not isinstance(region, torch.Tensor):
        return memoryview(region).cast("B")
    flat = region.reshape(-1).view(torch.uint8)
    # numpy is a core dependency, but `import ddpkit` and the launcher run without it; a tensor has
    # no buffer protocol, so without numpy its bytes are copied first (once more the copy's cost).
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
    # offset, length, CRC-32C of its table of block CRC-32Cs (right after it)
    data: tuple[int, int, int]

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
    None if it is not whole (never committed, or torn by a kill during a copy). Without ``data``
    only the record and values are read, and the manifest's checksum checked (a resume looks at
    every slot on the node, every rank's, and reads the tensors of one): the manifest, which names
    every tensor, is parsed only with ``data`` (else ``{}``), along with the data region's checksum
    and the manifest's layout. A whole slot that does not check raises :class:`BadSlot`."""
    try:
        # O_NONBLOCK: a FIFO planted under a slot's name opens at once; fstat then refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadSlot(f"{path} is not a regular file")
        if data:
            with os.fdopen(os.dup(fd), "rb") as f:  # a loop of reads: one read stops at 2 GiB
                return parse_slot(f.read(), str(path))
        record = Record.unpack(os.pread(fd, HEADER, 0))
        if record is None or not record.whole:
            return None
        # before a read of the lengths it gives
        _check_parts(record, os.fstat(fd).st_size, str(path))
        parts = [os.pread(fd, length, off) for off, length, _ in (record.manifest, record.values)]
    finally:
        os.close(fd)
    return _checked(record, parts, b"", str(path))


def parse_slot(data: bytes, name: str = "a slot") -> tuple[Record, dict, dict, bytes] | None:
    """:func:`read_slot` with ``data`` of a slot's bytes (read from its file, or sent by a peer;
    ``name`` says which, in a :class:`BadSlot`)."""
    record = Record.unpack(data[:HEADER])
    if record is None or not record.whole:
        return None
    _check_parts(record, len(data), name)
    parts = [data[off : off + length] for off, length, _ in (record.manifest, record.values)]
    return _checked(record, parts, data, name)


def _check_parts(record: Record, size: int, name: str) -> None:
    """The manifest and values lie inside the slot's ``size`` bytes and within :data:`PART_LIMIT`
    (the record has no checksum of its own: its lengths are read before anything can vouch for
    them)."""
    for what, (off, length, _) in (("manifest", record.manifest), ("values", record.values)):
        if length > PART_LIMIT:
            raise BadSlot(
                f"{name}: its {what} holds {length} bytes, more than the {PART_LIMIT} a slot's may"
            )
        if off + length > size:
            raise BadSlot(f"{name}: its {what} lies past the end of the file")


def _checked(
    record: Record, parts: list[bytes], data: bytes, name: str
) -> tuple[Record, dict, dict, bytes]:
    for what, (_, length, crc), raw in zip(
        ("manifest", "values"), (record.manifest, record.values), parts
    ):
        if len(raw) != length:
            raise BadSlot(f"{name}: its {what} lies past the end of the file")
        if zlib.crc32(raw) != crc:
            raise BadSlot(f"{name}: its {what} fail their CRC-32")
    try:
        # Without the data, the manifest is not needed: parsing it is the largest part of looking at
        # a slot.
        manifest, values = json.loads(parts[0]) if data else {}, json.loads(parts[1])
    except (ValueError, RecursionError) as err:
        raise BadSlot(f"{name}: its manifest or values are not JSON ({err})") from None
    if not isinstance(manifest, dict) or not isinstance(values, dict):
        raise BadSlot(f"{name}: its manifest or values are not a record")
    if data:
        _check_data(data, record, manifest, name)
    return record, manifest, values, data


def _region(data: bytes | memoryview, record: Record) -> torch.Tensor:
    off, length, _ = record.data
    if length == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data[off : off + length]), dtype=torch.uint8)


def _check_data(data: bytes, record: Record, manifest: dict, name: str) -> None:
    """The manifest's layout inside the data region, and the region's table of CRC-32Cs (right after
    it, checked by the record's CRC-32C of it) entry by entry: before any tensor is viewed."""
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
        specs(manifest, length)
    except ValueError as err:
        raise BadSlot(f"{name}: {err}") from None
    table = bytes(data[off + length : end])
    if table_crc(table) != want:
        raise BadSlot(f"{name}: its table of the tensors' checksums fails its CRC-32C")
    if block_crcs(memoryview(data)[off : off + length]) != table:
        raise BadSlot(
            f"{name}: its tensors' bytes fail their checksum (changed since they were saved)"
        )


def specs(manifest: dict, region_size: int) -> list[Spec]:
    """The manifest's tensor layout, each checked to lie inside a region of ``region_size``
    bytes."""
    return checked_specs(manifest.get("specs"), region_size)


def tensors_of(data: bytes | memoryview, record: Record, manifest: dict) -> list[torch.Tensor]:
    """Copies of a slot's tensors (the slot may be overwritten later), from :func:`read_slot`'s
    checked parts."""
    region = _region(data, record)
    try:
        layout = specs(manifest, region.numel())
    except ValueError as err:
        raise BadSlot(str(err)) from None
    # Each its own tensor: some consumers (torch.set_rng_state) read a tensor's storage from its
    # start.
    return [v.clone() for v in views(region, layout)]
