"""Sharded data: a global sample order that does not depend on the world size, and exact evaluation shards.

Training (:class:`ShardedBatchSampler`). The permutation of epoch ``e`` is a pure function of ``(seed, e)``.
It is cut into global batches of ``batch_size * world_size`` samples and rank ``r`` takes the ``r``-th slice of
each. Concatenating the ranks' slices of a step gives the same global batch at 1, 2 or 8 ranks, so a run can
resume at another world size with the same global batch and see the same samples in the same steps.

Evaluation (:class:`EvalShardSampler`). ``DistributedSampler`` pads the dataset to a multiple of the world size
by repeating samples, so every metric counts some samples twice (pytorch/pytorch#25162). Here each rank takes
a contiguous, unpadded share; shares differ by at most one sample and every sample is counted exactly once.

Random draws while loading (augmentation). :func:`build_loader` reads each sample with python, numpy and torch
seeded from ``(seed, epoch, index)`` (:class:`SeededSamples`): a sample is augmented the same way whichever
rank or loader worker loads it, at any world size and number of workers, and a resumed run draws what the
uninterrupted one drew. Without it each worker runs its own stream on across epochs (persistent workers),
which no snapshot can restore.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, TensorDataset, get_worker_info

from ddpkit.cluster import cpu_count
from ddpkit.collectives import shard_position
from ddpkit.errors import ConfigError
from ddpkit.runtime import get_runtime
from ddpkit.seeding import loading_rng_state, seed_sample, set_loading_rng_state, stream_seed


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

    Each ``iter()`` is a new epoch (no ``set_epoch`` to forget), so ``for batch in loader`` in an epoch loop
    reshuffles. :meth:`set_position` moves to a global sample ``cursor`` inside an epoch, for resuming.

    With ``drop_last=True`` (default) a last global batch smaller than ``batch_size * world_size`` is dropped,
    so every step has the same size at every world size. With ``drop_last=False`` it is split as evenly as
    possible over the ranks (sizes differ by at most one); if it has fewer samples than ranks it is dropped,
    since a rank without a sample cannot take a DDP step.
    """

    def __init__(
        self,
        dataset: Sized | int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        group: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        keyed: bool = False,
    ) -> None:
        self.keyed = keyed
        """Yield ``(epoch, index)`` pairs instead of indices, for :class:`SeededSamples`."""
        self.num_samples = dataset if isinstance(dataset, int) else len(dataset)
        if batch_size < 1:
            raise ConfigError(f"batch_size={batch_size}: the per-rank batch size must be >= 1")
        self.batch_size = batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        group_rank, group_size = shard_position(group)
        self.rank = group_rank if rank is None else rank
        self.world_size = group_size if world_size is None else world_size
        self.global_batch_size = batch_size * self.world_size
        if self.steps_per_epoch == 0 and not drop_last:
            raise ConfigError(
                f"{self.num_samples} samples are fewer than the {self.world_size} ranks: every rank needs a sample "
                "to take a DDP step; use fewer ranks or more data"
            )
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"{self.num_samples} samples make no global batch of {self.global_batch_size} "
                f"({batch_size} per rank x {self.world_size} ranks): lower batch_size or pass drop_last=False"
            )
        self.epoch = 0
        """The epoch the next ``iter()`` yields."""
        self._cursor = 0

    @property
    def steps_per_epoch(self) -> int:
        full, tail = divmod(self.num_samples, self.global_batch_size)
        return full + (0 if self.drop_last or tail < self.world_size else 1)

    def samples_in_batch(self, micro: int) -> int:
        """Samples over all ranks in global batch ``micro`` of an epoch (a micro-batch, under gradient
        accumulation): the global batch size, or fewer in a last, smaller one (``drop_last=False``)."""
        return min(self.global_batch_size, self.num_samples - micro * self.global_batch_size)

    def samples_in_step(self, micro: int, accum: int) -> int:
        """Samples over all ranks in the optimizer step that global batch ``micro`` belongs to, with ``accum``
        batches a step (the epoch's last step may have fewer batches, and its last batch fewer samples)."""
        first = micro - micro % accum
        return sum(self.samples_in_batch(m) for m in range(first, min(first + accum, self.steps_per_epoch)))

    def place_in_step(self, micro: int, accum: int) -> tuple[int, int]:
        """:meth:`samples_in_step`, and where this rank's first sample of global batch ``micro`` sits among
        them (samples numbered batch after batch, and rank after rank within a batch)."""
        rank_offset, _ = shard_bounds(self.samples_in_batch(micro), self.world_size, self.rank)
        return self.samples_in_step(micro, accum), (micro % accum) * self.global_batch_size + rank_offset

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next ``iter()`` yields (``DistributedSampler``'s method, kept for scripts)."""
        self.set_position(epoch, 0)

    def set_position(self, epoch: int, cursor: int) -> None:
        """Make the next ``iter()`` yield ``epoch`` from global sample ``cursor`` (samples already trained on)."""
        if cursor % self.global_batch_size and cursor != self.num_samples:
            raise ConfigError(
                f"cursor {cursor} is not a whole number of global batches of {self.global_batch_size}: resume "
                "with the same global batch size (per-rank batch x world size) as the run that saved it"
            )
        self.epoch, self._cursor = epoch, cursor

    def _first_step(self) -> int:
        # Rounded up: a cursor of num_samples (after a last, partial batch) means the epoch is done.
        return -(-self._cursor // self.global_batch_size)

    def __len__(self) -> int:
        return max(0, self.steps_per_epoch - self._first_step())

    def __iter__(self) -> Iterator[list[int]]:
        epoch, first_step = self.epoch, self._first_step()
        self.epoch, self._cursor = epoch + 1, 0
        n, gbs = self.num_samples, self.global_batch_size
        # One list per epoch, sliced per step: a tensor slice and .tolist() per step cost more (tiny models).
        order = (epoch_permutation(n, self.seed, epoch) if self.shuffle else torch.arange(n)).tolist()
        for step in range(first_step, self.steps_per_epoch):
            batch = order[step * gbs : min((step + 1) * gbs, n)]
            lo, hi = shard_bounds(len(batch), self.world_size, self.rank)
            mine = batch[lo:hi]
            yield [(epoch, i) for i in mine] if self.keyed else mine


class EvalShardSampler(Sampler[int]):
    """This rank's contiguous, unpadded share of ``range(n)``: every sample on exactly one rank."""

    def __init__(self, dataset: Sized | int, *, group: Any = None) -> None:
        n = dataset if isinstance(dataset, int) else len(dataset)
        rank, size = shard_position(group)
        self.start, self.end = shard_bounds(n, size, rank)

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))


class SeededSamples(Dataset):
    """``dataset`` read at ``(epoch, index)`` keys, each sample with the RNGs seeded from ``(seed, epoch, index)``.

    Python's ``random``, numpy's global generator and torch's CPU generator are seeded before each
    ``dataset[index]``, and so is the current CUDA device's generator in a process that uses CUDA: a sample
    drawing on the GPU (``torch.randn(..., device="cuda")``) draws the same too. That process is the main one
    (``num_workers=0``): CUDA cannot be used in a loader worker forked from a process that uses it. In the main
    process the generators' states are saved before a batch and restored after it, so loading leaves the
    training stream (dropout, on the CPU or the GPU) where it was. Cost in the main process on the 2-core CI
    machine: 11 to 26 us per sample (seeding, the first draw of each freshly seeded generator, and ~0.12 ms per
    batch to save and restore the states, numpy's being the dear one); see ``bench/sample_seeding.py``.
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        # A worker's own stream is of no use to anyone once every sample seeds it: no need to restore it there.
        saved = loading_rng_state() if get_worker_info() is None else None
        try:
            out = []
            for epoch, index in keys:
                seed_sample(self.seed, epoch, index)
                out.append(self.dataset[index])
            return out
        finally:
            if saved is not None:
                set_loading_rng_state(saved)


def check_map_style(dataset: Any) -> None:
    """Refuse a dataset the samplers cannot shard: an ``IterableDataset`` or one without a length."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ConfigError(
            f"a {type(dataset).__name__} is not a map-style dataset (with __len__ and __getitem__): build_loader "
            "and the Trainer shard, shuffle and resume by sample index, which a stream does not have. Load it "
            "into a map-style Dataset (or a torch.utils.data.TensorDataset), or iterate the stream in a "
            "hand-written loop, giving each rank its own part (ddpkit.get_runtime().rank and world_size)"
        )


def default_num_workers(local_world_size: int | None = None) -> int:
    """Loader workers per rank: the cores of each rank minus one (for the rank itself)."""
    procs = local_world_size or get_runtime().local_world_size
    return max(0, cpu_count() // procs - 1)


def _loader_kwargs(num_workers: int | None, pin_memory: bool | None) -> dict[str, Any]:
    workers = default_num_workers() if num_workers is None else num_workers
    pin = get_runtime().device.type == "cuda" if pin_memory is None else pin_memory
    return {"num_workers": workers, "pin_memory": pin, "persistent_workers": workers > 0}


def build_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    group: Any = None,
    seed_samples: bool = True,
) -> DataLoader:
    """A training loader over this rank's shard; ``batch_size`` is per rank.

    The loader gets its own ``torch.Generator``: without one, every ``iter()`` draws the workers' base seed
    from the global RNG, which shifts dropout masks and any other draw that follows. ``seed_samples``: each
    sample is loaded with the RNGs seeded from ``(seed, epoch, index)`` (see :class:`SeededSamples`); False
    leaves the draws to each worker's own stream (or the main process's), as a plain DataLoader does. A
    ``TensorDataset`` is never wrapped: it draws nothing.
    """
    check_map_style(dataset)
    # A TensorDataset only indexes tensors: it draws nothing, and seeding would cost ~10 us a sample for nothing.
    seed_samples = seed_samples and type(dataset) is not TensorDataset
    sampler = ShardedBatchSampler(
        dataset, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, group=group, keyed=seed_samples
    )
    generator = torch.Generator()
    generator.manual_seed(stream_seed("loader", seed, sampler.rank))  # per-rank worker seeds: ranks augment differently
    return DataLoader(
        SeededSamples(dataset, seed) if seed_samples else dataset,
        batch_sampler=sampler,
        collate_fn=collate_fn,
        generator=generator,
        **_loader_kwargs(num_workers, pin_memory),
    )


def build_eval_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    group: Any = None,
) -> DataLoader:
    """An evaluation loader over this rank's exact share: no padding, no sample on two ranks."""
    check_map_style(dataset)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=EvalShardSampler(dataset, group=group),
        collate_fn=collate_fn,
        generator=torch.Generator(),
        **_loader_kwargs(num_workers, pin_memory),
    )


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor in a (nested) batch of tuples, lists and dicts to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking and device.type == "cuda")
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device, non_blocking) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch
