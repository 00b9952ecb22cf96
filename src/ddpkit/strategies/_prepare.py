"""Putting a model on the device, optionally with global-batch BatchNorm, inside DDP; and taking it
out."""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit._internals.compiler import at_backward_end
from ddpkit._internals.modules import compiled_inner
from ddpkit.distributed import Group
from ddpkit.distributed import _progress as marks
from ddpkit.distributed._progress import Phase
from ddpkit.distributed._runtime import Runtime, get_runtime
from ddpkit.distributed._seeding import seed_rank
from ddpkit.nn._batchnorm import convert_sync_batchnorm

GRADIENT_AS_BUCKET_VIEW = True
"""DDP's ``gradient_as_bucket_view`` where the caller does not set it (torch's default is False).

Each gradient is then a view into the bucket DDP all-reduces, so the all-reduced bucket is not
copied back into separate gradient tensors, and the gradients take no memory of their own (one copy
of the gradients less per rank). ``python bench/bucket_views.py`` (an MLP with 620 KB of gradients,
three instances of each kind paired in one job, 2026-11-27): in one process, 14 to 19 us a step
less for a hand-written step and 9 to 14 us for the Trainer's; on 2 ranks over gloo on 2 cores, -24
to +7 us, 2 of 12 intervals below zero and none above, where the Trainer's NaN/inf verdict is then
the first to read what the all-reduce wrote (docs/trainer.md). On one H200 at one rank over nccl
(``--nproc 1 --hidden 4096``, 64.4 MiB of gradients): 56 to 104 us a step less (5 to 7%), and 64.4
MiB less held.

The values are torch's default's bit for bit where the gradients are set to None between steps
(``zero_grad()``'s default, and the Trainer's). Where they are zeroed in place
(``zero_grad(set_to_none=False)``) torch divides the bucket views by the world size where it
multiplied the copies by its inverse, which may differ in the last bit at a world size that is not a
power of two. A script that detaches a gradient in place (``p.grad.detach_()``) gets torch's error
naming this option: pass ``gradient_as_bucket_view=False``."""


def prepare_model(
    model: nn.Module,
    *,
    sync_batchnorm: bool = False,
    runtime: Runtime | None = None,
    process_group: Group = None,
    seed_ranks: bool = True,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Move ``model`` to this rank's device and wrap it in ``DistributedDataParallel``.

    ``sync_batchnorm`` normalises BatchNorm layers over the global batch (torch's SyncBatchNorm on
    CUDA, :class:`~ddpkit.nn._batchnorm.CPUSyncBatchNorm` elsewhere). Other keyword arguments go to
    DDP (``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view``: True unless
    given, :data:`GRADIENT_AS_BUCKET_VIEW`). Without a process group (plain ``python``) the model is
    returned on its device, unwrapped: the same script runs as one process. DDP broadcasts rank 0's
    parameters and buffers when it wraps, so every rank starts from the same weights.
    ``process_group`` (default: the runtime's group, the whole job unless it is a group of
    :func:`~ddpkit.split_world`) is the group whose ranks train this model together.

    Then, with ``seed_ranks`` (the default), each rank gets its own random streams (python, numpy,
    torch), seeded from ``torch.initial_seed()`` (the seed :func:`~ddpkit.seed_everything` set) and
    its rank in the group (:func:`~ddpkit.distributed._seeding.seed_rank`): the seed that made the
    initial weights alike would otherwise give every rank the same dropout masks for its share of
    the global batch. A world of one draws as rank 0. ``seed_ranks=False`` leaves the streams as
    they are.

    ``state_dict()`` has the module's keys at every world size (without DDP's ``module.``), and
    ``load_state_dict`` takes them (and DDP's): a checkpoint saved with
    ``torch.save(model.state_dict(), path)`` loads at any world size (:func:`keys_of_the_module`).
    """
    rt = runtime or get_runtime()
    process_group = rt.group if process_group is None else process_group
    model = model.to(rt.device)
    if sync_batchnorm and rt.distributed:
        model = convert_sync_batchnorm(model, rt.device, process_group)
    if rt.distributed:
        device_ids = [rt.device.index] if rt.device.type == "cuda" else None
        ddp_kwargs.setdefault("gradient_as_bucket_view", GRADIENT_AS_BUCKET_VIEW)
        model = DDP(model, device_ids=device_ids, process_group=process_group, **ddp_kwargs)
        keys_of_the_module(model)
        mark_gradient_sync(model)
    if seed_ranks:  # after DDP's broadcast: the weights are rank 0's everywhere
        rank = rt.rank if process_group is rt.group else get_runtime(process_group).rank
        seed_rank(torch.initial_seed(), rank)
    return model


def mark_gradient_sync(ddp: DDP) -> None:
    """Under ``ddpkit run``, mark the end of each backward through ``ddp``, where DDP waits for the
    all-reduce of the gradients (:data:`~ddpkit.distributed._progress.Phase.GRADIENT_SYNC`).

    A rank stalled in its forward and a rank that waits for it in that all-reduce were both in
    "forward/backward" at the same step, so the launcher's stall watch saw them at one place and
    named neither until the collective timeout: marked so, the waiting rank is ahead, and the
    stalled one is named in seconds. A hook before the accumulation of one parameter's gradient
    queues the mark at the backward's end, ahead of DDP's wait (queued at the last gradient): one
    call a backward, none a forward, and nothing outside ``ddpkit run``. Under
    ``find_unused_parameters`` (or ``static_graph``) that parameter may get no gradient, on some
    ranks only, and a rank waiting unmarked would look behind one waiting marked: no mark then.
    Where a backward nested in the step's (reentrant checkpointing) accumulates it, or under
    compiled autograd, a step's mark is early or missing on every rank alike: the watch then judges
    as it did without it.
    """
    node = accumulation_of_a_parameter(ddp)
    if node is None or not marks.watched():
        return
    node.register_prehook(_accumulating)
    # a leaf keeps its accumulation node only while something refers to it: the hook with it
    _ACCUMULATION[ddp] = node


_ACCUMULATION: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def accumulation_of_a_parameter(model: nn.Module) -> Any:
    """Under DDP, the gradient accumulation node of a parameter that DDP requires a gradient for in
    every backward; None elsewhere, and where DDP does not require them all
    (``find_unused_parameters``, ``static_graph``). What a hook of every backward's end hangs on
    (the stall watch's mark here, the step timings' ``comm``)."""
    edge_of = getattr(torch.autograd.graph, "get_gradient_edge", None)
    if (
        not isinstance(model, DDP)
        or edge_of is None
        or model.find_unused_parameters
        or model.static_graph
    ):
        return None
    ignored = set(getattr(model, "parameters_to_ignore", ()))
    for name, p in model.module.named_parameters():
        if p.requires_grad and name not in ignored:
            return edge_of(p).node
    return None


def _accumulating(_grad_outputs: Any) -> None:
    # Under compiled autograd the hook is traced into the backward's graph, where the engine's
    # callbacks are refused: that backward goes unmarked.
    if not torch.compiler.is_compiling():
        at_backward_end(_gradients_computed)


def _gradients_computed() -> None:
    marks.mark(Phase.GRADIENT_SYNC)


def keys_of_the_module(ddp: DDP) -> None:
    """Make ``ddp.state_dict()`` keyed as its module's, without DDP's ``module.``, and
    ``ddp.load_state_dict`` take such keys (and DDP's own).

    A world of one has no DDP around the module: with DDP's keys a checkpoint saved as
    pytorch/examples saves it (``torch.save(model.state_dict(), path)``) would load strictly only at
    the world size it was saved at. The hooks act at any depth (a DDP inside a container). The
    modules' version metadata keeps DDP's names; torch reads a dict of the current layout without
    it. torch's distributed checkpoint (``get_state_dict``) expects DDP's names from a DDP: give it
    :func:`unwrap`'s module, as the strategies do.
    """
    ddp.register_state_dict_post_hook(_drop_prefix)
    ddp.register_load_state_dict_pre_hook(_add_prefix)


def _drop_prefix(
    ddp: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    inner = prefix + "module."
    # DDP's entries are the dict's last (its post-hook runs once they are in): re-added in order,
    # they stay so.
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_prefix(ddp: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    # A key of the module as it is gets DDP's prefix; one already under it (a DDP checkpoint) is
    # left. Where a key could be either (the module has a child named "module"), it is read as the
    # module's: state_dict() writes no other.
    module = ddp.module
    assert isinstance(module, nn.Module)
    own = set(module.state_dict(keep_vars=True))
    for key in [k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] in own]:
        state_dict[prefix + "module." + key[len(prefix) :]] = state_dict.pop(key)


def no_sync(model: nn.Module) -> AbstractContextManager[Any]:
    """``model.no_sync()`` inside DDP; nothing to skip otherwise. For gradient accumulation in a
    hand-written loop: the backward passes of all micro-batches but a step's last run under it, so
    the gradients are all-reduced once per step. :func:`prepare_model` returns the bare module in a
    world of one, which has no ``no_sync``; with this the same loop runs there."""
    inner: Any = model
    # torch.compile's wrapper
    while not isinstance(inner, DDP) and compiled_inner(inner) is not None:
        inner = compiled_inner(inner)
    return inner.no_sync() if isinstance(inner, DDP) else nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (and ``torch.compile``) wrappers: what to save, load or
    evaluate."""
    while True:
        if isinstance(model, DDP):
            inner = model.module
        elif compiled_inner(model) is not None:  # torch.compile's OptimizedModule
            inner = compiled_inner(model)
        else:
            return model
        # read through Module.__getattr__, typed Tensor | Module
        assert isinstance(inner, nn.Module)
        model = inner
