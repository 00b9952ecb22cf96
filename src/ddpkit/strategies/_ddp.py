"""Data parallelism under DistributedDataParallel: its knobs and communication hooks, the step
verdict without a collective, several models and optimizers under ``ddp``, and ``zero``, DDP with
the optimizer state sharded over ranks (``ZeroRedundancyOptimizer``)."""

# No ``from __future__ import annotations``: DDP checks a communication hook's annotations as
# objects (``bucket: dist.GradBucket``).
import math
from collections.abc import Mapping
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit._errors import ConfigError, check_types, checked_arguments
from ddpkit._internals.optim import any_non_finite, sparse_values
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import all_gather_object
from ddpkit.distributed._runtime import Runtime
from ddpkit.strategies._base import (
    UNSTEPPED,
    GradientVerdict,
    clear_unstepped,
    join_own,
    load_state,
    made_up_state_cleared,
    read_state,
    rebuild_optimizer,
    separate_own,
    state_options,
)
from ddpkit.strategies._prepare import GRADIENT_AS_BUCKET_VIEW, no_sync, prepare_model, unwrap

CommHook = Literal["fp16", "bf16", "powersgd", "parameter_server"]


@dataclass(kw_only=True)
class DDPConfig:
    """The ``ddp`` strategy and DistributedDataParallel's knobs:
    ``TrainerConfig(strategy=DDPConfig(...))``."""

    name: ClassVar[str] = "ddp"

    bucket_cap_mb: float | None = None
    """Size of the gradient buckets DDP all-reduces while backward runs (torch's default: 25).
    Larger buckets mean fewer, bigger messages; smaller ones start communicating earlier."""
    static_graph: bool = False
    """The set of parameters used and the graph are the same every step: DDP then learns the order
    once, and supports unused parameters and reentrant activation checkpointing without searching
    the graph."""
    gradient_as_bucket_view: bool = GRADIENT_AS_BUCKET_VIEW
    """Gradients are views into the all-reduce buckets: no copy of the all-reduced gradients, and
    no memory of their own (on by default, unlike torch's DDP)."""
    find_unused_parameters: bool = False
    """Search the graph after every forward pass for parameters that get no gradient (costly);
    needed when some parameters are not used in a step. Without it such a step fails with the
    parameters named."""
    broadcast_buffers: bool = True
    """Copy rank 0's buffers (BatchNorm running statistics) to every rank before each forward
    pass."""
    comm_hook: CommHook | None = None
    """What DDP does with each gradient bucket instead of an all-reduce in fp32: ``fp16`` or
    ``bf16`` (all-reduce compressed to 16 bits), ``powersgd`` (low-rank compression with error
    feedback), ``parameter_server`` (each bucket summed on a server rank and sent back).
    Compression changes the gradients: runs agree with plain DDP within a tolerance, not bitwise."""
    powersgd_rank: int = 1
    """PowerSGD's matrix approximation rank (higher: more accurate, more traffic)."""
    powersgd_start_iter: int = 10
    """Steps of plain all-reduce before PowerSGD starts compressing (at least 2)."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.powersgd_rank < 1 or self.powersgd_start_iter < 2:
            raise ConfigError("powersgd_rank must be >= 1 and powersgd_start_iter >= 2")
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb={self.bucket_cap_mb} must be positive")

    def ddp_kwargs(self) -> dict[str, Any]:
        names = ("static_graph", "gradient_as_bucket_view", "find_unused_parameters")
        out: dict[str, Any] = {k: getattr(self, k) for k in names}
        # passed only when changed: torch 2.13 warns that the name is deprecated
        if not self.broadcast_buffers:
            out["broadcast_buffers"] = False
        if self.bucket_cap_mb is not None:
            out["bucket_cap_mb"] = self.bucket_cap_mb
        return out

    def register_hook(self, model: Any, process_group: Group) -> None:
        """Register :attr:`comm_hook` on ``model`` when it is a DDP (not a frozen model, nor one
        process's)."""
        if self.comm_hook is None or not isinstance(model, DDP):
            return
        if self.comm_hook == "powersgd":
            # the error-feedback state lives in the hook, not in snapshots: a resume restarts the
            # warm-up of plain all-reduces
            state = powerSGD_hook.PowerSGDState(
                process_group=process_group,
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_iter,
            )
            model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        else:
            hooks = {
                "fp16": default_hooks.fp16_compress_hook,
                "bf16": bf16_compress,
                "parameter_server": parameter_server,
            }
            model.register_comm_hook(process_group, hooks[self.comm_hook])


def bf16_compress(
    process_group: Group, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the bucket in bfloat16, divided by the world size first: torch's
    ``bf16_compress_hook``, which its CPU build refuses."""
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
    """The parameter-server pattern: the bucket's server rank (its index mod the world size) sums
    every rank's copy and sends the mean back to all, synchronously inside backward. Equal to an
    all-reduce up to the order of the additions; a recipe to compare, not a speed-up."""
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


def nan_gradient_if_nonfinite(
    loss: torch.Tensor, anchor: torch.Tensor | None, on_host: bool
) -> torch.Tensor:
    """``loss``, made to give one element of ``anchor`` (a parameter DDP all-reduces) a NaN gradient
    if its value is not finite: a non-finite loss can have finite gradients, and the all-reduce then
    carries the NaN into every rank's verdict. ``on_host``: the value is read and a finite loss
    returned untouched; on an accelerator ``0 x anchor`` is added instead, without a read."""
    if anchor is None:
        return loss
    if on_host:
        return loss if math.isfinite(loss.item()) else loss + anchor.reshape(-1)[0] * float("nan")
    element = anchor.reshape(-1)[0]
    bad = torch.where(torch.isfinite(loss.detach()), 0.0, float("nan")).to(element.dtype)
    return loss + element * bad


class FiniteCheck:
    """Whether no element of a step's gradients is NaN or inf, by torch's fused check-and-unscale at
    a scale of 1: one call where the parameters are one device and one real dtype, else grouped by
    device and dtype (sparse values and complex pairs read as reals)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        kinds = {(p.device, p.dtype) for p in params}
        self._one_group = len(kinds) == 1 and not next(iter(kinds))[1].is_complex
        self._flags: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, tensors: list[torch.Tensor]) -> bool:
        if not tensors:
            return True
        if self._one_group:
            try:
                return not self._any_non_finite(tensors[0].device, tensors)
            except NotImplementedError:  # a sparse gradient: grouped, now and from now on
                self._one_group = False
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            if t.is_sparse:
                t = sparse_values(t)
            if t.is_complex():
                t = torch.view_as_real(t)
            groups.setdefault((t.device, t.dtype), []).append(t)
        return not any(self._any_non_finite(device, g) for (device, _), g in groups.items())

    def _any_non_finite(self, device: torch.device, group: list[torch.Tensor]) -> bool:
        if device not in self._flags:
            # float32 whatever the default dtype: the fused check takes no other
            zero, one = (torch.full((1,), v, dtype=torch.float32, device=device) for v in (0, 1))
            self._flags[device] = (zero, one)
        flag, one = self._flags[device]
        try:
            return any_non_finite(group, flag, one)
        finally:
            flag.zero_()  # set by a find, or left set by a refused tensor


def stepped_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters whose gradients decide a step: those the optimizer updates, that need
    gradients, and that DDP all-reduces (identical on every rank, so every rank reaches the same
    verdict)."""
    ignored = {
        id(p)
        for name, p in unwrap(model).named_parameters()
        if name in getattr(model, "parameters_to_ignore", ())
    }
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [
        p
        for p in model.parameters()
        if p.requires_grad and id(p) in stepped and id(p) not in ignored
    ]


FINITE, NOT_FINITE = GradientVerdict(True, None), GradientVerdict(False, None)


class DDPStrategy:
    """Every rank holds the whole model and optimizer; DDP all-reduces gradients during backward.
    The step verdict costs no collective: the all-reduced gradients are identical on every rank."""

    name = "ddp"
    replicated = True

    @checked_arguments
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        runtime: Runtime,
        config: DDPConfig | None = None,
        sync_batchnorm: bool = False,
        prepared: bool = False,
    ) -> None:
        """``prepared``: ``model`` is already wrapped (one of :class:`SeveralModels`'s); this
        strategy only decides its ``optimizer``'s steps."""
        self.config = config or DDPConfig()
        self.runtime = runtime
        kwargs = self.config.ddp_kwargs()
        if not prepared:
            model = prepare_model(model, sync_batchnorm=sync_batchnorm, runtime=runtime, **kwargs)
            self.config.register_hook(model, runtime.group)
        self.model = model
        self.optimizer = optimizer
        self.on_host = runtime.device.type == "cpu"
        self.params = stepped_parameters(self.model, optimizer)
        self.anchor = self.params[0] if self.params else None  # where a bad loss puts its NaN
        self._finite = FiniteCheck(self.params)
        # a parameter without a gradient stalls DDP's reducer, and torch's error comes a forward
        # later without naming it: checked after backward
        self._check_unused = runtime.distributed and not (
            kwargs.get("find_unused_parameters") or kwargs.get("static_graph")
        )
        self._names = {id(p): n for n, p in unwrap(self.model).named_parameters()}

    def no_sync(self) -> AbstractContextManager[Any]:
        return no_sync(self.model)

    def mark_nonfinite(self, loss: torch.Tensor) -> torch.Tensor:
        return nan_gradient_if_nonfinite(loss, self.anchor, self.on_host)

    def check_gradients(self, max_norm: float | None = None) -> GradientVerdict:
        grads = [g for p in self.params if (g := p.grad) is not None]  # each .grad read once
        if self._check_unused and len(grads) < len(self.params):
            unused = [self._names.get(id(p), "?") for p in self.params if p.grad is None]
            raise ConfigError(
                f"parameter(s) {', '.join(unused)} got no gradient in this step, so DDP cannot "
                "finish its all-reduce: pass strategy=DDPConfig(find_unused_parameters=True) (or "
                "static_graph=True when the same parameters are unused every step), or leave them "
                "out of the optimizer and set requires_grad=False"
            )
        if max_norm is None:
            return FINITE if self._finite(grads) else NOT_FINITE
        norm = torch.nn.utils.get_total_norm(grads)
        if not math.isfinite(norm.item()):
            return GradientVerdict(False, norm)
        torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, norm)
        return GradientVerdict(True, norm)

    def evaluation(self) -> AbstractContextManager[Any]:
        return nullcontext()  # evaluate() calls the module inside DDP: no collective

    def join(self) -> AbstractContextManager[Any]:
        if not isinstance(self.model, DDP):  # not distributed
            return nullcontext()
        from torch.distributed.algorithms.join import Join

        return Join([self.model])

    def state_dict(self) -> dict[str, Any]:
        ignored = getattr(self.model, "parameters_to_ignore", ())
        return read_state(unwrap(self.model), self.optimizer, ignored)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_state(unwrap(self.model), self.optimizer, state)

    def model_weights(self) -> dict[str, Any]:
        return unwrap(self.model).state_dict()  # replicated: every rank holds the whole model

    def full_state_dict(self) -> dict[str, Any]:
        return join_own(self.state_dict())


class SeveralModels:
    """Named models and named optimizers under ``ddp``: each model with parameters to train in its
    own DDP (:func:`prepare_model`), each optimizer with its own verdict and clipping from a
    :class:`DDPStrategy` over the model holding its parameters (:attr:`views`). A snapshot keys
    every model and optimizer ``<model name>.<parameter>``."""

    name = "ddp"
    replicated = True

    def __init__(
        self,
        models: Mapping[str, nn.Module],
        optimizers: Mapping[str, torch.optim.Optimizer],
        *,
        runtime: Runtime,
        config: DDPConfig | None = None,
        sync_batchnorm: bool = False,
    ) -> None:
        self.config, self.runtime = config or DDPConfig(), runtime
        kwargs = self.config.ddp_kwargs()
        self.models: dict[str, nn.Module] = {}
        for name, model in models.items():
            model = prepare_model(
                model, sync_batchnorm=sync_batchnorm, runtime=runtime, seed_ranks=False, **kwargs
            )
            self.config.register_hook(model, runtime.group)
            self.models[name] = model
        self.optimizers = dict(optimizers)
        self.model: nn.Module = nn.ModuleDict(self.models)  # for the Trainer's walks over modules
        self.modules = nn.ModuleDict({name: unwrap(m) for name, m in self.models.items()})
        stepped = self._owners()
        self.views = {name: self._view(name, opt) for name, opt in self.optimizers.items()}
        # per optimizer, its model's parameters no optimizer holds: a skip clears their gradients
        # with its own, and leaves another optimizer's over the same model
        self.outside = {
            name: [p for p in view.model.parameters() if id(p) not in stepped]
            for name, view in self.views.items()
        }
        self.optimizer = next(iter(self.optimizers.values()))  # the learning rate the records show

    def _owners(self) -> dict[int, str]:
        """The optimizer holding each parameter, by ``id``; a parameter in two is refused."""
        owners: dict[int, str] = {}
        for name, optimizer in self.optimizers.items():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    first = owners.setdefault(id(p), name)
                    if first != name:
                        named = self.modules.named_parameters()
                        where = next((n for n, q in named if q is p), "(of no model)")
                        raise ConfigError(
                            f"parameter {where} is in optimizers {first!r} and "
                            f"{name!r}: give each parameter to one optimizer (leave it out of "
                            "one of them)"
                        )
        return owners

    def _view(self, name: str, optimizer: torch.optim.Optimizer) -> DDPStrategy:
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        holders = [m for m in self.models.values() if params <= {id(p) for p in m.parameters()}]
        if not holders:
            raise ConfigError(
                f"optimizer {name!r} holds parameters of no single model: give each optimizer the "
                "parameters of one model (two optimizers may share a model)"
            )
        return DDPStrategy(
            holders[0], optimizer, runtime=self.runtime, config=self.config, prepared=True
        )

    def no_sync(self) -> AbstractContextManager[Any]:
        stack = ExitStack()
        for model in self.models.values():
            stack.enter_context(no_sync(model))
        return stack

    def mark_nonfinite(self, loss: torch.Tensor) -> torch.Tensor:
        return next(iter(self.views.values())).mark_nonfinite(loss)

    def check_gradients(self, max_norm: float | None = None) -> GradientVerdict:
        verdicts = [view.check_gradients(max_norm) for view in self.views.values()]
        return GradientVerdict(all(v.finite for v in verdicts), None)

    def evaluation(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def join(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def state_dict(self) -> dict[str, Any]:
        return read_state(self.modules, self.optimizers)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_state(self.modules, self.optimizers, state)

    def model_weights(self) -> dict[str, Any]:
        return self.modules.state_dict()

    def full_state_dict(self) -> dict[str, Any]:
        return join_own(self.state_dict())


@dataclass(kw_only=True)
class ZeroConfig(DDPConfig):
    """The ``zero`` strategy: DDP's knobs (see :class:`DDPConfig`), and:"""

    name: ClassVar[str] = "zero"

    parameters_as_bucket_view: bool = False
    """Pack each rank's parameters into one flat buffer per dtype, so the post-step broadcast sends
    few large messages instead of one per parameter."""


class ZeroStrategy(DDPStrategy):
    """DDP's wrapping, no-sync and verdict, with the optimizer rebuilt as a
    ``ZeroRedundancyOptimizer`` of the same class, defaults and parameter groups."""

    name = "zero"
    replicated = False  # each rank's optimizer state is of the parameters it owns

    @checked_arguments
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        runtime: Runtime,
        config: ZeroConfig | None = None,
        sync_batchnorm: bool = False,
    ) -> None:
        if not runtime.distributed:
            raise ConfigError(
                "strategy 'zero' shards over a process group: launch with `ddpkit run` (or "
                "ddpkit.spawn), or use strategy 'ddp' for a single process"
            )
        zero_config = config or ZeroConfig()
        super().__init__(
            model, optimizer, runtime=runtime, config=zero_config, sync_batchnorm=sync_batchnorm
        )
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = rebuild_optimizer(
            optimizer,
            dict(unwrap(self.model).named_parameters()),
            self._names,
            optimizer_class=ZeroRedundancyOptimizer,
            process_group=runtime.group,
            parameters_as_bucket_view=zero_config.parameters_as_bucket_view,
        )
        assert isinstance(zero, ZeroRedundancyOptimizer)
        self.optimizer = self.zero = zero

    def join(self) -> AbstractContextManager[Any]:
        # torch's Join([ddp_model, zero]) ends, but a joined rank steps the parameters it owns with
        # its own stale gradients
        raise ConfigError(
            "strategy 'zero' cannot join uneven inputs correctly (the parameters a joined rank "
            "owns would stop training): give every rank the same number of batches, or use "
            "strategy 'ddp' with join()"
        )

    def state_dict(self) -> dict[str, Any]:
        """Each rank's state of the parameters it owns, by name; the groups' hyperparameters (the
        same on every rank); the parameters (replicated: their owner broadcasts them)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        local = self.zero.optim
        _copy_hyperparameters(self.zero.param_groups, local.param_groups)
        with made_up_state_cleared(local) as unstepped:
            optim = get_optimizer_state_dict(unwrap(self.model), local, options=state_options())
        state = separate_own(
            {
                "model": unwrap(self.model).state_dict(),
                "optim": optim,
                "param_groups": [
                    {k: v for k, v in g.items() if k != "params"} for g in self.zero.param_groups
                ],
            },
            unwrap(self.model),
        )
        # a rank that owns no parameter never has state: only an owner can tell
        owns = any(group["params"] for group in local.param_groups)
        return {**state, UNSTEPPED: unstepped} if owns else state

    def full_state_dict(self) -> dict[str, Any]:
        state = join_own(self.state_dict())
        merged: dict[str, Any] = {}
        for part in all_gather_object(state["optim"], group=self.runtime.group):
            merged.update(part)
        return {"model": state["model"], "optim": merged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        state = join_own(state)
        unwrap(self.model).load_state_dict(state["model"])
        set_optimizer_state_dict(
            unwrap(self.model), self.zero.optim, state["optim"], options=state_options()
        )
        clear_unstepped(self.zero.optim, state)
        for group, saved in zip(self.zero.param_groups, state["param_groups"], strict=True):
            group.update(saved)
        _copy_hyperparameters(self.zero.param_groups, self.zero.optim.param_groups)


def _copy_hyperparameters(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    # ZeroRedundancyOptimizer copies them into the local optimizer only inside step()
    for src, dst in zip(source, target, strict=True):
        dst.update({k: v for k, v in src.items() if k != "params"})
