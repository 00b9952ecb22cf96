"""How a model is spread over ranks: ``ddp`` (replicated), ``zero`` (sharded optimizer state), ``fsdp`` (all
sharded). Each is one class behind :class:`~ddpkit.strategies.base.Strategy`, with a typed config next to it.

A hand-written loop builds one with :func:`build_strategy` and uses the same pieces the Trainer does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ddpkit.distributed.runtime import Runtime, get_runtime
from ddpkit.errors import ConfigError
from ddpkit.strategies.base import (
    GradientVerdict,
    Strategy,
    check_options,
    rebind_scheduler,
)
from ddpkit.strategies.ddp import DDPConfig, DDPStrategy
from ddpkit.strategies.fsdp import FSDPConfig, FSDPStrategy
from ddpkit.strategies.zero import ZeroConfig, ZeroStrategy

STRATEGIES: dict[str, tuple[type, type]] = {
    "ddp": (DDPConfig, DDPStrategy),
    "zero": (ZeroConfig, ZeroStrategy),
    "fsdp": (FSDPConfig, FSDPStrategy),
}


def strategy_config(name: str, options: dict[str, Any] | None = None) -> Any:
    """The typed config of strategy ``name`` from its options (a JSON-friendly dict); errors name the option."""
    if name not in STRATEGIES:
        raise ConfigError(f"strategy={name!r} is not known: pick one of {', '.join(STRATEGIES)}")
    return check_options(STRATEGIES[name][0], name, dict(options or {}))


def build_strategy(
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    options: dict[str, Any] | None = None,
    runtime: Runtime | None = None,
    sync_batchnorm: bool = False,
    scheduler: Any = None,
    ddp_kwargs: dict[str, Any] | None = None,
) -> Strategy:
    """Wrap ``model`` the way strategy ``name`` does, over the ranks of ``runtime`` (default: the job's).

    Use ``strategy.model`` and ``strategy.optimizer`` from here on: ``zero`` and ``fsdp`` rebuild the optimizer
    (same class, defaults and parameter groups) over the parameters they manage, and an LR ``scheduler`` built on
    the old one is pointed at the new one.
    """
    config = strategy_config(name, options)
    cls = STRATEGIES[name][1]
    strategy = cls(model, optimizer, runtime=runtime or get_runtime(), config=config,
                   sync_batchnorm=sync_batchnorm, ddp_kwargs=ddp_kwargs)
    rebind_scheduler(scheduler, optimizer, strategy.optimizer)
    return strategy


__all__ = [
    "DDPConfig", "DDPStrategy", "FSDPConfig", "FSDPStrategy", "GradientVerdict", "STRATEGIES", "Strategy",
    "ZeroConfig", "ZeroStrategy", "build_strategy", "strategy_config",
]
