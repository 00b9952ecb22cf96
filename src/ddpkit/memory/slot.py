"""The file format of a memory snapshot's slot, and its checks: a commit record, a manifest, the values and the
data region, each with its checksum (the format: :mod:`ddpkit.memory.store`). Reading a slot checks everything
before any tensor is viewed; a whole slot that does not check raises :class:`BadSlot`.
"""

from __future__ import annotations

import json
import os
import stat
import struct
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddpkit.snapshot.region import Spec, checked_specs, views

MAGIC = b"DDPKMEM2"  # 1: no checksum of the data region (such slots are not found)
HEADER = 4096
_RECORD = struct.Struct("<8sQQQQIQQIQQI")  # magic begin end manifest, values, data: (off len crc) each
_BLOCK = 4096  # bytes of the data region per partial sum of the checksum
BEGIN_OFFSET, END_OFFSET = 8, 16  # offsets of the generation numbers in the record


class BadSlot(ValueError):
    """A whole slot that does not check: its message names the slot and what is wrong."""


def checksum(region: Any) -> int:
    """A checksum of a data region (uint8, a multiple of 8 bytes long): the CRC-32 of the wrapping int64 sums of
    its 4 KiB blocks, in order.

    Not zlib.crc32 over the bytes: on a 100 MB state (2-core CPU machine, medians of 15) the copy takes 14.5 ms,
    crc32 24 ms (the copy and check 2.7x the copy alone), these block sums 3.8 ms (1.3x). Any
    change inside one 8-byte word is seen (it moves its block's sum by a non-zero amount below 2**64), as is any
    change that moves a block's sum; words swapped inside one block are not. Integer sums do not depend on the
    order of the additions: the same on any machine and thread count, so a peer's slot checks too.
    """
    try:
        import numpy as np
    except ModuleNotFoundError:  # torch alone: the same sums, ~1.7x slower than numpy's
        return _checksum_torch(_byte_tensor(region))
    raw = np.frombuffer(region.numpy() if isinstance(region, torch.Tensor) else region, dtype=np.uint8)
    if raw.size % 8:
        raise ValueError(f"a data region of {raw.size} bytes is not made of 8-byte words")
    if raw.size == 0:
        return 0
    words = raw.view(np.int64)
    full = (words.size * 8 // _BLOCK) * (_BLOCK // 8)
    sums = words[:full].reshape(-1, _BLOCK // 8).sum(1, dtype=np.int64)  # wraps modulo 2**64
    tail = words[full:].sum(dtype=np.int64, keepdims=True)
    return zlib.crc32(tail, zlib.crc32(sums))


def _checksum_torch(raw: torch.Tensor) -> int:
    """:func:`checksum` without numpy."""
    if raw.numel() % 8:
        raise ValueError(f"a data region of {raw.numel()} bytes is not made of 8-byte words")
    if raw.numel() == 0:
        return 0
    words = raw.view(torch.int64)
    full = (words.numel() * 8 // _BLOCK) * (_BLOCK // 8)
    sums = words[:full].reshape(-1, _BLOCK // 8).sum(1, dtype=torch.int64)
    tail = words[full:].sum(dtype=torch.int64).reshape(1)
    packed = bytearray(8 * (sums.numel() + 1))  # little-endian int64s, as numpy's path hands them to the CRC
    torch.frombuffer(packed, dtype=torch.int64).copy_(torch.cat([sums, tail]))
    return zlib.crc32(memoryview(packed)[-8:], zlib.crc32(memoryview(packed)[:-8]))


def _byte_tensor(region: Any) -> torch.Tensor:
    """A uint8 tensor over ``region`` (a tensor, bytes or a memoryview), sharing its memory."""
    if isinstance(region, torch.Tensor):
        return region.view(torch.uint8)
    if len(region) == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # a read-only buffer (bytes) is only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(region, dtype=torch.uint8)


@dataclass(frozen=True)
class Record:
    """A slot's commit record."""

    begin: int
    end: int
    manifest: tuple[int, int, int]  # offset, length, CRC-32
    values: tuple[int, int, int]
    data: tuple[int, int, int]  # offset, length, checksum

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
    """(record, manifest, values, the file's bytes if ``data`` else b"") of a whole slot file, or None if it is
    not whole (never committed, or torn by a kill during a copy). Without ``data`` only the record and values
    are read, and the manifest's checksum checked (a resume looks at every slot on the node, every rank's, and
    reads the tensors of one): the manifest, which names every tensor, is parsed only with ``data`` (else
    ``{}``), along with the data region's checksum and the manifest's layout. A whole slot that does not check
    raises :class:`BadSlot`."""
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
        parts = [os.pread(fd, length, off) for off, length, _ in (record.manifest, record.values)]
    finally:
        os.close(fd)
    return _checked(record, parts, b"", str(path))


def parse_slot(data: bytes, name: str = "a slot") -> tuple[Record, dict, dict, bytes] | None:
    """:func:`read_slot` with ``data`` of a slot's bytes (read from its file, or sent by a peer; ``name`` says
    which, in a :class:`BadSlot`)."""
    record = Record.unpack(data[:HEADER])
    if record is None or not record.whole:
        return None
    parts = [data[off : off + length] for off, length, _ in (record.manifest, record.values)]
    return _checked(record, parts, data, name)


def _checked(record: Record, parts: list[bytes], data: bytes, name: str) -> tuple[Record, dict, dict, bytes]:
    for what, (_, length, crc), raw in zip(("manifest", "values"), (record.manifest, record.values), parts):
        if len(raw) != length:
            raise BadSlot(f"{name}: its {what} lies past the end of the file")
        if zlib.crc32(raw) != crc:
            raise BadSlot(f"{name}: its {what} fail their CRC-32")
    try:
        # Without the data, the manifest is not needed: parsing it is the largest part of looking at a slot.
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
    """The manifest's layout inside the data region, and the region's checksum: before any tensor is viewed."""
    off, length, want = record.data
    if off < HEADER or off + length > len(data):
        raise BadSlot(f"{name}: its data region ({length} bytes at {off}) lies past the end of the file ({len(data)})")
    if manifest.get("data_size") != length:
        raise BadSlot(f"{name}: its manifest's data size is not its record's ({length} bytes)")
    try:
        specs(manifest, length)
        got = checksum(memoryview(data)[off : off + length])
    except ValueError as err:
        raise BadSlot(f"{name}: {err}") from None
    if got != want:
        raise BadSlot(f"{name}: its tensors' bytes fail their checksum (changed since they were saved)")


def specs(manifest: dict, region_size: int) -> list[Spec]:
    """The manifest's tensor layout, each checked to lie inside a region of ``region_size`` bytes."""
    return checked_specs(manifest.get("specs"), region_size)


def tensors_of(data: bytes | memoryview, record: Record, manifest: dict) -> list[torch.Tensor]:
    """Copies of a slot's tensors (the slot may be overwritten later), from :func:`read_slot`'s checked parts."""
    region = _region(data, record)
    try:
        layout = specs(manifest, region.numel())
    except ValueError as err:
        raise BadSlot(str(err)) from None
    # Each its own tensor: some consumers (torch.set_rng_state) read a tensor's storage from its start.
    return [v.clone() for v in views(region, layout)]
