"""``TrainerConfig(compile=True)``: the training forward under ``torch.compile``, applied to the
strategy's wrapped module with Dynamo's DDP optimizer on, so that each bucket's all-reduce still
overlaps the backward (docs/language-models.md). Only the training forward is compiled; snapshots,
``no_sync`` and validation use the wrapped module as without compilation."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddpkit._errors import ConfigError
from ddpkit._internals.compiler import cpp_compiler, set_ddp_optimizer


def compile_for_training(model: nn.Module, device: torch.device) -> Any:
    """``torch.compile(model)`` with the DDP optimizer on; ``model`` is the strategy's wrapped
    module."""
    if device.type == "cpu" and cpp_compiler() is None:
        raise ConfigError(
            "compile=True on the CPU needs a C++ compiler (inductor builds its kernels with one) "
            "and none was found: install g++ (apt-get install g++) or set CXX, or leave "
            "compile=False"
        )
    set_ddp_optimizer()
    return torch.compile(model)
