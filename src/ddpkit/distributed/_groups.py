"""Groups of ranks: the job split once into groups that each train their own model with DDP.

A hyper-parameter search trains one candidate per group of ``k`` ranks. Making a process group per
candidate (the tutorials' new store on ``29500 + worker`` per trial) fails on the second candidate
with EADDRINUSE and collides between jobs on one node; the groups are made once here, from the job's
own store, and reused.

Everything ddpkit does takes its group explicitly: the Trainer (``group=``),
:func:`~ddpkit.prepare_model` (DDP's ``process_group``), the samplers and loaders,
:func:`~ddpkit.evaluate`, the collectives, ``print0``, seeding and snapshots count ranks within that
group, so a Trainer on a group of 2 ranks inside a 4-process job trains exactly what it trains alone
in a 2-process job.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from ddpkit._errors import ConfigError
from ddpkit.distributed._runtime import Runtime, get_runtime


def split_world(group_size: int) -> Runtime:
    """Split the job into groups of ``group_size`` consecutive ranks; return this rank's group as a
    Runtime.

    Collective: every rank of the job calls it, once, with the same size (each call makes new
    process groups). Consecutive ranks keep a group on one node where the node's rank count allows,
    so its all-reduces stay on the node's fast links. Pass ``runtime.group`` wherever a ``group`` is
    taken.
    """
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
    # Every rank creates every group (torch requires it, even of groups it is not in), in the same
    # order.
    groups = [
        dist.new_group(list(range(start, start + group_size)))
        for start in range(0, rt.world_size, group_size)
    ]
    index = rt.rank // group_size
    return dataclasses.replace(
        rt, rank=rt.rank % group_size, world_size=group_size, group=groups[index], group_index=index
    )
