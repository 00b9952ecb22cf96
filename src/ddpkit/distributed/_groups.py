"""Groups of ranks: the job split once into groups that each train their own model."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from ddpkit._errors import ConfigError, checked_arguments
from ddpkit._internals.groups import align_group_count
from ddpkit.distributed._runtime import Runtime, get_runtime


@checked_arguments
def split_world(group_size: int) -> Runtime:
    """Split the job into groups of ``group_size`` consecutive ranks; return this rank's group as a
    Runtime. Collective: every rank calls it, once, with the same size."""
    rt = get_runtime()
    if group_size < 1 or rt.world_size % group_size:
        raise ConfigError(
            f"group_size={group_size} does not divide the job's {rt.world_size} ranks into whole "
            f"groups: pick a divisor of {rt.world_size} "
            f"({', '.join(str(d) for d in range(1, rt.world_size + 1) if rt.world_size % d == 0)})"
        )
    if rt.group is not None:
        raise ConfigError(
            "split_world() splits the whole job: call it on the runtime of init(), not of a group"
        )
    if not rt.distributed:
        return rt
    # every rank creates every group, in the same order (torch requires it), under the same names
    align_group_count()
    groups = [
        dist.new_group(list(range(start, start + group_size)))
        for start in range(0, rt.world_size, group_size)
    ]
    index = rt.rank // group_size
    return dataclasses.replace(
        rt, rank=rt.rank % group_size, world_size=group_size, group=groups[index], group_index=index
    )
