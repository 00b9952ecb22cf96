"""Streams of files and iterables: JSON Lines files, flat token files, and a source that can only be iterated.

Each is a :class:`~ddpkit.data.stream.Stream`: it knows its records' count per shard before reading, and reads
records by position, so the loader gives every rank its slice of each global batch in the global order of
``(seed, epoch)``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddpkit.data import line_cache, source_checks
from ddpkit.data.fingerprint import digest
from ddpkit.data.stream import DEFAULT_WINDOW, Stream, Transform
from ddpkit.errors import ConfigError


def _paths(paths: str | os.PathLike | Sequence[str | os.PathLike], what: str) -> list[Path]:
    found = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    if not found:
        raise ConfigError(f"{what}: no file given; pass a path or a list of paths (one shard each)")
    for p in found:
        if not p.is_file():
            raise ConfigError(f"{what}: {p} is not a file; pass existing files (one shard each)")
    return found


_INDEX_VERSION = 2  # 2: the header holds a checksum of the offsets


def line_index(path: Path, cache: bool = True) -> np.ndarray:
    """``(L, 2)`` start and end byte offsets of the ``L`` non-empty lines of ``path`` (end excludes ``\\n``).

    Built once by one pass over the file (newlines found by numpy, 16 MiB at a time) and kept next to it as
    ``.<name>.lines`` (raw int64: a 2-row header of version, file size, modification time and a checksum
    of the offsets, then the offsets; written atomically, read memory-mapped, so the page cache shares it among ranks and workers),
    valid while the file's size and modification time are those it records; where the folder is not writable,
    or the index there cannot be trusted (:mod:`ddpkit.data.line_cache`), it stays in memory. 16 bytes a
    line. The first run's ranks each build it (and write the same file); later runs open it.
    """
    stat = path.stat()
    header = np.array([[_INDEX_VERSION, stat.st_size], [stat.st_mtime_ns, 0]], dtype=np.int64)  # 0: the sum
    cached = path.with_name(f".{path.name}.lines")
    cache = cache and line_cache.trusted_folder(path.parent)  # else another user's index could be used
    if cache and (table := line_cache.read(cached, header, stat.st_size)) is not None:
        return table
    lines = _scan_lines(path)
    if cache:
        line_cache.write(cached, header, lines)  # ranks building it at once each write it whole
    return lines


def line_digest(lines: np.ndarray) -> str:
    """A digest of a line index (:func:`line_index`): where each record of a file lies, for the data's
    fingerprint (:mod:`ddpkit.data.fingerprint`)."""
    return digest(np.ascontiguousarray(lines, dtype=np.int64).view(np.uint8).data)


def _scan_lines(path: Path) -> np.ndarray:
    ends = []
    with open(path, "rb", buffering=0) as f:
        base = 0
        while chunk := f.read(1 << 24):
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
    """Indices of ``spans`` (``[start, stop)`` byte ranges) grouped into runs, by start, that one read covers:
    lines at most ``gap`` bytes apart and ``most`` bytes in all. In order, a batch is one read; shuffled within
    a block, about one read a line."""
    runs: list[list[int]] = []
    for k in sorted(range(len(spans)), key=lambda k: spans[k][0]):
        start, stop = spans[k]
        if runs and start - spans[runs[-1][-1]][1] <= gap and stop - spans[runs[-1][0]][0] <= most:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


def json_record(raw: bytes) -> Any:
    """A line's JSON value (``json.loads`` of bytes first guesses their encoding; JSON Lines are UTF-8)."""
    return _DECODER.decode(raw.decode("utf-8"))


_DECODER = json.JSONDecoder()


class JsonlStream(Stream):
    """JSON Lines files, one shard each, a record per non-empty line (``decode(bytes)``, :func:`json_record`
    by default). Lines are found by :func:`line_index`; nearby lines of a batch are read with one ``pread``."""

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
        self.lines = [line_index(p, cache_index) for p in self.paths]
        self._bytes = [p.stat().st_size for p in self.paths]
        self._described: list[str] | None = None

    def shard_descriptions(self) -> list[str]:
        """Each file's name, records, bytes and a digest of its line index (where each record lies). Hashing
        16 bytes a line (3.5 s a 100 million lines on a 2-core machine) is done once, at the first snapshot or
        resume."""
        if self._described is None:
            self._described = [
                f"{p.name}: {len(lines)} records, {size} bytes, line index {line_digest(lines)}"
                for p, lines, size in zip(self.paths, self.lines, self._bytes)
            ]
        return self._described

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
                    raise ValueError(f"{self.paths[shard]}: the line at byte {start} is not JSON ({err})") from None
        return out


class TokenStream(Stream):
    """Flat token files (numpy's ``tofile`` of ``dtype``), one shard each; record ``k`` of a file is tokens
    ``[k * seq_len, (k + 1) * seq_len)`` as an int64 tensor (a file's last, shorter piece is left out).

    For next-token prediction pass ``seq_len = context + 1`` and split a record into ``r[:-1]`` and ``r[1:]``.
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
        self.paths, self.seq_len, self.dtype = _paths(paths, "TokenStream"), seq_len, np.dtype(dtype)
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
        tokens = self.opened(shard, lambda: np.memmap(self.paths[shard], dtype=self.dtype, mode="r"))
        t = self.seq_len
        return [torch.from_numpy(tokens[k * t : (k + 1) * t].astype(np.int64)) for k in indices.tolist()]


class IterableStream(Stream):
    """A source that can only be iterated, read front to back: the fallback for data without positional reads.

    Which sources work. Every rank and every loader worker reads the source from its start, every epoch, and
    keeps its own batches; so each ``iter()``, in any process, must yield every record in the same order:

    - a re-iterable: a list, a torch ``IterableDataset`` whose ``__iter__`` starts again, a ``datasets``
      ``IterableDataset`` with ``num_workers=0`` (with loader workers it hands each a share: refused);
    - a callable returning a fresh iterator: ``IterableStream(make_records, n)``, ``make_records`` a generator
      function (called once a pass).

    Refused: an iterator that is its own iterable (a generator object: ``iter(x) is x``), spent after one pass;
    a source whose first :data:`~ddpkit.data.source_checks.HEAD_RECORDS` records differ between two passes
    here or between ranks (checked once, when the loader is built); one that splits itself by rank or loader
    worker (it ends early: the read raises). Later differences between processes cannot be seen.

    ``num_records``: its length; without it (and without ``len()``) it is counted by one pass here. Cost: each
    loader worker of each rank (or each rank's main process) reads the stream from its start every epoch, and
    after a resume up to the cursor, keeping only its own batches; it holds one to two ``window`` blocks of
    records. A source that ends early raises; records past ``num_records`` are left out.
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
            num_records = len(dataset) if hasattr(dataset, "__len__") else sum(1 for _ in self._start())  # type: ignore[arg-type]
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
        return [f"{getattr(self.dataset, '__name__', type(self.dataset).__name__)}: {self.num_records} records"]

    def check_loading(self, num_workers: int, world_size: int, group: Any) -> None:
        source_checks.check_workers(self.dataset, num_workers)
        if world_size > 1:
            source_checks.check_same_order(self._head, self._head_count, group)

    def read(self, shard: int, indices: np.ndarray) -> list[Any]:
        # Invariant: buffer holds records [base, next) of the pass that ``it`` makes. A batch needs records of
        # one or two blocks; later batches of this process need later blocks only, so what lies before the
        # block of the lowest index is dropped. A lower index than that (a new epoch, a resume) starts a pass.
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
                    f"IterableStream: the stream ended after {state['next']} records, num_records is "
                    f"{self.num_records}: it must yield every record in every process (an IterableDataset that "
                    "splits itself by get_worker_info() or by rank yields a part), or num_records is too large"
                ) from None
            if state["next"] >= floor:
                state["buffer"].append(record)
            else:
                state["base"] += 1
            state["next"] += 1
        return [state["buffer"][i - state["base"]] for i in wanted]
