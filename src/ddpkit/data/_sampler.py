"""Which samples each rank takes: a global order that does not depend on the world size
(:class:`ShardedBatchSampler`), and exact evaluation shards (:class:`EvalShardSampler`, unpadded,
where ``DistributedSampler`` pads by repeating samples, pytorch/pytorch#25162)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from ddpkit._errors import ConfigError, checked_arguments
from ddpkit.distributed import Group
from ddpkit.distributed._runtime import get_runtime
from ddpkit.distributed._seeding import stream_seed


class EpochIndices(list[int]):
    """One batch's sample indices and the epoch they belong to: the keys a keyed sampler yields
    (``ShardedBatchSampler(keyed=True)``), which :class:`~ddpkit.data.SeededSamples` reads as the
    ``(epoch, index)`` of each sample. A list's own operations (a slice, ``+``) give plain lists,
    without the epoch."""

    __slots__ = ("epoch",)

    def __init__(self, indices: Iterable[int], epoch: int) -> None:
        super().__init__(indices)
        self.epoch = epoch

    def __reduce__(self) -> tuple[Any, ...]:  # to a loader worker, by its queue
        return (EpochIndices, (list(self), self.epoch))

    def __repr__(self) -> str:
        return f"EpochIndices({list(self)!r}, epoch={self.epoch})"


def _position(group: Group) -> tuple[int, int]:
    """(rank, world size) to shard data by: a process outside ``group`` works alone, as a world of
    one."""
    rt = get_runtime(group)
    return (rt.rank, rt.world_size) if rt.rank >= 0 else (0, 1)


@checked_arguments
def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the ``n`` samples in ``epoch``: a function of ``(seed, epoch)`` alone."""
    g = torch.Generator()
    g.manual_seed(stream_seed("shuffle", seed, epoch))
    return torch.randperm(n, generator=g)


def shard_bounds(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of part ``index`` when ``n`` items are cut into ``parts`` contiguous parts.

    The first ``n % parts`` parts hold one item more; a part may be empty when ``n < parts``.
    """
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


class ShardedBatchSampler(Sampler[list[int]]):
    """Yields this rank's indices for each step of an epoch; the epoch advances by itself.

    An iteration that runs to its end moves to the next epoch (no ``set_epoch`` to forget); one left
    before its end (a peek, a ``break``) leaves the position where it was. Under
    :func:`~ddpkit.build_loader` the loader counts the epoch instead (:attr:`counts_epochs`).
    :meth:`set_position` moves to a global sample ``cursor`` inside an epoch, for resuming.

    ``drop_last=True`` (default) drops a last global batch smaller than ``batch_size * world_size``;
    ``False`` splits it as evenly as possible over the ranks, and drops it only when it has fewer
    samples than ranks (a rank without a sample cannot take a DDP step).
    """

    @checked_arguments
    def __init__(
        self,
        dataset: Sized | int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        group: Group = None,
        rank: int | None = None,
        world_size: int | None = None,
        keyed: bool = False,
    ) -> None:
        self.keyed = keyed
        """Yield each batch as :class:`EpochIndices` (its indices and their epoch), for
        :class:`~ddpkit.data.SeededSamples`."""
        self.num_samples = dataset if isinstance(dataset, int) else len(dataset)
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size}: the per-rank batch size must be >= 1")
        self.batch_size = batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        if rank is None or world_size is None:
            group_rank, group_size = _position(group)
            rank = group_rank if rank is None else rank
            world_size = group_size if world_size is None else world_size
        self.rank, self.world_size = rank, world_size
        self.global_batch_size = batch_size * self.world_size
        if self.steps_per_epoch == 0 and not drop_last:
            raise ConfigError(
                f"{self.num_samples} samples are fewer than the {self.world_size} ranks: every "
                "rank needs a sample to take a DDP step; use fewer ranks or more data"
            )
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"{self.num_samples} samples make no global batch of {self.global_batch_size} "
                f"({batch_size} per rank x {self.world_size} ranks): lower batch_size or pass "
                "drop_last=False"
            )
        self.epoch = 0
        """The epoch the next ``iter()`` yields."""
        self._cursor = 0
        # set_position calls and ends of epochs: an end counts only if nothing moved since
        self._moves = 0
        self.counts_epochs = True
        """Move to the next epoch when an iteration of this sampler runs to its end. False under
        ``build_loader``, whose workers read the sampler ahead of the batches handed over: the
        loader calls :meth:`end_epoch` once its own pass ends."""

    @property
    def steps_per_epoch(self) -> int:
        full, tail = divmod(self.num_samples, self.global_batch_size)
        return full + (0 if self.drop_last or tail < self.world_size else 1)

    def samples_in_batch(self, micro: int) -> int:
        """Samples over all ranks in global batch ``micro`` of an epoch (a micro-batch, under
        gradient accumulation): the global batch size, or fewer in a last, smaller one
        (``drop_last=False``)."""
        return min(self.global_batch_size, self.num_samples - micro * self.global_batch_size)

    def samples_in_step(self, micro: int, accum: int) -> int:
        """Samples over all ranks in the optimizer step that global batch ``micro`` belongs to, with
        ``accum`` batches a step (the epoch's last step may have fewer batches, and its last batch
        fewer samples)."""
        first = micro - micro % accum
        batches = min(first + accum, self.steps_per_epoch) - first
        # every batch is full but the epoch's last, which holds what is left
        global_batch = self.global_batch_size
        return min(batches * global_batch, self.num_samples - first * global_batch)

    def place_in_step(self, micro: int, accum: int) -> tuple[int, int]:
        """:meth:`samples_in_step`, and where this rank's first sample of global batch ``micro``
        sits among them (samples numbered batch after batch, and rank after rank within a batch)."""
        rank_offset, _ = shard_bounds(self.samples_in_batch(micro), self.world_size, self.rank)
        offset = (micro % accum) * self.global_batch_size + rank_offset
        return self.samples_in_step(micro, accum), offset

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next ``iter()`` yields (``DistributedSampler``'s method, kept for
        scripts)."""
        self.set_position(epoch, 0)

    def set_position(self, epoch: int, cursor: int) -> None:
        """Make the next ``iter()`` yield ``epoch`` from global sample ``cursor`` (samples already
        trained on)."""
        if cursor % self.global_batch_size and cursor != self.num_samples:
            raise ConfigError(
                f"cursor {cursor} is not a whole number of global batches of "
                f"{self.global_batch_size}: resume with the same global batch size (per-rank batch "
                "x world size) as the run that saved it"
            )
        self.epoch, self._cursor = epoch, cursor
        self._moves += 1

    def position_token(self) -> tuple[int, int]:
        """What :meth:`end_epoch` needs of the position an iteration starts from."""
        return self.epoch, self._moves

    def end_epoch(self, token: tuple[int, int]) -> None:
        """An iteration that started at ``token`` (:meth:`position_token`) ran to its end: the next
        ``iter()`` yields the next epoch from its start. Nothing happens if the position moved since
        (a ``set_position``, or another iteration of the same epoch that ended first)."""
        if token == self.position_token():
            self.epoch, self._cursor = token[0] + 1, 0
            self._moves += 1

    def fingerprint(self) -> dict[str, Any]:
        """What decides which sample comes at which step, the world size aside
        (:mod:`ddpkit.data._fingerprint`): the order is a function of these and the epoch, cut into
        global batches."""
        return {
            "sampler": type(self).__name__,
            "dataset length": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "global batch": self.global_batch_size,
        }

    def _first_step(self) -> int:
        # Rounded up: a cursor of num_samples (after a last, partial batch) means the epoch is done.
        return -(-self._cursor // self.global_batch_size)

    def __len__(self) -> int:
        """The epoch's steps (a batch each), also after :meth:`set_position` inside it, where an
        iteration yields those left: a loop numbering its batches from ``loader.batch_in_epoch``
        ends at ``len(loader) - 1``."""
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        token, epoch, first_step = self.position_token(), self.epoch, self._first_step()
        n, gbs = self.num_samples, self.global_batch_size
        order: Sequence[int] = (
            epoch_permutation(n, self.seed, epoch).tolist() if self.shuffle else range(n)
        )
        for step in range(first_step, self.steps_per_epoch):
            batch = order[step * gbs : min((step + 1) * gbs, n)]
            lo, hi = shard_bounds(len(batch), self.world_size, self.rank)
            yield EpochIndices(batch[lo:hi], epoch) if self.keyed else list(batch[lo:hi])
        if self.counts_epochs:
            self.end_epoch(token)


class EvalShardSampler(Sampler[int]):
    """This rank's contiguous, unpadded share of ``range(n)``: every sample on exactly one rank."""

    def __init__(self, dataset: Sized | int, *, group: Group = None) -> None:
        n = dataset if isinstance(dataset, int) else len(dataset)
        rank, size = _position(group)
        self.start, self.end = shard_bounds(n, size, rank)

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))
