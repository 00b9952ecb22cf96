"""Loaders over a rank's shard: :func:`build_loader` for training, :func:`build_eval_loader` for exact evaluation.

Random draws while loading (augmentation). :func:`build_loader` reads each sample that draws with python, numpy
and torch seeded from ``(seed, epoch, index)`` (:class:`SeededSamples`): a sample is augmented the same way whichever
rank or loader worker loads it, at any world size and number of workers, and a resumed run draws what the
uninterrupted one drew. Without it each worker runs its own stream on across epochs (persistent workers),
which no snapshot can restore.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence, Sized
from typing import Any, cast

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    TensorDataset,
    get_worker_info,
)

from ddpkit.data.fingerprint import OnDataChange, changes, check_on_data_change, refusal
from ddpkit.data.sampler import EvalShardSampler, ShardedBatchSampler
from ddpkit.distributed.environment import cpu_count
from ddpkit.distributed.runtime import get_runtime
from ddpkit.distributed.seeding import (
    changed,
    draw_marks,
    loading_rng_state,
    seed_sample,
    set_draw_marks,
    set_loading_rng_state,
    stream_seed,
)
from ddpkit.errors import ConfigError


class SampleSeeder:
    """Loads a batch so that each sample's random draws depend on ``(seed, epoch, index)`` only, and pays for
    seeding only where samples draw.

    Seeding python, numpy and torch before every sample costs ~15 to 40 us a sample, and most datasets draw
    nothing (a list of tensors, a decoded file without augmentation). So a batch is first read as it is, with
    the generators' states read through their public APIs and compared around it
    (:func:`~ddpkit.distributed.seeding.draw_marks`). In the main process that is two reads a batch: ~25 us,
    ~95 us once ``numpy.random`` is imported (torch's compiler stack, and so DDP, imports it), measured on the
    CPU CI machine; in a loader worker one read, ~18 or ~55 us, beside the training step rather than in it.
    If nothing drew, that is the batch. If a sample drew, the generators are put back and the batch is read again
    with each sample seeded from ``(seed, epoch, index)``, and from then on this process seeds every sample
    (a dataset that draws once draws again). Either way each draw a sample makes is the seeded one: a sample
    that draws nothing has nothing to seed. ``read`` must give the same sample when called twice (as any
    map-style dataset does; a dataset that counts its reads sees the first drawing batch of each process twice).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.draws = False
        """A sample drew in this process: seed each one before reading it."""
        self._after: tuple[int, tuple[Any, ...]] | None = None

    def load(self, keys: Sequence[tuple[int, int]], read: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[read(item) for item in items]``, where ``items[k]`` is the sample of key ``keys[k]``."""
        if not self.draws:
            worker = get_worker_info() is not None
            # In a loader worker nothing draws between two batches (a collate_fn that draws is taken as the
            # dataset drawing): the state after one is the marks of the next, one read a batch, not two. Kept
            # with the process id: a worker starts from a copy of the dataset, and of what it held.
            kept = self._after if worker and self._after is not None and self._after[0] == os.getpid() else None
            marks = kept[1] if kept is not None else draw_marks()
            out = [read(item) for item in items]
            after = draw_marks()
            if not changed(marks, after):
                self._after = (os.getpid(), after) if worker else None
                return out
            if not worker:
                set_draw_marks(marks)
            self.draws = True
        # In a worker the generators' own stream is of no use to anyone once samples are seeded: nothing to
        # put back there. In the main process it is the training stream (dropout), which loading must not move.
        main = get_worker_info() is None
        saved = loading_rng_state() if main else None
        try:
            out = []
            for (epoch, index), item in zip(keys, items):
                seed_sample(self.seed, epoch, index)
                out.append(read(item))
            return out
        finally:
            if saved is not None:
                set_loading_rng_state(saved)


class SeededSamples(Dataset):
    """``dataset`` read at ``(epoch, index)`` keys, each sample's random draws seeded from ``(seed, epoch,
    index)`` (:class:`SampleSeeder`).

    Python's ``random``, numpy's global generator and torch's CPU generator are seeded before a sample that
    draws, and so is the current CUDA device's generator in a process that uses CUDA: a sample drawing on the
    GPU (``torch.randn(..., device="cuda")``) draws the same too. That process is the main one
    (``num_workers=0``): CUDA cannot be used in a loader worker forked from a process that uses it. In the main
    process the generators' states are put back after a batch, so loading leaves the training stream (dropout,
    on the CPU or the GPU) where it was. Cost in the main process: see ``bench/loader_overhead.py`` (a dataset
    that draws nothing) and ``bench/sample_seeding.py`` (one that draws).
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.seeder = SampleSeeder(seed)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]  # torch's Dataset declares no __len__; this one has it

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        return self.seeder.load(keys, self.dataset.__getitem__, [index for _, index in keys])


class EpochLoader(DataLoader):
    """A DataLoader over a :class:`~ddpkit.data.ShardedBatchSampler` that counts an epoch when an iteration has
    handed over its last batch: an iterator left before (a peek with ``next(iter(loader))``, a ``break``)
    leaves the sampler where it was.

    The sampler cannot tell by itself: the DataLoader's workers read it ahead of the batches they return
    (``prefetch_factor`` per worker), so a short epoch's indices are all read by the time the first batch is out.

    Its :meth:`state_dict` is where the loop stands (epoch, and samples of it handed over on all ranks) with the
    data's fingerprint (:mod:`ddpkit.data.fingerprint`); :meth:`load_state_dict` resumes from it, refusing data
    that changed since, unless ``on_data_change="restart_epoch"``.
    """

    def __init__(self, *args: Any, on_data_change: OnDataChange = "error", **kwargs: Any) -> None:
        """``DataLoader``'s arguments, with a :class:`~ddpkit.data.ShardedBatchSampler` as ``batch_sampler``."""
        check_on_data_change(on_data_change)
        super().__init__(*args, **kwargs)
        self.on_data_change = on_data_change
        self.data_changes: list[str] = []
        """What :meth:`load_state_dict` found changed and accepted (``on_data_change="restart_epoch"``)."""
        self._pass: _CountedIterator | None = None
        self._fingerprint: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a wrapper of the DataLoader's iterator
        sampler = self.batch_sampler
        assert isinstance(sampler, ShardedBatchSampler)  # build_loader's
        sampler.counts_epochs = False
        token = sampler.position_token()  # before the DataLoader reads the sampler, which it starts on now
        self._pass = _CountedIterator(super().__iter__(), sampler, token)
        return self._pass

    def fingerprint(self) -> dict[str, Any]:
        """What decides which sample comes at which step: the sampler's settings and the dataset's own (a
        stream's files, sizes and window), the world size aside. Computed once."""
        if self._fingerprint is None:
            sampler = cast(ShardedBatchSampler, self.batch_sampler)
            own = getattr(self.dataset, "fingerprint", None)
            self._fingerprint = sampler.fingerprint() | (own() if callable(own) else {})
        return self._fingerprint

    def position(self) -> tuple[int, int]:
        """``(epoch, cursor)``: the epoch of the batches being handed over (or the next one), and its samples
        handed over so far on all ranks; an epoch handed over whole is the next epoch at cursor 0."""
        sampler = cast(ShardedBatchSampler, self.batch_sampler)
        live = self._pass
        if live is not None and live.token == sampler.position_token():
            steps = live.first + live.handed
            if steps >= sampler.steps_per_epoch:
                return sampler.epoch + 1, 0
            return sampler.epoch, steps * sampler.global_batch_size
        epoch, first = sampler.epoch, sampler._first_step()
        return (epoch + 1, 0) if first >= sampler.steps_per_epoch else (epoch, first * sampler.global_batch_size)

    def state_dict(self) -> dict[str, Any]:
        """Where the loop stands (:meth:`position`) and the data's fingerprint: save it with the model."""
        epoch, cursor = self.position()
        return {"epoch": epoch, "cursor": cursor, "fingerprint": self.fingerprint()}

    def changes_since(self, state: dict[str, Any]) -> list[str]:
        """What differs between the data of :meth:`state_dict`'s ``state`` and this loader's, item by item
        (``"window: 32 -> 64"``): empty when a resume from it sees the same samples in the same steps. A check
        to run before anything else is loaded; :meth:`load_state_dict` runs it too."""
        return changes(state["fingerprint"], self.fingerprint())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue where :meth:`state_dict` was taken (on any rank, at any world size
        with the same global batch). Refused, naming each change, if the data's fingerprint differs; with
        ``on_data_change="restart_epoch"`` the epoch starts again from its first step instead
        (:attr:`data_changes` says why)."""
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        self.data_changes = self.changes_since(state)
        sampler = cast(ShardedBatchSampler, self.batch_sampler)
        if self.data_changes:
            if self.on_data_change != "restart_epoch":
                raise refusal(self.data_changes, epoch, cursor)
            cursor = 0
        sampler.set_position(epoch, cursor)


class _CountedIterator:
    def __init__(self, batches: Iterator[Any], sampler: ShardedBatchSampler, token: tuple[int, int]) -> None:
        self.batches, self.sampler, self.token = batches, sampler, token
        self.first = sampler._first_step()
        self.handed = 0
        """Batches handed over."""

    def __iter__(self) -> _CountedIterator:
        return self

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]  # the DataLoader's iterator has one

    def __next__(self) -> Any:
        try:
            batch = next(self.batches)
        except StopIteration:
            self.sampler.end_epoch(self.token)
            raise
        self.handed += 1
        return batch


def check_map_style(dataset: Any) -> None:
    """Refuse a dataset the samplers cannot shard: an ``IterableDataset`` or one without a length."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ConfigError(
            f"a {type(dataset).__name__} is not a map-style dataset (with __len__ and __getitem__): build_loader "
            "and the Trainer shard, shuffle and resume by sample index, which a plain stream does not have. Wrap "
            "it in a stream of ddpkit.data.stream_sources (JsonlStream, TokenStream, IterableStream(dataset, "
            "num_records), which every rank and loader worker reads whole) or a ddpkit.data.stream.Stream of your "
            "own with positional reads, or load it into a map-style Dataset"
        )


def _is_stream(dataset: Any) -> bool:
    # ddpkit.data.stream needs numpy; a stream exists only once that module is imported, so no import here.
    stream = sys.modules.get("ddpkit.data.stream")
    return stream is not None and isinstance(dataset, stream.Stream)


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
    on_data_change: OnDataChange = "error",
) -> EpochLoader:
    """A training loader over this rank's shard; ``batch_size`` is per rank.

    The loader gets its own ``torch.Generator``: without one, every ``iter()`` draws the workers' base seed
    from the global RNG, which shifts dropout masks and any other draw that follows. ``seed_samples``: each
    sample is loaded with the RNGs seeded from ``(seed, epoch, index)`` (see
    :class:`~ddpkit.data.SeededSamples`); False leaves the draws to each worker's own stream (or the main
    process's), as a plain DataLoader does. A ``TensorDataset`` is never wrapped: it draws nothing.

    ``loader.state_dict()`` is where the loop stands with the data's fingerprint (its length, or a stream's
    files, sizes and window; the seed, shuffle, drop_last, the global batch); ``loader.load_state_dict(state)``
    resumes there and refuses data that changed since, naming each change. ``on_data_change="restart_epoch"``
    accepts the change and trains the saved epoch again from its first step (:class:`EpochLoader`).
    """
    check_on_data_change(on_data_change)
    if _is_stream(dataset):
        from ddpkit.data.stream import build_stream_loader

        return build_stream_loader(
            cast(Any, dataset),  # a Stream, as _is_stream said
            batch_size,
            loader_kwargs=_loader_kwargs(num_workers, pin_memory),
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            collate_fn=collate_fn,
            group=group,
            seed_samples=seed_samples,
            on_data_change=on_data_change,
        )
    check_map_style(dataset)
    # A TensorDataset only indexes tensors: it draws nothing, not even worth watching for draws.
    seed_samples = seed_samples and type(dataset) is not TensorDataset
    sampler = ShardedBatchSampler(
        cast(Sized, dataset),  # check_map_style made sure it has a length
        batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        group=group,
        keyed=seed_samples,
    )
    generator = torch.Generator()
    generator.manual_seed(stream_seed("loader", seed, sampler.rank))  # per-rank worker seeds: ranks augment differently
    return EpochLoader(
        SeededSamples(dataset, seed) if seed_samples else dataset,
        batch_sampler=sampler,
        collate_fn=collate_fn,
        generator=generator,
        on_data_change=on_data_change,
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
        sampler=EvalShardSampler(cast(Sized, dataset), group=group),  # check_map_style made sure it has a length
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
