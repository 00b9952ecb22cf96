"""``TrainerConfig(compile=True)``: the training forward under ``torch.compile``, applied after the
strategy wrapped the model.

Compiling the wrapped module, not the user's module before wrapping, keeps what the strategy relies
on:

- ``ddp`` and ``zero``: Dynamo's DDP optimizer (``torch._dynamo.config.optimize_ddp``) splits the
  compiled graph at DDP's bucket boundaries, so that each bucket's all-reduce is launched as soon as
  its gradients are ready and overlaps the rest of the backward pass, as in eager DDP; one graph for
  the whole model would produce every gradient at once at its end, and the all-reduces could no
  longer overlap. ``no_sync()`` still holds: DDP decides per forward, outside the compiled graph,
  whether the backward synchronises.
- ``fsdp`` (FSDP2, ``fully_shard``): its all-gathers and reduce-scatters run in hooks around each
  block, which Dynamo traces through (or breaks the graph at); the model's parameters stay the
  strategy's DTensors.

Only the training forward is compiled: the strategy keeps the wrapped module for snapshots, no_sync
and validation (which calls the unwrapped module, eagerly), so snapshots and resume are the same
with and without compilation. Inductor builds its CPU kernels with a C++ compiler; without one,
compile=True is refused up front.
"""

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
