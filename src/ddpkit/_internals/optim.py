"""Optimizers, schedulers and gradients, where ddpkit reaches past torch's public API: a
scheduler's marks on its optimizer's step, the fused inf/NaN check, a sparse tensor's values."""

from __future__ import annotations

from typing import Any

import torch

from ddpkit._internals.contract import Internal

_MARK = "_wrapped_by_lr_sched"


def mark_stepped_like(old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """Where a scheduler marked ``old.step``, wrap ``new.step`` the same way."""
    if not hasattr(old.step, _MARK):
        return
    step = new.step

    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        new._opt_called = True  # type: ignore[attr-defined]
        return step(*args, **kwargs)

    setattr(tracked_step, _MARK, True)
    new.step = tracked_step  # type: ignore[method-assign]


def any_non_finite(group: list[torch.Tensor], flag: torch.Tensor, one: torch.Tensor) -> bool:
    """Whether any tensor of ``group`` (one device; one dtype for the kernel's fast route on CUDA)
    holds inf or NaN: ``flag`` (zero) is set by torch's fused check, ``one`` is its scale."""
    torch._amp_foreach_non_finite_check_and_unscale_(group, flag, one)
    return bool(flag.item())


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """The stored values of a sparse tensor, uncoalesced (coalescing sums, and could overflow)."""
    return t._values()


def _check_scheduler_marks() -> str | None:
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0)
    if not hasattr(optimizer.step, _MARK):
        return f"a scheduler no longer marks its optimizer's step with {_MARK}"
    optimizer.step()
    if not getattr(optimizer, "_opt_called", False):
        return "the marked step no longer sets _opt_called"
    return None


def _check_fused_check() -> str | None:
    fn = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
    if fn is None:
        return "torch has no _amp_foreach_non_finite_check_and_unscale_"
    flag, one = torch.zeros(1), torch.ones(1)
    fn([torch.tensor([1.0, float("inf")])], flag, one)
    return None if flag.item() == 1.0 else "it does not flag an inf"


def _check_sparse_values() -> str | None:
    t = torch.sparse_coo_tensor(
        torch.tensor([[0, 0]]), torch.tensor([1.0, 2.0]), (3,), check_invariants=False
    )  # two at one index: uncoalesced
    if t._values().tolist() != [1.0, 2.0]:
        return "_values() of an uncoalesced tensor is not its stored values"
    return None


INTERNALS = [
    Internal(
        "torch.optim.lr_scheduler: optimizer.step._wrapped_by_lr_sched / optimizer._opt_called",
        "torch",
        "a scheduler moved to ZeRO's optimizer does not warn that it stepped before the optimizer",
        _check_scheduler_marks,
    ),
    Internal(
        "torch._amp_foreach_non_finite_check_and_unscale_",
        "torch",
        "one fused inf/NaN check of all gradients per device and dtype",
        _check_fused_check,
    ),
    Internal(
        "torch.Tensor._values",
        "torch",
        "the inf/NaN check of sparse gradients",
        _check_sparse_values,
    ),
]
