"""Streams of files and iterables: JSON Lines files, flat token files, and a source that can only be
iterated (docs/data.md, "Streams").
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ddpkit._errors import ConfigError, checked_arguments
from ddpkit.data._fingerprint import digest
from ddpkit.data._stream import DEFAULT_WINDOW, Stream, Transform
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import all_gather_object, tensor_bytes


def _paths(paths: str | os.PathLike | Sequence[str | os.PathLike], what: str) -> list[Path]:
    found = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    if not found:
        raise ConfigError(f"{what}: no file given; pass a path or a list of paths (one shard each)")
    for p in found:
        if not p.is_file():
            raise ConfigError(f"{what}: {p} is not a file; pass existing files (one shard each)")
    return found


def indexed_lines(path: Path) -> tuple[np.ndarray, str]:
    """The line index of ``path`` (``(L, 2)`` start and end byte offsets of its ``L`` non-empty
    lines, end excluding ``\\n``) and a short hex digest (16 characters) of the bytes it was found
    in, both from one pass over the file at every open. Not kept beside the file: the digest needs
    that pass anyway, and finding the newlines on the way adds a third to it (docs/data.md).
    """
    hasher = hashlib.sha256()  # not the fingerprint's BLAKE2b: faster with SHA extensions
    ends = []
    with open(path, "rb", buffering=0) as f:
        buffer, base = memoryview(bytearray(_CHUNK)), 0
        while n := f.readinto(buffer):
            hasher.update(buffer[:n])
            ends.append(np.flatnonzero(np.frombuffer(buffer, np.uint8, n) == 10) + base)
            base += n
    stops = np.concatenate([*ends, np.zeros(0, np.int64)]).astype(np.int64)
    starts = np.concatenate([[0], stops + 1])
    if starts[-1] >= base:  # the file ends with a newline: no line after it
        starts = starts[:-1]
    else:
        stops = np.concatenate([stops, [base]])
    lines = np.stack([starts, stops], axis=1)
    return lines[lines[:, 1] > lines[:, 0]], hasher.hexdigest()[:16]  # empty lines are no records


_CHUNK = 1 << 24


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
    return json.loads(raw.decode("utf-8"))


class JsonlStream(Stream):
    """JSON Lines files, one shard each, a record per non-empty line (``decode(bytes)``,
    :func:`json_record` by default). Lines are found by :func:`indexed_lines`; nearby lines of a
    batch are read with one ``pread``. ``cache_index`` is ignored, kept for scripts that pass it:
    the line index is built in memory at every open."""

    @checked_arguments
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
        indexed = [indexed_lines(p) for p in self.paths]
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

    @checked_arguments
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
        self.paths, self.seq_len = _paths(paths, "TokenStream"), seq_len
        self.dtype = np.dtype(dtype)
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
    """A source that can only be iterated, read front to back from its start by every rank and
    loader worker, every epoch: each ``iter()`` must yield every record in the same order (a
    re-iterable, or a callable returning a fresh iterator). What is refused: docs/data.md, "Which
    sources IterableStream reads". ``num_records``: its length; without it (and without ``len()``)
    it is counted by one pass here.
    """

    random_access = False

    @checked_arguments
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
        self._calls = is_factory(dataset)
        if num_records is None:
            num_records = (
                len(dataset)  # type: ignore[arg-type]
                if hasattr(dataset, "__len__")
                else sum(1 for _ in self._start())
            )
        if num_records < 0:
            raise ConfigError(f"num_records={num_records}: a stream's length cannot be negative")
        self.num_records = int(num_records)
        self._head_count = min(self.num_records, HEAD_RECORDS)
        self._head = head_digest(self._start, self._head_count)

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
        check_workers(self.dataset, num_workers)
        if world_size > 1:
            check_same_order(self._head, self._head_count, group)

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


# -- checks of a source that can only be iterated -------------------------------------------------

HEAD_RECORDS = 128
"""Records read (twice, at construction) and compared across ranks (once, by ``build_loader``)."""

FRESH_ITERATOR = (
    "pass a callable that returns a fresh iterator (IterableStream(make_records, n), make_records "
    "a generator function, not make_records()) or a re-iterable (a list, a torch Dataset)"
)


def is_factory(source: Any) -> bool:
    """Whether a pass over ``source`` starts with ``iter(source())`` (a callable) rather than
    ``iter(source)``. An iterator that is its own iterable (a generator object) is refused: a second
    pass finds it spent."""
    if not hasattr(source, "__iter__"):
        if callable(source):
            return True
        raise ConfigError(
            f"IterableStream: a {type(source).__name__} is neither iterable nor callable: "
            f"{FRESH_ITERATOR}"
        )
    # A torch IterableDataset may return itself from __iter__ after rewinding: the second pass of
    # head_digest shows whether it does.
    if not isinstance(source, torch.utils.data.IterableDataset) and iter(source) is source:
        raise ConfigError(
            f"IterableStream: a {type(source).__name__} is its own iterator, spent after one pass, "
            "and every epoch (and every loader worker) reads the source from its start: "
            f"{FRESH_ITERATOR}"
        )
    return False


def head_digest(start: Callable[[], Iterator[Any]], count: int) -> str:
    """A digest of the first ``count`` records of a pass; refused if a pass yields fewer (a spent
    iterator, or a length too large) or a second pass in this process differs."""
    passes = []
    for _ in range(2):
        parts = [canonical(record) for _, record in zip(range(count), start())]
        if len(parts) < count:
            raise ConfigError(
                f"IterableStream: a pass over the source yielded {len(parts)} records, num_records "
                f"asks for at least {count}: every epoch and loader worker reads it from its "
                f"start, so each pass must yield every record ({FRESH_ITERATOR}), and num_records "
                "must not exceed its length"
            )
        passes.append(digest(b"\0".join(parts)))
    if passes[0] != passes[1]:
        raise ConfigError(
            f"IterableStream: two passes over the source gave different first {count} records (or "
            "orders): every epoch and loader worker reads it from its start, so each pass must "
            f"yield the same records in the same order ({FRESH_ITERATOR}; seed any shuffle of its "
            "own the same way on every pass)"
        )
    return passes[0]


def canonical(value: Any) -> bytes:
    """Bytes that are equal for equal records in any process: dicts and sets in a sorted order
    (their own order follows each process's string hashing), tensors and arrays by dtype, shape and
    contents."""
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        return repr(value).encode()
    if isinstance(value, dict):
        return (
            b"{"
            + b",".join(sorted(canonical(k) + b":" + canonical(v) for k, v in value.items()))
            + b"}"
        )
    if isinstance(value, (set, frozenset)):
        return b"set(" + b",".join(sorted(canonical(v) for v in value)) + b")"
    if isinstance(value, (list, tuple)):
        return b"[" + b",".join(canonical(v) for v in value) + b"]"
    if isinstance(value, torch.Tensor):
        flat = value.detach().cpu().contiguous().reshape(-1)
        return f"{flat.dtype}{tuple(value.shape)}".encode() + tensor_bytes(flat)
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{value.shape}".encode() + np.ascontiguousarray(value).tobytes()
    try:
        return pickle.dumps(value, protocol=4)
    except Exception:  # an unpicklable record: compared by its type alone
        return type(value).__qualname__.encode()


def check_same_order(head: str, count: int, group: Group) -> None:
    """Refuse, on every rank alike, a source whose first ``count`` records differ between ranks (one
    all-gather of a 16-character digest)."""
    heads = all_gather_object(head, group=group)
    if len(set(heads)) > 1:
        ranks = [r for r, h in enumerate(heads) if h != heads[0]]
        raise ConfigError(
            f"IterableStream: the source's first {count} records differ between ranks (rank 0's "
            f"differ from rank {', '.join(map(str, ranks))}'s): every rank takes its share of one "
            "global order, so every process must iterate the same records in the same order; a "
            "source that iterates a set, shuffles with a seed of its own per process, or splits "
            "itself by rank does not. Sort or seed it alike on every rank, or give ddpkit the "
            "files (JsonlStream, TokenStream)"
        )


def check_workers(source: Any, num_workers: int) -> None:
    """Refuse loader workers for a Hugging Face ``datasets`` ``IterableDataset`` (told by its module
    and ``n_shards``), which hands each worker a share of its shards."""
    datasets = type(source).__module__.split(".")[0] == "datasets" and hasattr(source, "n_shards")
    if num_workers > 0 and datasets:
        raise ConfigError(
            f"IterableStream: a datasets {type(source).__name__} splits itself among loader "
            f"workers (get_worker_info()), so each of the {num_workers} workers would read a part "
            "of the records where ddpkit reads them all in each: pass num_workers=0 "
            "(build_loader, TrainerConfig), or give ddpkit the files (JsonlStream over its data "
            "files, or the dataset loaded map-style)"
        )
