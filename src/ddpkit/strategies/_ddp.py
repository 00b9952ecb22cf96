"""Replicated data parallelism: DistributedDataParallel, its knobs, and the step verdict without a
collective."""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit._errors import ConfigError, check_types
from ddpkit._internals.optim import any_non_finite, sparse_values
from ddpkit.distributed._runtime import Runtime
from ddpkit.strategies import _hooks as hooks
from ddpkit.strategies._base import GradientVerdict, join_own, separate_own
from ddpkit.strategies._prepare import GRADIENT_AS_BUCKET_VIEW, no_sync, prepare_model, unwrap


def state_options(**kwargs: Any) -> Any:
    """Options of torch's distributed state dicts: optimizer state keyed by parameter name, one
    entry per tensor, so that ranks may hold different parameters (ZeRO) and a load at another world
    size finds each by name. (torch.distributed.checkpoint is imported here, when used: it costs
    ~0.9 s per process.)"""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, **kwargs)


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
    no memory of their own (on by default, unlike torch's DDP: see
    :data:`~ddpkit.strategies._prepare.GRADIENT_AS_BUCKET_VIEW`)."""
    find_unused_parameters: bool = False
    """Search the graph after every forward pass for parameters that get no gradient (costly);
    needed when some parameters are not used in a step. Without it such a step fails with the
    parameters named."""
    broadcast_buffers: bool = True
    """Copy rank 0's buffers (BatchNorm running statistics) to every rank before each forward
    pass."""
    comm_hook: Literal["fp16", "bf16", "powersgd", "parameter_server"] | None = None
    """What DDP does with each gradient bucket instead of an all-reduce in fp32: ``fp16`` or
    ``bf16`` (all-reduce compressed to 16 bits), ``powersgd`` (low-rank compression with error
    feedback), ``parameter_server`` (each bucket summed on a server rank and sent back; see
    :mod:`ddpkit.strategies._hooks`). Compression changes the gradients: runs agree with plain DDP
    within a tolerance, not bitwise."""
    powersgd_rank: int = 1
    """PowerSGD's matrix approximation rank (higher: more accurate, more traffic)."""
    powersgd_start_iter: int = 10
    """Steps of plain all-reduce before PowerSGD starts compressing (at least 2)."""

    def __post_init__(self) -> None:
        check_types(self)
        if self.comm_hook is not None and self.comm_hook not in hooks.COMM_HOOKS:
            raise ConfigError(
                f"comm_hook={self.comm_hook!r}: pick one of {', '.join(hooks.COMM_HOOKS)} or None"
            )
        if self.powersgd_rank < 1 or self.powersgd_start_iter < 2:
            raise ConfigError("powersgd_rank must be >= 1 and powersgd_start_iter >= 2")
        if self.bucket_cap_mb is not None and self.bucket_cap_mb <= 0:
            raise ConfigError(f"bucket_cap_mb={self.bucket_cap_mb} must be positive")

    def ddp_kwargs(self) -> dict[str, Any]:
        out = {
            k: v
            for k, v in asdict(self).items()
            if k in ("static_graph", "gradient_as_bucket_view", "find_unused_parameters")
        }
        # passed only when changed: torch 2.13 warns that the name is deprecated
        if not self.broadcast_buffers:
            out["broadcast_buffers"] = False
        if self.bucket_cap_mb is not None:
            out["bucket_cap_mb"] = self.bucket_cap_mb
        return out


def nan_gradient_if_nonfinite(
    loss: torch.Tensor, anchor: torch.Tensor | None, on_host: bool
) -> torch.Tensor:
    """``loss``, made to give ``anchor`` (a parameter DDP all-reduces) a NaN gradient if its value
    is not finite.

    A non-finite loss can have finite gradients: ``loss + inf``, or a cross-entropy whose targets
    are all ``ignore_index`` (0/0 = NaN, with zero gradients); the rank that computed it would know
    and the others would not. Multiplying the loss by NaN is not enough, as masking ops (ReLU,
    ignored targets) turn the NaN back into zeros on its way down. So the NaN goes straight into the
    gradient of one element of ``anchor``; DDP's all-reduce then puts it into every rank's
    gradients, and the verdict each rank reads from its own gradients covers every rank's loss.

    ``on_host`` (CPU): reading the value is free and a tensor op is not, so a finite loss is
    returned untouched. On an accelerator a read would wait for the device, so the term is always
    added, as ``0 x anchor`` for a finite loss: the loss keeps its value, and the anchor's gradient
    gets ``+0.0``.
    """
    if anchor is None:
        return loss
    # the view of the anchor is built only for a bad loss: a few us per step saved on tiny models
    if on_host:
        return loss if math.isfinite(loss.item()) else loss + anchor.reshape(-1)[0] * float("nan")
    element = anchor.reshape(-1)[0]
    bad = torch.where(torch.isfinite(loss.detach()), 0.0, float("nan")).to(element.dtype)
    return loss + element * bad


class FiniteCheck:
    """Whether no element of a step's gradients is NaN or inf: called with the gradients of
    ``params`` (fewer where some have none).

    torch's fused check-and-unscale (what GradScaler runs) reads every tensor in one call; with a
    scale of 1 it leaves them bit for bit as they were. A norm (``get_total_norm``) would do too,
    but costs five times as much on the CPU (measured in a training loop: ~40 vs ~210 us for the DDP
    tutorials' CNN). A sum of each large tensor, which only reads, is faster alone (7.5 against
    12.5 us hot for the 620 KB of ``bench/loader_overhead.py``'s MLP) but not inside its training
    step (24 against 21 us), where the gradients are no longer in cache. With the gradients as
    views side by side in DDP's bucket (ddpkit's default), one sum over each run of them, kept as
    a layout, was 9 us a step faster on 2 ranks (95% interval 1 to 17, paired, the bench's MLP);
    but a layout that sees every way a gradient can be swapped in place (``p.grad.data = t`` at the
    same address, strided or of another dtype) must read each gradient's address, size, dtype and
    contiguity every step, and with those reads the two were level (-2 us, 95% interval -9 to +6).
    Left as it is.

    What costs on a tiny model is what surrounds the kernel, so the per-step path does only per-step
    work. The parameters' devices and dtypes are read once: when they are all one device and one
    real dtype, the step's gradients go to the kernel in one call, as they are (a gradient of
    another real dtype, which torch allows through ``grad_dtype``, is read all the same: the kernel
    takes mixed dtypes). Its (found-inf flag, scale of 1) tensors are kept per device, the flag at
    zero between calls (zeroed after a call that set it, not before every call). The kernel
    refuses sparse gradients (``nn.Embedding(sparse=True)``: their stored values are checked,
    uncoalesced, as summing could overflow) before it reads any tensor; after one refusal every
    step takes the grouped path, as do complex parameters (checked as pairs of reals) and mixed
    devices or dtypes.
    """

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
            self._flags[device] = (torch.zeros(1, device=device), torch.ones(1, device=device))
        flag, one = self._flags[device]
        try:
            found = any_non_finite(group, flag, one)
        except BaseException:
            flag.zero_()  # a refused tensor may leave it set
            raise
        if found:
            flag.zero_()
        return found


def stepped_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters whose gradients decide whether a step is taken: those the optimizer updates,
    that need gradients, and that DDP all-reduces (identical on every rank, so every rank reaches
    the same verdict). Parameters DDP was told to ignore are left out: their gradients are each
    rank's own."""
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
"""The verdicts without a norm: made once, not each step."""


class DDPStrategy:
    """Every rank holds the whole model and optimizer; DDP all-reduces gradients during backward.

    The step verdict costs no collective: once DDP has all-reduced them, the gradients are identical
    on every rank, so each reaches the same decision from its own copy (one host sync per step, as a
    GradScaler has).
    """

    name = "ddp"
    replicated = True

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
        """``prepared``: ``model`` is already wrapped (one of
        :class:`~ddpkit.strategies._several.SeveralModels`'s), this strategy only decides its
        ``optimizer``'s steps."""
        self.config = config or DDPConfig()
        self.runtime = runtime
        kwargs = self.config.ddp_kwargs()
        if not prepared:
            model = prepare_model(model, sync_batchnorm=sync_batchnorm, runtime=runtime, **kwargs)
        self.model = model
        self.optimizer = optimizer
        if self.config.comm_hook is not None and runtime.distributed and not prepared:
            hooks.register(
                self.model,
                self.config.comm_hook,
                runtime.group,
                powersgd_rank=self.config.powersgd_rank,
                powersgd_start_iter=self.config.powersgd_start_iter,
            )
        self.on_host = runtime.device.type == "cpu"
        self.params = stepped_parameters(self.model, optimizer)
        # where a non-finite loss puts its NaN
        self.anchor = self.params[0] if self.params else None
        self._finite = FiniteCheck(self.params)
        # Without find_unused_parameters or static_graph, a parameter that gets no gradient stalls
        # DDP's reducer, and torch's error arrives one forward pass later without naming it: check
        # after backward.
        self._check_unused = runtime.distributed and not (
            kwargs.get("find_unused_parameters") or kwargs.get("static_graph")
        )
        self._names = {id(p): n for n, p in unwrap(self.model).named_parameters()}

    def no_sync(self) -> AbstractContextManager[Any]:
        return no_sync(self.model)  # DDP's when distributed

    def mark_nonfinite(self, loss: torch.Tensor) -> torch.Tensor:
        return nan_gradient_if_nonfinite(loss, self.anchor, self.on_host)

    def check_gradients(self, max_norm: float | None = None) -> GradientVerdict:
        grads = [g for p in self.params if (g := p.grad) is not None]  # each .grad read once
        if self._check_unused and len(grads) < len(self.params):
            self._raise_unused()
        if max_norm is None:
            return FINITE if self._finite(grads) else NOT_FINITE
        norm = torch.nn.utils.get_total_norm(grads)
        if not math.isfinite(norm.item()):
            return GradientVerdict(False, norm)
        torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, norm)
        return GradientVerdict(True, norm)

    def _raise_unused(self) -> None:
        unused = [self._names.get(id(p), "?") for p in self.params if p.grad is None]
        raise ConfigError(
            f"parameter(s) {', '.join(unused)} got no gradient in this step, so DDP cannot finish "
            "its all-reduce: pass strategy=DDPConfig(find_unused_parameters=True) (or "
            "static_graph=True when the same parameters are unused every step), or leave them out "
            "of the optimizer and set requires_grad=False"
        )

    def evaluation(self) -> AbstractContextManager[Any]:
        # evaluate() calls the module inside DDP, whose forward runs no collective
        return nullcontext()

    def join(self) -> AbstractContextManager[Any]:
        if not isinstance(self.model, DDP):  # not distributed
            return nullcontext()
        from torch.distributed.algorithms.join import Join

        return Join([self.model])

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        # The module, not DDP: DDP's state_dict() is keyed as its module's
        # (prepare.keys_of_the_module), and torch's get_state_dict asserts DDP's own names from a
        # DDP.
        model_state, optim_state = get_state_dict(
            unwrap(self.model), self.optimizer, options=state_options()
        )
        # Parameters are replicated; buffers, and parameters DDP ignores, are each rank's own.
        ignored = getattr(self.model, "parameters_to_ignore", ())
        return separate_own(
            {"model": model_state, "optim": optim_state}, unwrap(self.model), ignored
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = join_own(state)
        set_state_dict(
            unwrap(self.model),
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=state_options(),
        )

    def model_weights(self) -> dict[str, Any]:
        return unwrap(self.model).state_dict()  # replicated: every rank holds the whole model

    def full_state_dict(self) -> dict[str, Any]:
        # Replicated: every rank's state is the whole state (with this rank's own buffers).
        return join_own(self.state_dict())
