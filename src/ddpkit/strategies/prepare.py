"""Putting a model on the device, optionally with global-batch BatchNorm, inside DDP; and taking it out."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.distributed.runtime import Runtime, get_runtime
from ddpkit.internals.modules import compiled_inner
from ddpkit.nn.batchnorm import convert_sync_batchnorm


def prepare_model(
    model: nn.Module,
    *,
    sync_batchnorm: bool = False,
    runtime: Runtime | None = None,
    process_group: Any = None,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Move ``model`` to this rank's device and wrap it in ``DistributedDataParallel``.

    ``sync_batchnorm`` normalises BatchNorm layers over the global batch (torch's SyncBatchNorm on CUDA,
    :class:`~ddpkit.nn.batchnorm.CPUSyncBatchNorm` elsewhere). Other keyword arguments go to DDP
    (``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``...). Without a process group
    (plain ``python``) the model is returned on its device, unwrapped: the same script runs as one process.
    DDP broadcasts rank 0's parameters and buffers when it wraps, so every rank starts from the same weights.
    ``process_group`` (default: the runtime's group, the whole job unless it is a group of
    :func:`~ddpkit.split_world`) is the group whose ranks train this model together.
    """
    rt = runtime or get_runtime()
    process_group = rt.group if process_group is None else process_group
    model = model.to(rt.device)
    if sync_batchnorm and rt.distributed:
        model = convert_sync_batchnorm(model, rt.device, process_group)
    if not rt.distributed:
        return model
    device_ids = [rt.device.index] if rt.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, process_group=process_group, **ddp_kwargs)


def no_sync(model: nn.Module) -> AbstractContextManager[Any]:
    """``model.no_sync()`` inside DDP; nothing to skip otherwise. For gradient accumulation in a hand-written
    loop: the backward passes of all micro-batches but a step's last run under it, so the gradients are
    all-reduced once per step. :func:`prepare_model` returns the bare module in a world of one, which has no
    ``no_sync``; with this the same loop runs there."""
    inner: Any = model
    while not isinstance(inner, DDP) and compiled_inner(inner) is not None:  # torch.compile's wrapper
        inner = compiled_inner(inner)
    return inner.no_sync() if isinstance(inner, DDP) else nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (and ``torch.compile``) wrappers: what to save, load or evaluate."""
    while True:
        if isinstance(model, DDP):
            inner = model.module
        elif compiled_inner(model) is not None:  # torch.compile's OptimizedModule
            inner = compiled_inner(model)
        else:
            return model
        assert isinstance(inner, nn.Module)  # read through Module.__getattr__, typed Tensor | Module
        model = inner
