"""A snapshot folder's torch.distributed.checkpoint (DCP) files, written and read without
unpickling: tensors only, the index also written as JSON (``metadata.json``), checked
(:func:`index_from_json`, :func:`check_chunks`) and read instead of the pickled ``.metadata``.
Writes go through a file system that keeps a failed write's ``OSError`` (torch's zip writer turns a
full disk into ``unexpected pos 704 vs 598``).
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import itertools
import json
import math
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._internals.dcp import set_file_system, storage_info, transformed
from ddpkit.snapshot import _folders as folders
from ddpkit.snapshot._codec import capped_numel
from ddpkit.snapshot._folders import INDEX, read_bounded

_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")
# JSON of a tensor's place per chunk: ~200 bytes each; a GiB is millions of chunks
_INDEX_LIMIT = 1 << 30


class BadIndex(ValueError):
    """The JSON index is not one :func:`index_to_json` wrote: what is wrong with it."""


class _ErrnoKeepingStream:
    """A file that records a failed write's path and OSError before torch's serializer hides it."""

    def __init__(self, stream: Any, path: Path, failures: list[tuple[Path, OSError]]) -> None:
        self._stream, self._path, self._failures = stream, path, failures

    def __getattr__(self, name: str) -> Any:  # tell, fileno, seek...: the file's own
        call = getattr(self._stream, name)
        if name not in ("write", "flush", "close"):
            return call

        def kept(*args: Any) -> Any:
            try:
                return call(*args)
            except OSError as err:
                self._failures.append((self._path, err))
                raise

        return kept


class _ErrnoKeepingFileSystem(FileSystem):
    def __init__(self, failures: list[tuple[Path, OSError]]) -> None:
        super().__init__()
        self.failures = failures

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        try:
            with _open_stream(Path(path), mode) as stream:
                yield _ErrnoKeepingStream(stream, Path(path), self.failures)
        except OSError as err:  # opening, or the flush of close()
            if not any(e is err for _, e in self.failures):
                self.failures.append((Path(path), err))
            raise

    # DCP's own path calls follow links; these go through ddpkit._fs, as every write of ddpkit does.
    def rename(self, path: Any, new_path: Any) -> None:
        fs.rename(Path(path), Path(new_path))

    def mkdir(self, path: Any) -> None:
        fs.make_dirs(Path(path))

    def rm_file(self, path: Any) -> None:
        fs.remove(Path(path), missing_ok=False)


def _open_stream(path: Path, mode: str) -> IO[bytes]:
    """A file of a snapshot: this user's regular file, opened never through a link."""
    flags = {"rb": os.O_RDONLY, "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC}.get(mode)
    if flags is None:
        raise ValueError(f"{path}: mode {mode!r} is not one a snapshot file is opened in")
    return os.fdopen(fs.open_fd(path, flags, linked="replace"), mode)


class Writer(FileSystemWriter):
    """DCP's file writer, adding the JSON index next to ``.metadata`` and keeping the OS errors of
    its writes in ``failures`` (this rank's, in order)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)  # one file per rank, fsynced
        self.failures: list[tuple[Path, OSError]] = []
        set_file_system(self, _ErrnoKeepingFileSystem(self.failures))

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        super().finish(metadata, results)  # the pickled index, .metadata
        # where each item went, from the results: torch 2.13 fills it into ``metadata``, not before
        where = {result.index: result.storage_data for per_rank in results for result in per_rank}
        metadata = dataclasses.replace(metadata, storage_data=where)
        try:
            fs.write_atomic(Path(self.path) / INDEX, json.dumps(index_to_json(metadata)).encode())
        except OSError as err:
            self.failures.append((Path(self.path) / INDEX, err))
            raise


def index_to_json(metadata: Metadata) -> dict[str, Any]:
    """The parts of DCP's ``Metadata`` a load needs, as JSON values; non-tensor items refused."""
    tensors = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise TypeError(
                f"snapshot item {fqn!r} is not a tensor: only tensors go into DCP files"
            )
        if md.properties.layout != torch.strided:
            raise TypeError(
                f"snapshot item {fqn!r} has layout {md.properties.layout}: only strided tensors"
            )
        tensors[fqn] = {
            "dtype": str(md.properties.dtype).removeprefix("torch."),
            "size": list(md.size),
            "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in md.chunks],
        }
    storage = []
    for index, info in metadata.storage_data.items():
        if transformed(info):
            raise TypeError(
                f"snapshot item {index.fqn!r} was written through a stream transform: not supported"
            )
        storage.append(
            {
                "fqn": index.fqn,
                "offset": None if index.offset is None else list(index.offset),
                "file": info.relative_path,
                "at": info.offset,
                "length": info.length,
            }
        )
    paths = {k: list(v) for k, v in (metadata.planner_data or {}).items()}
    # Metadata.version: DCP's format version, recorded from torch 2.7 on.
    return {
        "version": getattr(metadata, "version", None),
        "tensors": tensors,
        "storage": storage,
        "paths": paths,
    }


_NUMEL_LIMIT = 2**63 - 1  # a tensor's number of elements is an int64 in torch
_SPLIT_DIMS = 4  # the check costs 2**(dimensions split) corners a chunk


def _corners(
    chunk: ChunkStorageMetadata, split: list[int], sign: int
) -> Iterator[tuple[tuple[int, ...], int]]:
    """(corner, weight) of the box ``chunk`` in the dimensions ``split`` (:func:`check_chunks`)."""
    ends = [((chunk.offsets[k], 1), (chunk.offsets[k] + chunk.sizes[k], -1)) for k in split]
    for combo in itertools.product(*ends):
        yield tuple(p for p, _ in combo), sign * math.prod(w for _, w in combo)


def check_chunks(
    fqn: str, size: torch.Size, chunks: list[ChunkStorageMetadata]
) -> list[ChunkStorageMetadata]:
    """The chunks of a tensor cover it exactly once (else DCP would leave a part uncovered as the
    fresh model's, without a word); returns the chunks that hold elements. In O(m log m) for the m
    corners of the chunks: they tile the tensor exactly when the signed weights of equal corners
    cancel, the tensor's counted negatively (docs/snapshots.md, "Reading a folder"); the first
    corner left with a weight is an element covered twice (> 0) or never."""
    numel = capped_numel(size, _NUMEL_LIMIT)
    if numel > _NUMEL_LIMIT:
        raise BadIndex(f"tensor {fqn!r} of shape {list(size)[:8]} has more than 2**63 - 1 elements")
    full, total = [], 0
    for chunk in chunks:
        if len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size):
            raise BadIndex(
                f"tensor {fqn!r} of shape {list(size)} has a chunk of another number of dimensions"
            )
        if any(o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, size)):
            raise BadIndex(
                f"tensor {fqn!r} of shape {list(size)} has a chunk at {list(chunk.offsets)} of "
                f"{list(chunk.sizes)} that lies outside it"
            )
        volume = capped_numel(
            chunk.sizes, _NUMEL_LIMIT
        )  # inside the tensor: at most its number of elements
        if volume:
            full.append(chunk)
            total += volume
    if total != numel:
        raise BadIndex(
            f"tensor {fqn!r} of shape {list(size)} has chunks covering {total} of its {numel} "
            "elements"
        )
    if not numel:
        return full
    split = [k for k, s in enumerate(size) if any(c.offsets[k] or c.sizes[k] != s for c in full)]
    if len(split) > _SPLIT_DIMS:
        raise BadIndex(
            f"tensor {fqn!r} of shape {list(size)} is split along {len(split)} dimensions, more "
            f"than the {_SPLIT_DIMS} a snapshot's chunks split a tensor along"
        )
    whole = ChunkStorageMetadata(torch.Size([0] * len(size)), size)
    corners = [c for chunk in full for c in _corners(chunk, split, 1)]
    corners += _corners(whole, split, -1)
    corners.sort(key=lambda c: c[0])
    residual = _first_residual(corners)
    if residual is not None:
        element = [0] * len(size)
        for k, p in zip(split, residual[0]):
            element[k] = p
        if residual[1] > 0:
            raise BadIndex(f"tensor {fqn!r} has two chunks that overlap, at element {element}")
        raise BadIndex(
            f"tensor {fqn!r} has chunks that leave element {element} uncovered (and overlap "
            f"elsewhere: their sizes add up to its {numel} elements)"
        )
    return full


def _first_residual(corners: list[tuple[tuple[int, ...], int]]) -> tuple[Any, int] | None:
    """The first of the sorted ``corners`` whose weights do not cancel, with its weight."""
    for point, equal in itertools.groupby(corners, key=lambda c: c[0]):
        if weight := sum(w for _, w in equal):
            return point, weight
    return None


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
        raise BadIndex(f"{what} is not a list of non-negative integers")
    return value


def _dtype(name: Any, fqn: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise BadIndex(f"tensor {fqn!r} has an unknown dtype {name!r}")
    return dtype


def _among(ordered: list[Any], key: Any) -> bool:
    at = bisect.bisect_left(ordered, key)
    return at < len(ordered) and ordered[at] == key


def index_from_json(data: Any) -> Metadata:
    """DCP's ``Metadata`` from :func:`index_to_json`'s output, checked (tensors only, files of this
    folder only, sizes and offsets as integers); :class:`BadIndex` naming the problem."""
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("tensors"), dict)
        or not isinstance(data.get("storage"), list)
    ):
        raise BadIndex("it is not an index of tensors")
    state, holding, empty = _tensor_entries(data["tensors"])
    storage = _storage_entries(data["storage"], state, holding, empty)
    paths = data.get("paths") or {}
    if not isinstance(paths, dict) or not all(
        isinstance(p, list) and all(type(k) in (str, int) for k in p) for p in paths.values()
    ):
        raise BadIndex("its key paths are malformed")
    version = data.get("version") if isinstance(data.get("version"), str) else None
    found = Metadata(
        state,  # type: ignore[arg-type]
        planner_data={k: tuple(v) for k, v in paths.items()},
        storage_data=storage,
        storage_meta=StorageMeta(),
    )
    if version is not None and hasattr(found, "version"):  # a field from torch 2.7 on
        found.version = version
    return found


Chunk = tuple[str, tuple[int, ...]]  # (tensor, offsets)


def _tensor_entries(
    tensors: dict[str, Any],
) -> tuple[dict[str, TensorStorageMetadata], list[Chunk], list[Chunk]]:
    """Each tensor's metadata, its chunks checked, and the sorted chunks that hold elements and
    those that hold none."""
    state: dict[str, TensorStorageMetadata] = {}
    holding: list[Chunk] = []
    empty: list[Chunk] = []
    for fqn, md in tensors.items():
        if not isinstance(md, dict) or not isinstance(md.get("chunks"), list):
            raise BadIndex(f"item {fqn!r} is not a tensor")
        if not all(isinstance(c, dict) for c in md["chunks"]):
            raise BadIndex(f"tensor {fqn!r} has a malformed chunk")
        chunks = [
            ChunkStorageMetadata(
                torch.Size(_ints(c.get("offsets"), fqn)), torch.Size(_ints(c.get("sizes"), fqn))
            )
            for c in md["chunks"]
        ]
        size = torch.Size(_ints(md.get("size"), fqn))
        full = check_chunks(fqn, size, chunks)
        state[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=_dtype(md.get("dtype"), fqn)), size, full
        )
        holding.extend((fqn, tuple(c.offsets)) for c in full)
        empty.extend((fqn, tuple(c.offsets)) for c in chunks if 0 in c.sizes)
    # found by sorting, never by hashing: offsets chosen to collide would make lookups quadratic
    return state, sorted(holding), sorted(empty)


def _storage_entries(
    entries: list[Any],
    state: dict[str, TensorStorageMetadata],
    holding: list[Chunk],
    empty: list[Chunk],
) -> dict[MetadataIndex, Any]:
    """Where each chunk that holds elements is stored: every one exactly, in a data file."""
    storage = {}
    for entry in entries:
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("fqn"), str)
            or entry["fqn"] not in state
        ):
            raise BadIndex("a storage entry names no tensor of the index")
        fqn, name = entry["fqn"], entry.get("file")
        if not isinstance(name, str) or not _DATA_FILE.match(name):
            raise BadIndex(
                f"tensor {fqn!r} is said to be in {name!r}, not a data file of the folder"
            )
        offset = torch.Size(_ints(entry.get("offset"), fqn))
        at, length = _ints([entry.get("at"), entry.get("length")], fqn)
        if _among(holding, (fqn, tuple(offset))):
            storage[MetadataIndex(fqn, offset)] = storage_info(name, at, length)
        elif not _among(empty, (fqn, tuple(offset))):  # an empty chunk's loads nothing
            raise BadIndex(
                f"tensor {fqn!r} has a storage entry at {list(offset)[:8]} where it has no chunk"
            )
    for fqn, md in state.items():
        for chunk in md.chunks:
            if MetadataIndex(fqn, chunk.offsets) not in storage:
                raise BadIndex(
                    f"tensor {fqn!r} has a chunk at {list(chunk.offsets)} that no data file holds"
                )
    return storage


class Reader(FileSystemReader):
    """DCP's file reader over an index already read and checked (:func:`read_marked_index`):
    ``.metadata`` is never opened. Tensors are read by torch with ``weights_only=True``."""

    def __init__(self, path: Path, index: Metadata) -> None:
        super().__init__(path)
        self._index = index

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            # DCP retries with a rank's own index when the global one fails: there is none
            raise BadIndex("snapshot folders have one index, not one per rank")
        return self._index


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, without its unpickling of non-tensor items (none is indexed)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise BadIndex(
            f"item {read_item.dest_index.fqn!r} is not a tensor: refusing to unpickle it"
        )


def read_marked_index(folder: Path) -> Any:
    """DCP's index of the snapshot, refused unless the marker lists it and every file it reads."""
    try:
        # checked against the marker (by rank 0, in latest()) only if the marker lists them
        files = folders.listed(folders.Found(0, folder))
        if folders.INDEX not in files:
            raise BadIndex(f"{folders.MARKER} does not list it")
        try:
            data = json.loads(read_bounded(folder / INDEX, _INDEX_LIMIT))
        except (ValueError, RecursionError) as err:  # RecursionError: nested too deep
            raise BadIndex(f"it is not JSON ({err})") from None
        index = index_from_json(data)
        for info in index.storage_data.values():
            if info.relative_path not in files:
                raise BadIndex(
                    f"it reads {info.relative_path}, which {folders.MARKER} does not list"
                )
        return index
    except (BadIndex, OSError, ValueError) as err:
        raise ConfigError(
            f"{folder / folders.INDEX} is not an index ddpkit wrote ({err}): refusing to load "
            f"{folder}. Remove it to resume from the snapshot before it"
        ) from None
