"""Fully sharded data parallelism: ``torch.distributed.fsdp.fully_shard`` (FSDP2). Parameters,
gradients and optimizer state are sharded over the group's ranks; whether a step's gradients are
finite, and their norm for clipping, are decided over all shards with one all-reduce of two numbers
a step."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ddpkit._errors import ConfigError, check_types, checked_arguments
from ddpkit._internals.versions import FSDP_ON_CPU, require_torch
from ddpkit.distributed._runtime import Runtime
from ddpkit.nn._batchnorm import convert_sync_batchnorm
from ddpkit.strategies._base import (
    GradientVerdict,
    load_state,
    made_up_state_cleared,
    read_state,
    rebuild_optimizer,
    state_options,
)
from ddpkit.strategies._prepare import rank_zeros

# torch.distributed.fsdp and DTensor are imported where used (slow to import)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(kw_only=True)
class FSDPConfig:
    """The ``fsdp`` strategy and its options: ``TrainerConfig(strategy=FSDPConfig(...))``."""

    name: ClassVar[str] = "fsdp"

    shard_blocks: list[str] = field(default_factory=list)
    """Class names (``TransformerBlock``, or ``package.module.TransformerBlock``) of the blocks that
    are sharded, gathered and freed one at a time; the root module holds the rest. Without any, the
    whole model is one unit: all of it is gathered for the forward pass, and the saving is in
    optimizer state and gradients."""
    param_dtype: str | None = None
    """Mixed precision: the dtype (``bf16``, ``fp16``) parameters are gathered in and the forward
    and backward run in; sharded parameters and optimizer state stay fp32. None: the parameters' own
    dtype."""
    reduce_dtype: str | None = None
    """The dtype gradients are reduce-scattered in (default: ``param_dtype``); ``fp32`` keeps the
    reduction exact while computing in 16 bits."""
    reshard_after_forward: bool = True
    """Free gathered parameters after each block's forward and gather them again for its backward
    (least memory); False keeps them from forward to backward (one all-gather less per block)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory, and step the optimizer
    there (for a model that fits only this way; each step copies shards to and from the device)."""

    def __post_init__(self) -> None:
        check_types(self)
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _DTYPES:
                raise ConfigError(f"{name}={value!r}: pick one of {', '.join(_DTYPES)} or None")

    def mixed_precision(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(
            param_dtype=_DTYPES[self.param_dtype] if self.param_dtype else None,
            reduce_dtype=_DTYPES[self.reduce_dtype] if self.reduce_dtype else None,
        )


def shard_model(model: nn.Module, mesh: Any, config: FSDPConfig) -> nn.Module:
    """Apply ``fully_shard`` to each block named in ``config.shard_blocks``, then to the root."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "mp_policy": config.mixed_precision(),
        "offload_policy": CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy(),
    }
    found = set()
    for module in list(model.modules())[1:]:
        cls = type(module)
        names = {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}
        match = names & set(config.shard_blocks)
        if match:
            found |= match
            fully_shard(module, reshard_after_forward=config.reshard_after_forward, **kwargs)
    missing = set(config.shard_blocks) - found
    if missing:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ConfigError(
            f"shard_blocks names {sorted(missing)}, which the model does not contain: its module "
            f"classes are {classes}"
        )
    # the root's parameters are needed again at once by the backward: kept gathered
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


class FSDPStrategy:
    """Sharded parameters, gradients and optimizer state."""

    name = "fsdp"
    replicated = False

    @checked_arguments
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        runtime: Runtime,
        config: FSDPConfig | None = None,
        sync_batchnorm: bool = False,
    ) -> None:
        if not runtime.distributed:
            raise ConfigError(
                "strategy 'fsdp' shards over a process group: launch with `ddpkit run` (or "
                "ddpkit.spawn), or use strategy 'ddp' for a single process"
            )
        if runtime.device.type == "cpu":
            require_torch(
                "strategy 'fsdp' on the CPU (gloo)",
                FSDP_ON_CPU,
                instead="use strategy 'ddp' or 'zero' on the CPU, or fsdp on GPUs",
            )
        self.config = config or FSDPConfig()
        self.runtime = runtime
        group = runtime.group if runtime.group is not None else dist.group.WORLD
        assert group is not None  # runtime.distributed: the default group exists
        self.group = group
        names = {id(p): n for n, p in model.named_parameters()}
        model = model.to(runtime.device)
        if sync_batchnorm:
            model = convert_sync_batchnorm(model, runtime.device, runtime.group)
        # ranks start from rank 0's weights, as under DDP: each rank's copy is its shard's source
        rank_zeros([*model.parameters(), *model.buffers()], self.group)
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(self.group, runtime.device.type)
        self.model = shard_model(model, mesh, self.config)
        self.optimizer = rebuild_optimizer(optimizer, dict(self.model.named_parameters()), names)
        stepped = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        self.params = [p for p in self.model.parameters() if p.requires_grad and id(p) in stepped]
        self._loss_flags: list[torch.Tensor] = []

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        # gradients stay local; the last micro-batch's backward reduce-scatters their sum
        from torch.distributed.fsdp import FSDPModule

        root = self.model
        assert isinstance(root, FSDPModule)  # shard_model's fully_shard made the root one
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)

    def mark_nonfinite(self, loss: torch.Tensor) -> torch.Tensor:
        # the flag rides on the verdict's all-reduce (a shard's gradient is on one rank only)
        self._loss_flags.append(~torch.isfinite(loss.detach()).all())
        return loss

    def check_gradients(self, max_norm: float | None = None) -> GradientVerdict:
        local = [_local(p.grad) for p in self.params if p.grad is not None]
        device = local[0].device if local else self.runtime.device
        sumsq = torch.zeros((), dtype=torch.float64, device=device)
        for norm in torch._foreach_norm(local) if local else []:
            sumsq += norm.double() ** 2
        bad_losses = torch.stack(self._loss_flags).sum() if self._loss_flags else torch.zeros(())
        self._loss_flags.clear()
        # each element lives on one rank: the squares add up to the square of the global norm
        totals = torch.stack([sumsq, bad_losses.to(device=device, dtype=torch.float64)])
        dist.all_reduce(totals, group=self.group)
        norm = totals[0].sqrt()
        if not math.isfinite(norm.item()) or totals[1].item():
            return GradientVerdict(False, norm)
        if max_norm is not None:
            # torch's clip_grads_with_norm_ arithmetic, on the local shards
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(local, coef.to(local[0].dtype) if local else coef)
        return GradientVerdict(True, norm)

    @contextmanager
    def evaluation(self) -> Iterator[None]:
        # Every block gathered once for the whole evaluation: a sharded forward is a collective,
        # and ranks evaluate different numbers of batches.
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for module in modules:
            module.set_reshard_after_forward(False)
            module.unshard()
        # buffers follow each rank's own batches: rank 0's everywhere, as under DDP
        rank_zeros(self.model.buffers(), self.group)
        try:
            yield
        finally:
            for module in modules:
                module.reshard()
                module.set_reshard_after_forward(
                    False if module is self.model else self.config.reshard_after_forward
                )

    def join(self) -> AbstractContextManager[Any]:
        raise ConfigError(
            "strategy 'fsdp' cannot join uneven inputs (FSDP's all-gathers have no Join support in "
            "torch): give every rank the same number of batches (the Trainer's sampler does, as "
            "does drop_last=True)"
        )

    def state_dict(self) -> dict[str, Any]:
        return read_state(self.model, self.optimizer)  # parameters and their state are DTensors

    def model_weights(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        options = state_options(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.model, options=options)

    def full_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        options = state_options(full_state_dict=True)
        with made_up_state_cleared(self.optimizer):
            model_state, optim_state = get_state_dict(self.model, self.optimizer, options=options)
        return {"model": model_state, "optim": optim_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_state(self.model, self.optimizer, state)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view: writing to it writes the gradient), or the tensor
    itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
