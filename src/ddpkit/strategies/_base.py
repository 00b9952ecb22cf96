"""The seam between the training loop and how the model is distributed: a strategy owns wrapping
the model, skipping synchronisation on micro-batches, the step's verdict (finite gradients, their
global norm, clipping), uneven inputs, and the state a snapshot holds; a loop reads the same at
every strategy (docs/strategies.md, "In a loop of your own")."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from ddpkit._errors import ConfigError
from ddpkit._internals.optim import mark_stepped_like

PER_RANK = "per_rank"
"""Key of the part of a strategy's state that is each rank's own (its shards' keys, its own
buffers): a snapshot saves rank 0's in the shared key's place and each other rank's under its own
name (:mod:`ddpkit.snapshot._disk`)."""


@dataclass(frozen=True)
class GradientVerdict:
    """What a step's gradients say, identically on every rank of the group."""

    finite: bool
    """No gradient element (of any rank's shard) and no rank's loss was NaN or inf: take the
    step."""
    norm: torch.Tensor | None
    """The global L2 norm of the stepped gradients before clipping, when it was computed (clipping,
    or FSDP)."""


class Strategy(Protocol):
    """One way of distributing a model over the ranks of a group; see the module docstring."""

    name: str
    replicated: bool
    """Every rank holds the same model and optimizer state, outside its per-rank part (DDP): a
    snapshot then has each rank write a share of it
    (:func:`~ddpkit.snapshot._disk.writer_of_shared`)."""
    model: nn.Module
    """The wrapped model: call it for the forward pass."""
    optimizer: torch.optim.Optimizer
    """The optimizer to step: the one given, or one rebuilt over the wrapped (or sharded)
    parameters."""

    def no_sync(self) -> AbstractContextManager[Any]:
        """Backward passes inside accumulate gradients locally, without communication (all
        micro-batches of a step but the last)."""

    def mark_nonfinite(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss``, arranged so that a NaN/inf value on this rank reaches :meth:`check_gradients`
        on every rank, even when its gradients are finite. Call before ``backward()``."""

    def check_gradients(self, max_norm: float | None = None) -> GradientVerdict:
        """Decide the step from the synchronised gradients, the same on every rank; clip them to
        ``max_norm`` (global L2 norm) when they are finite."""

    def evaluation(self) -> AbstractContextManager[Any]:
        """A context for forward passes whose number may differ between ranks (evaluation on
        unpadded shards): inside it a forward pass runs no collective."""

    def join(self) -> AbstractContextManager[Any]:
        """A context for loops where ranks run different numbers of steps (uneven inputs): a rank
        that has run out of data shadows the others' collectives until all are done."""

    def state_dict(self) -> dict[str, Any]:
        """Model and optimizer state for a snapshot (:mod:`ddpkit.snapshot`): tensors
        may be shards (DTensors), so every rank saves its own part and a load reshards. Values that
        have one name on every rank but may differ between ranks (buffers: BatchNorm's running
        statistics) go in the ``per_rank`` part (:data:`PER_RANK`), as
        ``{"model": {name: tensor}, "optim": {key: value}}``."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (after a load into it, at any world size)."""

    def model_weights(self) -> dict[str, Any]:
        """The whole model's weights by parameter name, at least on rank 0 of the group (collective
        under sharding: every rank calls it). What ``best.pt`` holds."""

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model and optimizer state, gathered on every rank (collective):
        ``{"model": {name: tensor}, "optim":
        {"state.<name>.<key>": value, "param_groups.<name>.<key>": value}}``, the same layout under
        every strategy, so runs under different strategies compare key by key."""


def rebuild_optimizer(
    optimizer: torch.optim.Optimizer,
    params_by_name: dict[str, nn.Parameter],
    names_by_id: dict[int, str],
    optimizer_class: Any = None,
    **extra: Any,
) -> torch.optim.Optimizer:
    """An optimizer like ``optimizer`` (its class, defaults and parameter groups) over new
    parameter objects (``fully_shard``'s), or handed to a wrapper (``optimizer_class``:
    ``ZeroRedundancyOptimizer``). ``names_by_id`` names the original parameters;
    ``params_by_name`` gives their replacements."""
    if optimizer.state:
        raise ConfigError(
            "the optimizer has already taken steps: with strategy 'zero' or 'fsdp' pass a fresh "
            "optimizer (its state is rebuilt over the sharded parameters)"
        )
    groups = []
    for group in optimizer.param_groups:
        try:
            params = [params_by_name[names_by_id[id(p)]] for p in group["params"]]
        except KeyError as err:
            raise ConfigError(
                f"the optimizer holds a parameter that is not in the model ({err}): give it "
                "model.parameters()"
            ) from None
        groups.append({**group, "params": params})
    cls = type(optimizer)
    if optimizer_class is not None:
        new = optimizer_class(groups, optimizer_class=cls, **optimizer.defaults, **extra)
    else:
        new = cls(groups, **optimizer.defaults)
    # the script's optimizer would keep the replaced (unsharded) tensors alive: repointed too
    for old_group, group in zip(optimizer.param_groups, groups):
        old_group["params"] = list(group["params"])
    return new


def rebind_scheduler(
    scheduler: Any, old: torch.optim.Optimizer, new: torch.optim.Optimizer
) -> None:
    """Point an LR scheduler built on ``old`` at ``new``: schedulers read and write
    ``optimizer.param_groups`` at each step, and ``new``'s groups were copied from ``old``'s
    (``initial_lr`` included)."""
    if scheduler is None or new is old or getattr(scheduler, "optimizer", None) is not old:
        return
    scheduler.optimizer = new
    # else the scheduler would warn at every run's start that it stepped first
    mark_stepped_like(old, new)


def separate_own(state: dict[str, Any], model: nn.Module, ignored: Any = ()) -> dict[str, Any]:
    """``state`` (``{"model": ..., "optim": ...}`` by parameter name) with each rank's own values
    moved to its ``per_rank`` part: the model's buffers (BatchNorm's running statistics), and the
    parameters in ``ignored`` (DDP's ignored ones) with their optimizer state."""
    names = {name for name, _ in model.named_buffers()} | set(ignored)
    # flattened optimizer state: state.<param>.<key>
    prefixes = tuple(f"state.{name}." for name in ignored)
    model_state, optim = state["model"], state.get("optim") or {}
    return {
        **state,
        "model": {k: v for k, v in model_state.items() if k not in names},
        "optim": {k: v for k, v in optim.items() if not k.startswith(prefixes)},
        PER_RANK: {
            "model": {k: v for k, v in model_state.items() if k in names},
            "optim": {k: v for k, v in optim.items() if k.startswith(prefixes)},
        },
    }


@contextmanager
def made_up_state_cleared(optimizers: Any) -> Iterator[list[Any]]:
    """Around a read of torch's distributed state dict of ``optimizers`` (one, a list, or a dict by
    name): the state torch makes up for an optimizer that has not stepped (Adam's step count 1) is
    cleared again. Yields those optimizers' names (else positions): :data:`UNSTEPPED`."""
    unstepped = [label for label, opt in _labelled(optimizers) if not opt.state]
    try:
        yield unstepped
    finally:
        clear_unstepped(optimizers, {UNSTEPPED: unstepped})


def state_options(**kwargs: Any) -> Any:
    """Options of torch's distributed state dicts: optimizer state keyed by parameter name, one
    entry per tensor, so that a load at another world size finds each by name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, **kwargs)


def read_state(module: nn.Module, optimizers: Any, ignored: Any = ()) -> dict[str, Any]:
    """``module``'s and ``optimizers``' state (one, a list, or a dict by name) through torch's
    distributed state dicts, each rank's own values in its per-rank part (:func:`separate_own`).
    Give DDP's module, not DDP."""
    from torch.distributed.checkpoint import state_dict as dsd

    listed = [opt for _, opt in _labelled(optimizers)]
    with made_up_state_cleared(optimizers) as unstepped:
        if listed:
            model, optim = dsd.get_state_dict(module, listed, options=state_options())
        else:
            model, optim = dsd.get_model_state_dict(module, options=state_options()), {}
    state = separate_own({"model": model, "optim": optim}, module, ignored)
    return {**state, UNSTEPPED: unstepped}


UNSTEPPED = "unstepped"
"""The key of a strategy's state that lists the optimizers (by name, else by position) that had not
stepped when it was read, whose made-up state is cleared after a load. Always present."""


def _labelled(optimizers: Any) -> list[tuple[Any, Any]]:
    if isinstance(optimizers, Mapping):
        return list(optimizers.items())
    listed = list(optimizers) if isinstance(optimizers, (list, tuple)) else [optimizers]
    return [(i, opt) for i, opt in enumerate(listed) if opt is not None]


def clear_unstepped(optimizers: Any, state: dict[str, Any]) -> None:
    """After a load of ``state`` into ``optimizers``: the optimizers that had not stepped when it
    was read (:data:`UNSTEPPED`) end with no state, as torch's load makes one up for each."""
    unstepped = set(state.get(UNSTEPPED, ()))
    for label, opt in _labelled(optimizers):
        if label in unstepped:
            opt.state.clear()


def load_state(module: nn.Module, optimizers: Any, state: dict[str, Any]) -> None:
    """Restore what :func:`read_state` returned (after a load into it, at any world size)."""
    from torch.distributed.checkpoint import state_dict as dsd

    state = join_own(state)
    listed = [opt for _, opt in _labelled(optimizers)]
    if not listed:
        dsd.set_model_state_dict(module, state["model"], options=state_options())
        return
    dsd.set_state_dict(
        module,
        listed,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=state_options(),
    )
    clear_unstepped(optimizers, state)


def join_own(state: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`separate_own`: each rank's own values back among the model's and
    optimizer's."""
    own = state.get(PER_RANK) or {}
    joined = {k: v for k, v in state.items() if k != PER_RANK}
    joined["model"] = {**state["model"], **own.get("model", {})}
    joined["optim"] = {**(state.get("optim") or {}), **own.get("optim", {})}
    return joined
