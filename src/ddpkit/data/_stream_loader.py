"""How a :class:`~ddpkit.data._stream.Stream` is loaded: its order in each epoch, the batch sampler
over its positions, and the map-style view a DataLoader reads.

Loader workers never see a stream: the DataLoader gets a map-style view keyed by
``(epoch, position)`` and our batch sampler, so each worker builds whole batches that the DataLoader
returns in order. A torch ``IterableDataset`` in ``k`` workers instead runs ``k`` copies of the
stream, whose items the DataLoader interleaves worker by worker: without a split by worker every
record comes ``k`` times, and with one a batch's records depend on the number of workers.

Shuffling is two-level. The shards are permuted and their concatenation rotated by a random offset
(both per epoch), cut into blocks of ``window`` records, the blocks permuted, and the records
permuted within each block. A permutation of all ``N`` records would mix best but hold 8 bytes a
record in every reading process and send each read anywhere in the data; shards alone leave
neighbours together. Here a batch's reads fall in one or two blocks, the rotation changes which
records share a block from epoch to epoch, and memory is ``O(shards + N / window + window)``. A
source that can only be iterated (:class:`IterableStream`) keeps its own order of blocks and is
shuffled within each block (a shuffle buffer of ``window`` records).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddpkit.data._epoch_loader import EpochLoader
from ddpkit.data._fingerprint import OnDataChange
from ddpkit.data._sample_seeding import SampleSeeder
from ddpkit.data._sampler import EpochIndices, ShardedBatchSampler, shard_bounds
from ddpkit.data._stream import Stream
from ddpkit.distributed import Group
from ddpkit.distributed._seeding import stream_seed


class StreamOrder:
    """The records of ``epoch`` in order: position ``p`` (0..N-1) -> (shard, index in shard)."""

    def __init__(self, stream: Stream, seed: int, epoch: int, shuffle: bool) -> None:
        sizes = np.asarray(stream.shard_sizes, dtype=np.int64)
        self.n, self.window, self.shuffle, self.epoch = (
            int(sizes.sum()),
            stream.window,
            shuffle,
            epoch,
        )
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


def record_ids(stream: Stream, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The whole order of ``epoch`` as record numbers in the natural order (shard offset + index):
    for tests and inspection, ``O(N)`` memory."""
    shards, index = StreamOrder(stream, seed, epoch, shuffle).records(np.arange(len(stream)))
    offsets = np.concatenate([[0], np.cumsum(np.asarray(stream.shard_sizes, dtype=np.int64))])
    return offsets[shards] + index


class StreamBatchSampler(ShardedBatchSampler):
    """:class:`~ddpkit.data.ShardedBatchSampler` over global positions ``0..N-1`` in order (the
    stream's order shuffles): this rank's positions for each step with their epoch
    (:class:`~ddpkit.data.EpochIndices`), by arithmetic, with no list of ``N``."""

    def __init__(self, num_records: int, batch_size: int, **kwargs: Any) -> None:
        super().__init__(num_records, batch_size, shuffle=False, keyed=True, **kwargs)

    def __iter__(self) -> Iterator[list[int]]:
        token, epoch, first_step = self.position_token(), self.epoch, self._first_step()
        gbs = self.global_batch_size
        for step in range(first_step, self.steps_per_epoch):
            start = step * gbs
            lo, hi = shard_bounds(min(gbs, self.num_samples - start), self.world_size, self.rank)
            yield EpochIndices(range(start + lo, start + hi), epoch)
        if self.counts_epochs:
            self.end_epoch(token)


class StreamSamples(Dataset):
    """The map-style view a DataLoader reads: key ``(epoch, position)`` -> ``transform(record)``.

    A batch's records are read shard by shard (one :meth:`~ddpkit.data._stream.Stream.read` each).
    With ``seed_samples``, each ``transform`` draws as if run with the RNGs seeded from
    ``(seed, epoch, position)`` (they are seeded where it draws,
    :class:`~ddpkit.data._sample_seeding.SampleSeeder`); in the main process the RNG states are
    restored after the batch, so loading leaves the training stream (dropout) where it was.
    """

    def __init__(self, stream: Stream, seed: int, shuffle: bool, seed_samples: bool = True) -> None:
        self.stream, self.seed, self.shuffle, self.seed_samples = (
            stream,
            seed,
            shuffle,
            seed_samples,
        )
        self.seeder = SampleSeeder(seed)  # seeds a transform only where it draws
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
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: EpochIndices | list[tuple[int, int]]) -> list[Any]:
        if not isinstance(keys, EpochIndices):  # (epoch, position) pairs
            # a batch never spans two epochs
            keys = EpochIndices((p for _, p in keys), keys[0][0])
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


def build_stream_loader(
    stream: Stream,
    batch_size: int,
    *,
    loader_kwargs: dict[str, Any],
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    group: Group = None,
    seed_samples: bool = True,
    on_data_change: OnDataChange = "error",
) -> EpochLoader:
    """What :func:`ddpkit.build_loader` returns for a stream (call that): the same arguments and
    guarantees, and a ``batch_sampler`` (:class:`StreamBatchSampler`) with what the Trainer resumes
    by. ``loader_kwargs``: workers and pinning, as ``build_loader`` resolves them for map-style
    data."""
    sampler = StreamBatchSampler(
        len(stream), batch_size, seed=seed, drop_last=drop_last, group=group
    )
    stream.check_loading(loader_kwargs["num_workers"], sampler.world_size, group)
    generator = torch.Generator()
    generator.manual_seed(stream_seed("loader", seed, sampler.rank))
    return EpochLoader(
        StreamSamples(stream, seed, shuffle, seed_samples),
        batch_sampler=sampler,
        collate_fn=collate_fn,
        generator=generator,
        on_data_change=on_data_change,
        **loader_kwargs,
    )
