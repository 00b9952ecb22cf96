"""``torch.nn`` modules, where ddpkit reaches past their public API: ``_BatchNorm``, a compiled
module's ``_orig_mod``, a module's ``_buffers``."""

from __future__ import annotations

import sys
from typing import Any, TypeGuard

import torch
from torch import nn

from ddpkit._internals.contract import Internal


class BatchNormBase(nn.modules.batchnorm._BatchNorm):
    """torch's base of the BatchNorm layers, for inputs of 2 or more dimensions (``N, C, ...``)."""

    def check_input(self, input: torch.Tensor) -> None:
        self._check_input_dim(input)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (N, C, ...), got {input.dim()}D")


def is_batchnorm(module: nn.Module) -> TypeGuard[nn.modules.batchnorm._BatchNorm]:
    """A BatchNorm layer of any dimension (torch's or ddpkit's), not an InstanceNorm."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


def compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module ``torch.compile`` wrapped, for its wrapper (None for any other module)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # never imported here (~1 s)
    if eval_frame is None or not isinstance(module, eval_frame.OptimizedModule):
        return None
    inner = getattr(module, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else None


def buffer_slots(module: nn.Module) -> list[tuple[dict[str, Any], str]]:
    """(the dict, the name) of each buffer of ``module``: ``slot[0][slot[1]]`` is its tensor."""
    return [(m._buffers, name) for m in module.modules() for name in m._buffers]


def _check_batchnorm() -> str | None:
    base = getattr(nn.modules.batchnorm, "_BatchNorm", None)
    if base is None or not issubclass(nn.BatchNorm2d, base):
        return "nn.modules.batchnorm._BatchNorm is not the base of BatchNorm2d"
    if not callable(getattr(base, "_check_input_dim", None)):
        return "it asks no _check_input_dim"
    return None


def _check_compiled() -> str | None:
    wrapped = nn.Linear(1, 1)
    compiled: Any = torch.compile(wrapped)
    found = compiled_inner(compiled)
    return None if found is wrapped else "a compiled module's _orig_mod is not the module compiled"


def _check_buffers() -> str | None:
    module = nn.BatchNorm1d(2)
    slots = buffer_slots(module)
    if not slots or any(d[name] is not getattr(module, name) for d, name in slots):
        return "_buffers is not where buffers are"
    return None


INTERNALS = [
    Internal(
        "torch.nn.modules.batchnorm._BatchNorm",
        "torch",
        "SyncBatchNorm on the CPU (gloo)",
        _check_batchnorm,
    ),
    Internal(
        "torch._dynamo OptimizedModule._orig_mod",
        "torch",
        "unwrap() and no_sync() see through torch.compile's wrapper",
        _check_compiled,
    ),
    Internal(
        "torch.nn.Module._buffers",
        "torch",
        "memory snapshots find each buffer's tensor cheaply",
        _check_buffers,
    ),
]
