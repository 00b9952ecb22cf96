"""Streams of files and iterables: JSON Lines files, flat token files, and a source that can only be
iterated.

Each is a :class:`~ddpkit.data._stream.Stream`: it knows its records' count per shard before
reading, and reads records by position, so the loader gives every rank its slice of each global
batch in the global order of ``(seed, epoch)``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddpkit._errors import ConfigError
from ddpkit.data import _line_cache as line_cache
from ddpkit.data import _source_checks as source_checks
from ddpkit.data._stream import DEFAULT_WINDOW, Stream, Transform
from ddpkit.distributed import Group


def _paths(paths: str | os.PathLike | Sequence[str | os.PathLike], what: str) -> list[Path]:
    found = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    if not found:
        raise ConfigError(f"{what}: no file given; pass a path or a list of paths (one shard each)")
    for p in found:
        if not p.is_file():
            raise ConfigError(f"{what}: {p} is not a file; pass existing files (one shard each)")
    return found


# 3: the header holds the digest of the file's content, not its modification time
_INDEX_VERSION = 3


def line_index(path: Path, cache: bool = True) -> np.ndarray:
    """``(L, 2)`` start and end byte offsets of the ``L`` non-empty lines of ``path`` (end excludes
    ``\\n``): :func:`indexed_lines` without the content's digest."""
    return indexed_lines(path, cache)[0]


def indexed_lines(path: Path, cache: bool = True) -> tuple[np.ndarray, str]:
    """The line index of ``path`` (:func:`line_index`) and the digest of the bytes it was found in
    (:func:`content_digest`), both checked against the file's bytes now.

    Built by one pass over the file (newlines found by numpy, 16 MiB at a time, the bytes hashed on
    the way) and kept next to it as ``.<name>.lines`` (raw int64: a 2-row header of version, file
    size, the content's digest and a checksum of the offsets, then the offsets; written atomically,
    read memory-mapped, so the page cache shares it among ranks and workers). 16 bytes a line. Where
    the folder is not writable, or the index there cannot be trusted
    (:mod:`ddpkit.data._line_cache`), it stays in memory.

    A kept index is used only for the bytes it was built from: the file is hashed (one pass, no
    newline search) and the digest compared with the header's. Its size and modification time prove
    nothing: a file rewritten at the same size with its time put back (``cp -p``, ``tar x``,
    ``rsync -t``) read at the old offsets gives records cut in the wrong places. Cost: reading the
    file once per process that builds a stream (``bench/data_fingerprint.py``), twice where a kept
    index is stale.
    """
    size = path.stat().st_size
    cached = path.with_name(f".{path.name}.lines")
    # else another user's index could be used
    cache = cache and line_cache.trusted_folder(path.parent)
    if cache and os.path.lexists(cached):
        content = content_digest(path)
        if (table := line_cache.read(cached, index_header(size, content), size)) is not None:
            return table, content
    hasher = _content_hasher()
    lines = _scan_lines(path, hasher)
    content = hasher.hexdigest()[:16]
    if cache:
        # ranks building it at once each write it whole
        line_cache.write(cached, index_header(size, content), lines)
    return lines, content


def index_header(size: int, content: str) -> np.ndarray:
    """The header a kept line index of a file of ``size`` bytes and content digest ``content`` must
    hold (its last item, the offsets' checksum, left 0: :func:`~ddpkit.data._line_cache.write` fills
    it in)."""
    as_int = int.from_bytes(bytes.fromhex(content), "little", signed=True)
    return np.array([[_INDEX_VERSION, size], [as_int, 0]], dtype=np.int64)


def _content_hasher() -> Any:
    # SHA-256 rather than the fingerprint's BLAKE2b: with the SHA extensions of current x86 and ARM
    # cores it hashes about 3x faster (1.4 GB/s against 0.46 on the CI machine), and a file's digest
    # is read at that speed.
    return hashlib.sha256()


def content_digest(path: Path) -> str:
    """A short hex digest (16 characters) of the bytes of ``path``, read in one pass."""
    hasher = _content_hasher()
    with open(path, "rb", buffering=0) as f:
        buffer = memoryview(bytearray(_CHUNK))
        while n := f.readinto(buffer):
            hasher.update(buffer[:n])
    return str(hasher.hexdigest()[:16])


_CHUNK = 1 << 24


def _scan_lines(path: Path, hasher: Any = None) -> np.ndarray:
    """The line index of ``path`` found in its bytes (``hasher`` updated with them on the way)."""
    ends = []
    with open(path, "rb", buffering=0) as f:
        base = 0
        while chunk := f.read(_CHUNK):
            if hasher is not None:
                hasher.update(chunk)
            ends.append(np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10) + base)
            base += len(chunk)
    stops = np.concatenate([*ends, np.zeros(0, np.int64)]).astype(np.int64)
    starts = np.concatenate([[0], stops + 1])
    if starts[-1] >= base:  # the file ends with a newline: no line after it
        starts = starts[:-1]
    else:
        stops = np.concatenate([stops, [base]])
    lines = np.stack([starts, stops], axis=1)
    return lines[lines[:, 1] > lines[:, 0]]  # empty lines are no records


def _runs(spans: list[list[int]], gap: int = 4096, most: int = 1 << 20) -> list[list[int]]:
    """Indices of ``spans`` (``[start, stop)`` byte ranges) grouped into runs, by start, that one
    read covers: lines at most ``gap`` bytes apart and ``most`` bytes in all. In order, a batch is
    one read; shuffled within a block, about one read a line."""
    runs: list[list[int]] = []
    for k in sorted(range(len(spans)), key=lambda k: spans[k][0]):
        start, stop = spans[k]
        if runs and start - spans[runs[-1][-1]][1] <= gap and stop - spans[runs[-1][0]][0] <= most:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


def json_record(raw: bytes) -> Any:
    """A line's JSON value (``json.loads`` of bytes first guesses their encoding; JSON Lines are
    UTF-8)."""
    return _DECODER.decode(raw.decode("utf-8"))


_DECODER = json.JSONDecoder()


class JsonlStream(Stream):
    """JSON Lines files, one shard each, a record per non-empty line (``decode(bytes)``,
    :func:`json_record` by default). Lines are found by :func:`line_index`; nearby lines of a batch
    are read with one ``pread``."""

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        transform: Transform | None = None,
        window: int = DEFAULT_WINDOW,
        decode: Callable[[bytes], Any] = json_record,
        cache_index: bool = True,
    ) -> None:
        super().__init__(transform=transform, window=window)
        self.paths = _paths(paths, "JsonlStream")
        self.decode = decode
        indexed = [indexed_lines(p, cache_index) for p in self.paths]
        self.lines = [lines for lines, _ in indexed]
        self._contents = [content for _, content in indexed]
        self._bytes = [p.stat().st_size for p in self.paths]

    def shard_descriptions(self) -> list[str]:
        """Each file's name, records, bytes and the digest of its content, read when the stream was
        built: the content decides where each record lies and which record it is."""
        return [
            f"{p.name}: {len(lines)} records, {size} bytes, content {content}"
            for p, lines, size, content in zip(self.paths, self.lines, self._bytes, self._contents)
        ]

    @property
    def shard_sizes(self) -> Sequence[int]:
        return [len(lines) for lines in self.lines]

    def read(self, shard: int, indices: np.ndarray) -> list[Any]:
        fd = self.opened(shard, lambda: os.open(self.paths[shard], os.O_RDONLY), os.close)
        spans = self.lines[shard][indices].tolist()
        out: list[Any] = [None] * len(spans)
        for run in _runs(spans):
            first, last = spans[run[0]][0], spans[run[-1]][1]
            raw = os.pread(fd, last - first, first)
            for k in run:
                start, stop = spans[k]
                try:
                    out[k] = self.decode(raw[start - first : stop - first])
                except ValueError as err:
                    raise ValueError(
                        f"{self.paths[shard]}: the line at byte {start} is not JSON ({err})"
                    ) from None
        return out


class TokenStream(Stream):
    """Flat token files (numpy's ``tofile`` of ``dtype``), one shard each; record ``k`` of a file is
    tokens ``[k * seq_len, (k + 1) * seq_len)`` as an int64 tensor (a file's last, shorter piece is
    left out).

    For next-token prediction pass ``seq_len = context + 1`` and split a record into ``r[:-1]`` and
    ``r[1:]``.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        seq_len: int,
        *,
        dtype: Any = np.uint16,
        transform: Transform | None = None,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        super().__init__(transform=transform, window=window)
        if seq_len < 1:
            raise ConfigError(f"seq_len={seq_len}: a record needs at least one token")
        self.paths, self.seq_len, self.dtype = (
            _paths(paths, "TokenStream"),
            seq_len,
            np.dtype(dtype),
        )
        self._tokens = []
        for p in self.paths:
            size = p.stat().st_size
            if size % self.dtype.itemsize:
                raise ConfigError(
                    f"TokenStream: {p} has {size} bytes, not a whole number of {self.dtype} tokens "
                    f"({self.dtype.itemsize} bytes each): pass the dtype it was written with"
                )
            self._tokens.append(size // self.dtype.itemsize)

    @property
    def shard_sizes(self) -> Sequence[int]:
        return [n // self.seq_len for n in self._tokens]

    def shard_descriptions(self) -> list[str]:
        return [f"{p.name}: {n} tokens of {self.dtype}" for p, n in zip(self.paths, self._tokens)]

    def fingerprint(self) -> dict[str, Any]:
        return super().fingerprint() | {"seq_len": self.seq_len}

    def read(self, shard: int, indices: np.ndarray) -> list[Any]:
        tokens = self.opened(
            shard, lambda: np.memmap(self.paths[shard], dtype=self.dtype, mode="r")
        )
        t = self.seq_len
        return [
            torch.from_numpy(tokens[k * t : (k + 1) * t].astype(np.int64)) for k in indices.tolist()
        ]


class IterableStream(Stream):
    """A source that can only be iterated, read front to back: the fallback for data without
    positional reads.

    Which sources work. Every rank and every loader worker reads the source from its start, every
    epoch, and keeps its own batches; so each ``iter()``, in any process, must yield every record in
    the same order:

    - a re-iterable: a list, a torch ``IterableDataset`` whose ``__iter__`` starts again, a
      ``datasets`` ``IterableDataset`` with ``num_workers=0`` (with loader workers it hands each a
      share: refused);
    - a callable returning a fresh iterator: ``IterableStream(make_records, n)``, ``make_records`` a
      generator function (called once a pass).

    Refused: an iterator that is its own iterable (a generator object: ``iter(x) is x``), spent
    after one pass; a source whose first :data:`~ddpkit.data._source_checks.HEAD_RECORDS` records
    differ between two passes here or between ranks (checked once, when the loader is built); one
    that splits itself by rank or loader worker (it ends early: the read raises). Later differences
    between processes cannot be seen.

    ``num_records``: its length; without it (and without ``len()``) it is counted by one pass here.
    Cost: each loader worker of each rank (or each rank's main process) reads the stream from its
    start every epoch, and after a resume up to the cursor, keeping only its own batches; it holds
    one to two ``window`` blocks of records. A source that ends early raises; records past
    ``num_records`` are left out.
    """

    random_access = False

    def __init__(
        self,
        dataset: Iterable[Any] | Callable[[], Iterable[Any]],
        num_records: int | None = None,
        *,
        transform: Transform | None = None,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        super().__init__(transform=transform, window=window)
        self.dataset = dataset
        self._calls = source_checks.is_factory(dataset)
        if num_records is None:
            num_records = (
                len(dataset)  # type: ignore[arg-type]
                if hasattr(dataset, "__len__")
                else sum(1 for _ in self._start())
            )
        if num_records < 0:
            raise ConfigError(f"num_records={num_records}: a stream's length cannot be negative")
        self.num_records = int(num_records)
        self._head_count = min(self.num_records, source_checks.HEAD_RECORDS)
        self._head = source_checks.head_digest(self._start, self._head_count)

    @property
    def shard_sizes(self) -> Sequence[int]:
        return [self.num_records]

    def _start(self) -> Iterator[Any]:
        """A fresh pass over the source."""
        source: Any = self.dataset
        return iter(source() if self._calls else source)

    def shard_descriptions(self) -> list[str]:
        """The source's name, records, and the digest of its first records (what a pass yields
        first: the order beyond them is not seen)."""
        name = getattr(self.dataset, "__name__", type(self.dataset).__name__)
        return [f"{name}: {self.num_records} records, first {self._head_count} {self._head}"]

    def check_loading(self, num_workers: int, world_size: int, group: Group) -> None:
        source_checks.check_workers(self.dataset, num_workers)
        if world_size > 1:
            source_checks.check_same_order(self._head, self._head_count, group)

    def read(self, shard: int, indices: np.ndarray) -> list[Any]:
        # Invariant: buffer holds records [base, next) of the pass that ``it`` makes. A batch needs
        # records of one or two blocks; later batches of this process need later blocks only, so
        # what lies before the block of the lowest index is dropped. A lower index than that (a new
        # epoch, a resume) starts a pass.
        state = self.local()
        wanted = indices.tolist()
        low, high = min(wanted), max(wanted)
        if not state or low < state["base"]:
            state.update(it=self._start(), base=0, next=0, buffer=[])
        floor = low - low % self.window
        drop = min(floor, state["next"]) - state["base"]
        if drop > 0:
            del state["buffer"][:drop]
            state["base"] += drop
        while state["next"] <= high:
            try:
                record = next(state["it"])
            except StopIteration:
                raise ConfigError(
                    f"IterableStream: the stream ended after {state['next']} records, num_records "
                    f"is {self.num_records}: it must yield every record in every process (an "
                    "IterableDataset that splits itself by get_worker_info() or by rank yields a "
                    "part), or num_records is too large"
                ) from None
            if state["next"] >= floor:
                state["buffer"].append(record)
            else:
                state["base"] += 1
            state["next"] += 1
        return [state["buffer"][i - state["base"]] for i in wanted]
