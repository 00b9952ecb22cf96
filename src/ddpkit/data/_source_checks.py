"""Checks of a source that can only be iterated (``ddpkit.data._stream_sources.IterableStream``):
that it starts again on every ``iter()``, yields the same records in every process, and does not
split itself among loader workers.

Such a source is read from its start by every rank and every loader worker, each keeping its own
batches: a rank takes the records at its positions of the global order, so all of them must see one
order. A source that does not (a generator object, spent after one pass; a set iterated in each
process's hash order; a shuffle seeded per process) trains some records twice and others never,
silently. What can be checked cheaply is checked: the first :data:`HEAD_RECORDS` records, read twice
at construction and compared across ranks once, when the loader is built.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ddpkit._errors import ConfigError
from ddpkit.data._fingerprint import digest
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import all_gather_object, tensor_bytes

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


def splits_by_worker(source: Any) -> bool:
    """A Hugging Face ``datasets`` ``IterableDataset`` (told by its module and ``n_shards``;
    ``datasets`` need not be installed): it hands each loader worker a share of its shards, where
    ddpkit needs all of it."""
    return type(source).__module__.split(".")[0] == "datasets" and hasattr(source, "n_shards")


def check_workers(source: Any, num_workers: int) -> None:
    if num_workers > 0 and splits_by_worker(source):
        raise ConfigError(
            f"IterableStream: a datasets {type(source).__name__} splits itself among loader "
            f"workers (get_worker_info()), so each of the {num_workers} workers would read a part "
            "of the records where ddpkit reads them all in each: pass num_workers=0 "
            "(build_loader, TrainerConfig), or give ddpkit the files (JsonlStream over its data "
            "files, or the dataset loaded map-style)"
        )
