"""Putting a model on the device, optionally with global-batch BatchNorm, inside DDP; taking it
out; and a hand-written loop's models and optimizers as a snapshot holds them."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit._errors import ConfigError, checked_arguments
from ddpkit._internals.compiler import at_backward_end
from ddpkit._internals.modules import compiled_inner
from ddpkit._internals.optim import reduce_in_rebuilt_buckets
from ddpkit.distributed import Group
from ddpkit.distributed import _progress as marks
from ddpkit.distributed._progress import Phase
from ddpkit.distributed._runtime import Runtime, get_runtime
from ddpkit.distributed._seeding import seed_rank
from ddpkit.nn._batchnorm import convert_sync_batchnorm
from ddpkit.strategies._base import load_state, read_state

GRADIENT_AS_BUCKET_VIEW = True
"""DDP's ``gradient_as_bucket_view`` where the caller does not set it (torch's default is False):
docs/trainer.md, "Gradients as views into DDP's buckets"."""


@checked_arguments
def prepare_model(
    model: nn.Module,
    *,
    sync_batchnorm: bool = False,
    runtime: Runtime | None = None,
    process_group: Group = None,
    seed_ranks: bool = True,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Move ``model`` to this rank's device and wrap it in ``DistributedDataParallel``; a model with
    no parameter to train (a frozen teacher), which DDP refuses, gets rank 0's weights and buffers
    as DDP's constructor gives them, unwrapped.

    ``sync_batchnorm`` normalises BatchNorm layers over the global batch (torch's SyncBatchNorm on
    CUDA, :class:`~ddpkit.nn.CPUSyncBatchNorm` elsewhere). Other keyword arguments go to DDP
    (``gradient_as_bucket_view`` is True unless given). Without a process group the model is
    returned on its device, unwrapped: the same script runs as one process. DDP broadcasts rank 0's
    parameters and buffers, so every rank starts from the same weights. ``process_group`` (default:
    the runtime's group) is the group whose ranks train this model together.

    With ``seed_ranks`` (the default), each rank then gets its own random streams, seeded from
    ``torch.initial_seed()`` and its rank in the group, so ranks draw different dropout masks; a
    world of one draws as rank 0.

    Every step all-reduces each gradient in the buckets DDP rebuilds after its first step, the
    first step included: a model wrapped anew to resume sums as the uninterrupted run did, bitwise
    at any world size, unless a comm hook of the caller's is registered before the first forward.

    ``state_dict()`` has the module's keys at every world size (without DDP's ``module.``), and
    ``load_state_dict`` takes them (and DDP's): a checkpoint loads at any world size.
    """
    rt = runtime or get_runtime()
    process_group = rt.group if process_group is None else process_group
    model = model.to(rt.device)
    if sync_batchnorm and rt.distributed:
        model = convert_sync_batchnorm(model, rt.device, process_group)
    if rt.distributed and not any(p.requires_grad for p in model.parameters()):
        # as DDP's constructor gives them; no broadcast before each forward (a frozen teacher runs
        # under no_grad, where DDP sends none either)
        rank_zeros([*model.parameters(), *model.buffers()], process_group)
    elif rt.distributed:
        device_ids = [rt.device.index] if rt.device.type == "cuda" else None
        ddp_kwargs.setdefault("gradient_as_bucket_view", GRADIENT_AS_BUCKET_VIEW)
        model = DDP(model, device_ids=device_ids, process_group=process_group, **ddp_kwargs)
        reduce_in_rebuilt_buckets(model)
        keys_of_the_module(model)
        # under ``ddpkit run``, the end of each backward, where DDP waits for the gradients'
        # all-reduce, is marked (``Phase.GRADIENT_SYNC``, for the stall watch)
        node = accumulation_of_a_parameter(model)
        if node is not None and marks.watched():
            node.register_prehook(_accumulating)
            # a leaf keeps its accumulation node only while something refers to it
            _ACCUMULATION[model] = node
    if seed_ranks:  # after DDP's broadcast: the weights are rank 0's everywhere
        rank = rt.rank if process_group is rt.group else get_runtime(process_group).rank
        seed_rank(torch.initial_seed(), rank)
    return model


def rank_zeros(tensors: Iterable[torch.Tensor], group: Group) -> None:
    """Give every rank of ``group`` rank 0's values of ``tensors`` (collective)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for tensor in tensors:
        dist.broadcast(tensor.data, src, group=group)


_ACCUMULATION: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def accumulation_of_a_parameter(model: nn.Module) -> Any:
    """Under DDP, the gradient accumulation node of a parameter DDP requires a gradient for in every
    backward; None elsewhere, and under ``find_unused_parameters`` or ``static_graph``. What a hook
    of every backward's end hangs on (the stall watch's mark, the step timings' ``comm``)."""
    if not isinstance(model, DDP) or model.find_unused_parameters or model.static_graph:
        return None
    ignored = set(getattr(model, "parameters_to_ignore", ()))
    for name, p in model.module.named_parameters():
        if p.requires_grad and name not in ignored:
            return torch.autograd.graph.get_gradient_edge(p).node
    return None


def _accumulating(_grad_outputs: Any) -> None:
    # under compiled autograd the engine's callbacks are refused: that backward goes unmarked
    if not torch.compiler.is_compiling():
        at_backward_end(_in_gradient_sync)


def _in_gradient_sync() -> None:
    """At the backward's end, before DDP's own callback waits for the gradients' all-reduce: the
    rank is in it until a callback queued now, which runs after DDP's, marks it out (a rank that
    went on to its own code is never taken for one waiting in DDP's all-reduce)."""
    marks.mark(Phase.GRADIENT_SYNC)
    at_backward_end(partial(marks.mark, Phase.LOOP))


def keys_of_the_module(ddp: DDP) -> None:
    """Make ``ddp.state_dict()`` keyed as its module's, without DDP's ``module.``, and
    ``ddp.load_state_dict`` take such keys (and DDP's own), at any depth: a world of one has no DDP
    around the module. torch's distributed checkpoint expects DDP's names from a DDP: give it
    :func:`unwrap`'s module."""
    ddp.register_state_dict_post_hook(_drop_prefix)
    ddp.register_load_state_dict_pre_hook(_add_prefix)


def _drop_prefix(
    ddp: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    inner = prefix + "module."
    # DDP's entries are the dict's last: re-added in order, they stay so
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_prefix(ddp: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    # a key of the module gets DDP's prefix, one already under it is left; a key that could be
    # either (a child named "module") is the module's, as state_dict() writes it
    module = ddp.module
    assert isinstance(module, nn.Module)
    own = set(module.state_dict(keep_vars=True))
    for key in [k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] in own]:
        state_dict[prefix + "module." + key[len(prefix) :]] = state_dict.pop(key)


def no_sync(model: nn.Module) -> AbstractContextManager[Any]:
    """``model.no_sync()`` inside DDP (and ``torch.compile``), a null context otherwise: the
    backward passes of all micro-batches but a step's last run under it, in a world of one too."""
    inner: Any = model
    while not isinstance(inner, DDP) and compiled_inner(inner) is not None:
        inner = compiled_inner(inner)
    return inner.no_sync() if isinstance(inner, DDP) else nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (and ``torch.compile``) wrappers: what to save, load or
    evaluate."""
    while (inner := model.module if isinstance(model, DDP) else compiled_inner(model)) is not None:
        # read through Module.__getattr__, typed Tensor | Module
        assert isinstance(inner, nn.Module)
        model = inner
    return model


class _Optimizers:
    """Several optimizers seen as one by the snapshots in memory: their parameter groups in turn,
    and their states."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {p: s for o in self.optimizers for p, s in o.state.items()}


class LoopModel:
    """A hand-written loop's model(s) from :func:`prepare_model` (or bare modules) and their
    optimizers, with the state a :class:`~ddpkit.strategies.Strategy` gives a snapshot: parameters
    and optimizer state by parameter name, each rank's own buffers in the per-rank part. What
    :class:`ddpkit.Snapshots` saves."""

    name = "ddp"
    replicated = True

    def __init__(
        self, models: Mapping[str, nn.Module], optimizers: list[torch.optim.Optimizer]
    ) -> None:
        # torch's distributed checkpoint reads ``bare`` (unwrapped): a prepared model's state_dict
        # hooks would confuse its name map
        if list(models) == [""]:
            self.model, bare = models[""], unwrap(models[""])
            ignored = tuple(getattr(self.model, "parameters_to_ignore", ()))
        else:  # named under the ModuleDict's names
            self.model, bare = (
                nn.ModuleDict(models),
                nn.ModuleDict({k: unwrap(m) for k, m in models.items()}),
            )
            ignored = tuple(
                f"{k}.{p}"
                for k, m in models.items()
                for p in getattr(m, "parameters_to_ignore", ())
            )
        self.bare, self.ignored, self.optimizers = bare, ignored, optimizers
        self.optimizer: Any = optimizers[0] if len(optimizers) == 1 else _Optimizers(optimizers)
        params = {id(p) for p in self.model.parameters()}
        for i, opt in enumerate(optimizers):
            if any(id(p) not in params for g in opt.param_groups for p in g["params"]):
                raise ConfigError(
                    f"optimizer {i} holds a parameter of no model given to Snapshots: pass every "
                    "model its optimizers train (model={'name': model, ...})"
                )

    def state_dict(self) -> dict[str, Any]:
        return read_state(self.bare, self.optimizers, self.ignored)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_state(self.bare, self.optimizers, state)
