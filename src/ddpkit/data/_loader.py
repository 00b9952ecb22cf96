"""Loaders over a rank's shard: :func:`build_loader` for training, :func:`build_eval_loader` for
exact evaluation.

Random draws while loading (augmentation). :func:`build_loader` reads each sample that draws with
python, numpy and torch seeded from ``(seed, epoch, index)`` (:class:`~ddpkit.data.SeededSamples`):
a sample is augmented the same way whichever rank or loader worker loads it, at any world size and
number of workers, and a resumed run draws what the uninterrupted one drew. Without it each worker
runs its own stream on across epochs (persistent workers), which no snapshot can restore.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sized
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ddpkit._errors import ConfigError
from ddpkit.data._epoch_loader import EpochLoader, ServeStacks
from ddpkit.data._fingerprint import OnDataChange, check_on_data_change
from ddpkit.data._sample_seeding import SeededSamples
from ddpkit.data._sampler import EvalShardSampler, ShardedBatchSampler
from ddpkit.data._stream import Stream
from ddpkit.distributed import Group
from ddpkit.distributed._runtime import get_runtime
from ddpkit.distributed._seeding import stream_seed
from ddpkit.platforms._cpus import cpu_count


def check_map_style(dataset: Any) -> None:
    """Refuse a dataset the samplers cannot shard: an ``IterableDataset`` or one without a
    length."""
    if (
        isinstance(dataset, IterableDataset)
        or not hasattr(dataset, "__getitem__")
        or not hasattr(dataset, "__len__")
    ):
        raise ConfigError(
            f"a {type(dataset).__name__} is not a map-style dataset (with __len__ and "
            "__getitem__): build_loader and the Trainer shard, shuffle and resume by sample "
            "index, which a plain stream does not have. Wrap it in a stream of "
            "ddpkit.data._stream_sources (JsonlStream, TokenStream, IterableStream(dataset, "
            "num_records), which every rank and loader worker reads whole) or a "
            "ddpkit.data._stream.Stream of your own with positional reads, or load it into a "
            "map-style Dataset"
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
    group: Group = None,
    seed_samples: bool = True,
    on_data_change: OnDataChange = "error",
) -> EpochLoader:
    """A training loader over this rank's shard; ``batch_size`` is per rank.

    The loader gets its own ``torch.Generator``: without one, every ``iter()`` draws the workers'
    base seed from the global RNG, which shifts dropout masks and any other draw that follows.
    ``seed_samples``: each sample is loaded with the RNGs seeded from ``(seed, epoch, index)`` (see
    :class:`~ddpkit.data.SeededSamples`); False leaves the draws to each worker's own stream (or the
    main process's), as a plain DataLoader does. A dataset whose reads provably draw nothing (a
    ``TensorDataset``, pytorch/examples' list of samples) is read with no watch for draws.

    ``loader.state_dict()`` is where the loop stands with the data's fingerprint (its length, or a
    stream's files, sizes and window; the seed, shuffle, drop_last, the global batch);
    ``loader.load_state_dict(state)`` resumes there and refuses data that changed since, naming each
    change. ``on_data_change="restart_epoch"`` accepts the change and trains the saved epoch again
    from its first step (:class:`~ddpkit.data._epoch_loader.EpochLoader`).
    """
    check_on_data_change(on_data_change)
    if isinstance(dataset, Stream):
        # numpy: imported only for a stream
        from ddpkit.data._stream_loader import build_stream_loader

        return build_stream_loader(
            dataset,
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
    # per-rank worker seeds: ranks augment differently
    generator.manual_seed(stream_seed("loader", seed, sampler.rank))
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
    group: Group = None,
) -> DataLoader:
    """An evaluation loader over this rank's exact share: no padding, no sample on two ranks."""
    check_map_style(dataset)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        # check_map_style made sure it has a length
        sampler=EvalShardSampler(cast(Sized, dataset), group=group),
        collate_fn=collate_fn,
        generator=torch.Generator(),
        worker_init_fn=ServeStacks(),
        **_loader_kwargs(num_workers, pin_memory),
    )


def batch_len(batch: Any) -> int:
    """The samples of a batch: the first dimension of its (first) tensor. What the Trainer divides a
    micro-batch's loss by, and what its speed counts, alike."""
    # in the order of their frequency: the check against Mapping, an abstract class, costs most
    if isinstance(batch, (list, tuple)):
        return batch_len(batch[0])
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        return batch_len(next(iter(batch.values())))
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}; batches hold tensors")


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
