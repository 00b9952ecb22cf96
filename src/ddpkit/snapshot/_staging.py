"""The copy of a state in host memory that an asynchronous snapshot writes, and the process group
its writer thread uses."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed import Group


def stage(value: Any, cache: Any) -> Any:
    """``value`` copied into host memory, reusing the tensors of ``cache`` (the previous copy) where
    they fit.

    torch's caching stager (``BlockingAsyncStager(cache_staged_state_dict=True)``) pins its buffers,
    which needs an accelerator, and its uncached one allocates the whole state afresh at every save:
    on the CPU the page faults of that allocation cost more than the copy (measured: ~4x the stall).
    So the buffers are kept here, and a save after the first only copies. DTensors (fsdp's shards)
    keep their placement; their local shard is copied.
    """
    if isinstance(value, dict):
        cache = cache if isinstance(cache, dict) else {}
        return {k: stage(v, cache.get(k)) for k, v in value.items()}
    if isinstance(value, list):
        cache = (
            cache if isinstance(cache, list) and len(cache) == len(value) else [None] * len(value)
        )
        return [stage(v, c) for v, c in zip(value, cache)]
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        local = value.to_local()
        buffer = stage(local, cache.to_local() if isinstance(cache, DTensor) else None)
        return DTensor.from_local(
            buffer,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, torch.Tensor):
        fits = (
            isinstance(cache, torch.Tensor)
            and cache.shape == value.shape
            and cache.dtype == value.dtype
            and cache.device.type == "cpu"
        )
        buffer = cache if fits else torch.empty(value.shape, dtype=value.dtype, device="cpu")
        return buffer.copy_(value.detach())
    return copy.deepcopy(value)


_groups: dict[tuple[int, ...], Any] = {}


def writer_group(group: Group) -> Any:
    """A gloo process group over the ranks of ``group``, for the background writer's collectives.

    Made once per set of ranks, by those ranks alone (``use_local_synchronization``): a Trainer on a
    group of :func:`~ddpkit.split_world` must not need the rest of the job to call in.
    """
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if ranks not in _groups:
        _groups[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _groups[ranks]
