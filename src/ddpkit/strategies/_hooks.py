"""DDP communication hooks: what DDP does with each bucket of gradients instead of a plain
all-reduce.

``fp16`` and ``powersgd`` are torch's own hooks. ``bf16`` is a small hook of ours. torch refuses its
``bf16_compress_hook`` by the *build* of torch, whatever the backend:
``DistributedDataParallel.register_comm_hook`` checks the hook's name and wants a build with CUDA
(or ROCm) and NCCL 2.10+ (or XPU and XCCL). A CUDA build accepts it on gloo too and averages the
same bfloat16 gradients there; the CPU build refuses it, although gloo reduces bfloat16 tensors.
Ours does the same arithmetic under another name, so that ``bf16`` works on every build.
``parameter_server`` is the parameter-server pattern of the tutorials, written as a hook.
"""

# No ``from __future__ import annotations`` here: DDP checks the hooks' annotations as objects
# (``bucket: dist.GradBucket``), and postponed annotations are strings.
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from ddpkit.distributed import Group


def bf16_compress(
    process_group: Group, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in bfloat16: half the bytes on the wire, 8 bits of mantissa per
    gradient.

    Divided by the world size before the reduction, as torch's hooks do, so that the sum cannot
    overflow where the mean would not.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: torch.futures.Future[Any]) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)


def parameter_server(
    process_group: Group, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """The parameter-server pattern: each bucket has a server rank (bucket index mod world size)
    that sums every worker's copy (fan-in) and sends the mean back to all (fan-out).

    Servers are the training ranks themselves, one per slice of the parameters, as in sharded
    parameter servers. The result equals an all-reduce up to the order of the additions; the
    pattern's traffic does not: a server takes in ``N - 1`` copies of its slice (the fan-in that
    limits parameter servers), where a ring all-reduce moves ``2 (N - 1) / N`` of a bucket per rank
    (how the backend carries out the reduce may differ). It runs synchronously inside backward (no
    overlap), which is what the pattern costs; a recipe to read and compare, not a speed-up.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None  # DDP runs its hooks only over a process group
    world = dist.get_world_size(group)
    server = dist.get_global_rank(group, bucket.index() % world)
    buffer = bucket.buffer()
    dist.reduce(buffer, dst=server, group=group)
    dist.broadcast(buffer, src=server, group=group)
    buffer.div_(world)
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


CommHook = Literal["fp16", "bf16", "powersgd", "parameter_server"]
COMM_HOOKS: tuple[str, ...] = get_args(CommHook)


def register(
    model: Any,
    hook: CommHook,
    process_group: Group,
    *,
    powersgd_rank: int,
    powersgd_start_iter: int,
) -> None:
    """Register the hook named ``hook`` (one of ``COMM_HOOKS``) on the DDP ``model``."""
    if hook == "fp16":
        model.register_comm_hook(process_group, default_hooks.fp16_compress_hook)
    elif hook == "bf16":
        model.register_comm_hook(process_group, bf16_compress)
    elif hook == "parameter_server":
        model.register_comm_hook(process_group, parameter_server)
    elif hook == "powersgd":
        # Low-rank compression with error feedback; the first ``start_powerSGD_iter`` steps are
        # plain all-reduces (torch's advice: compressing from the start hurts accuracy). The
        # error-feedback state lives in the hook and is not in snapshots: a resumed run restarts
        # that warm-up.
        state = powerSGD_hook.PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=powersgd_start_iter,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    else:
        raise ValueError(hook)
