"""Streams: records read from files too big for memory, by position, with the guarantees of
map-style data (docs/data.md, "Streams"). The order of epoch ``e`` is a function of ``(seed, e)``
(:class:`StreamOrder`, a two-level shuffle); the DataLoader reads a map-style view keyed by
``(epoch, position)`` (:class:`StreamSamples`), so each loader worker builds whole batches.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddpkit._errors import ConfigError, checked_arguments
from ddpkit.data._fingerprint import shard_items
from ddpkit.data._loader import SampleSeeder
from ddpkit.data._sampler import EpochIndices
from ddpkit.distributed import Group
from ddpkit.distributed._seeding import stream_seed

DEFAULT_WINDOW = 8192
"""Records per shuffle block: the span of the reads of a global batch, and what
:class:`IterableStream` buffers in each reading process."""

OPEN_SHARDS = 64
"""Shard files a reading process keeps open at once."""

Transform = Callable[[Any], Any]


class Stream:
    """A finite sequence of records, readable by position: subclass it with :attr:`shard_sizes` and
    :meth:`read` for a source of your own.

    ``transform(record)`` turns a record into a sample (decoding, augmentation); it runs in the
    loader workers with python, numpy and torch seeded from ``(seed, epoch, position)``. ``window``:
    records per shuffle block.
    """

    random_access = True
    """False for a source read front to back only: the order then keeps its blocks in the source's
    order."""

    @checked_arguments
    def __init__(self, *, transform: Transform | None = None, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ConfigError(f"window={window}: the shuffle window must hold at least one record")
        self.transform, self.window = transform, window
        self._local: dict[str, Any] = {}
        self._pid = os.getpid()

    @property
    def shard_sizes(self) -> Sequence[int]:
        """Records in each shard, known before reading: the order and the epoch's length depend on
        them."""
        raise NotImplementedError

    def read(self, shard: int, indices: np.ndarray) -> list[Any]:
        """The records at ``indices`` (positions in ``shard``, any order), in that order."""
        raise NotImplementedError

    def __len__(self) -> int:
        return int(sum(self.shard_sizes))

    def shard_descriptions(self) -> list[str]:
        """A line for each shard saying what decides where its records lie (a name, a size, a digest
        of where its records start); the default: its record count. Saved with every snapshot and
        compared on resume."""
        return [f"{n} records" for n in self.shard_sizes]

    def fingerprint(self) -> dict[str, Any]:
        """What decides which record comes at which position of an epoch, besides the seed and
        shuffling: the stream's kind, records, window and shards."""
        return {
            "stream": type(self).__name__,
            "records": len(self),
            "window": self.window,
            **shard_items(self.shard_descriptions()),
        }

    def check_loading(self, num_workers: int, world_size: int, group: Group) -> None:
        """Refuse loading that cannot read every record in every process (``build_loader`` calls it
        on every rank, before the loader is made): nothing to refuse for a stream read by
        position."""

    def local(self) -> dict[Any, Any]:
        """Open files and iterators of this process: a forked loader worker opens its own."""
        if self._pid != os.getpid():
            self._local, self._pid = {}, os.getpid()
        return self._local

    def opened(
        self,
        shard: int,
        open_fn: Callable[[], Any],
        close_fn: Callable[[Any], None] = lambda h: None,
    ) -> Any:
        """This process's handle on ``shard``, opened by ``open_fn`` on first use; the least
        recently used is closed beyond :data:`OPEN_SHARDS`."""
        handles = self.local()
        if shard in handles:
            handles[shard] = handles.pop(shard)  # most recently used last
        else:
            if len(handles) >= OPEN_SHARDS:
                oldest = next(iter(handles))
                close_fn(handles.pop(oldest))
            handles[shard] = open_fn()
        return handles[shard]

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_local": {}}


class StreamOrder:
    """The records of ``epoch`` in order: position ``p`` (0..N-1) -> (shard, index in shard)."""

    def __init__(self, stream: Stream, seed: int, epoch: int, shuffle: bool) -> None:
        sizes = np.asarray(stream.shard_sizes, dtype=np.int64)
        self.n, self.window = int(sizes.sum()), stream.window
        self.shuffle, self.epoch = shuffle, epoch
        self._keys = (seed, epoch)
        self._tau: dict[int, np.ndarray] = {}
        mixed = shuffle and stream.random_access
        g = self._generator(0)
        self.shard_order = _randperm(len(sizes), g) if mixed else np.arange(len(sizes))
        self.rotation = int(torch.randint(max(self.n, 1), (1,), generator=g)) if mixed else 0
        self._shard_starts = np.concatenate([[0], np.cumsum(sizes[self.shard_order])])
        blocks = -(-self.n // self.window)
        self.block_order = _randperm(blocks, self._generator(1)) if mixed else np.arange(blocks)
        block_sizes = np.minimum(self.window, self.n - self.block_order * self.window)
        self._block_starts = np.concatenate([[0], np.cumsum(block_sizes)])

    def _generator(self, *keys: int) -> torch.Generator:
        # Keys after the epoch keep these draws apart from the map-style epoch permutation's.
        return torch.Generator().manual_seed(stream_seed("shuffle", *self._keys, *keys))

    def _within(self, block: int) -> np.ndarray:
        if block not in self._tau:
            if len(self._tau) > 4:  # a batch spans a block or two: keep the last few
                self._tau.pop(next(iter(self._tau)))
            size = min(self.window, self.n - block * self.window)
            self._tau[block] = _randperm(size, self._generator(2, block))
        return self._tau[block]

    def records(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, index in shard) of the records at ``positions`` of this epoch."""
        p = np.asarray(positions, dtype=np.int64)
        if self.shuffle:
            slot = np.searchsorted(self._block_starts, p, side="right") - 1
            blocks, offsets = self.block_order[slot], p - self._block_starts[slot]
            q = np.empty_like(p)
            for block in np.unique(blocks):
                mine = blocks == block
                q[mine] = block * self.window + self._within(int(block))[offsets[mine]]
            p = (q + self.rotation) % self.n
        slot = np.searchsorted(self._shard_starts, p, side="right") - 1
        return self.shard_order[slot], p - self._shard_starts[slot]


def _randperm(n: int, generator: torch.Generator) -> np.ndarray:
    return torch.randperm(n, generator=generator).numpy()


class StreamSamples(Dataset):
    """The map-style view a DataLoader reads: key ``(epoch, position)`` -> ``transform(record)``,
    a batch's records read shard by shard; with ``seed_samples``, each ``transform`` seeded from
    ``(seed, epoch, position)`` (:class:`~ddpkit.data._loader.SampleSeeder`)."""

    def __init__(self, stream: Stream, seed: int, shuffle: bool, seed_samples: bool = True) -> None:
        self.stream, self.seed = stream, seed
        self.shuffle, self.seed_samples = shuffle, seed_samples
        self.seeder = SampleSeeder(seed)
        self._order: StreamOrder | None = None

    def __len__(self) -> int:
        return len(self.stream)

    def fingerprint(self) -> dict[str, Any]:
        """The stream's fingerprint, and whether it shuffles (the sampler over positions does
        not)."""
        return self.stream.fingerprint() | {"shuffle": self.shuffle}

    def order(self, epoch: int) -> StreamOrder:
        if self._order is None or self._order.epoch != epoch:
            self._order = StreamOrder(self.stream, self.seed, epoch, self.shuffle)
        return self._order

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__(EpochIndices([key[1]], key[0]))[0]

    def __getitems__(self, keys: EpochIndices) -> list[Any]:
        """The samples of a batch's keys (the loader's sampler is keyed: an epoch's positions)."""
        epoch = keys.epoch
        positions = np.fromiter(keys, dtype=np.int64, count=len(keys))
        shards, index = self.order(epoch).records(positions)
        records: list[Any] = [None] * len(keys)
        for shard in np.unique(shards):
            mine = np.flatnonzero(shards == shard)
            for k, record in zip(mine, self.stream.read(int(shard), index[mine])):
                records[k] = record
        transform = self.stream.transform
        if transform is None:
            return records
        if not self.seed_samples:
            return [transform(r) for r in records]
        return self.seeder.load(keys, transform, records)
