"""How a model is spread over ranks: ``ddp`` (replicated), ``zero`` (sharded optimizer state),
``fsdp`` (all sharded), each a :class:`~ddpkit.strategies._base.Strategy` with a typed config; a
hand-written loop builds one with :func:`build_strategy`."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ddpkit._errors import ConfigError, checked_arguments
from ddpkit.distributed._runtime import Runtime, get_runtime
from ddpkit.strategies._base import GradientVerdict, Strategy, rebind_scheduler
from ddpkit.strategies._ddp import DDPConfig, DDPStrategy, ZeroConfig, ZeroStrategy
from ddpkit.strategies._fsdp import FSDPConfig, FSDPStrategy

StrategyConfig = DDPConfig | ZeroConfig | FSDPConfig
"""A strategy and its options: what ``TrainerConfig.strategy`` and :func:`build_strategy` take (or a
name)."""

STRATEGIES: dict[str, tuple[type, type]] = {
    "ddp": (DDPConfig, DDPStrategy),
    "zero": (ZeroConfig, ZeroStrategy),
    "fsdp": (FSDPConfig, FSDPStrategy),
}


def strategy_config(
    strategy: str | StrategyConfig, options: dict[str, Any] | None = None
) -> StrategyConfig:
    """The typed config of ``strategy``: a config as it is, or a strategy's name with ``options`` (a
    JSON-friendly dict, as read back from ``config.json``); errors name the strategy or the
    option."""
    if not isinstance(strategy, str):
        if type(strategy) not in {cls for cls, _ in STRATEGIES.values()}:
            raise ConfigError(
                f"strategy={strategy!r}: give a strategy's name ({', '.join(STRATEGIES)}) or its "
                "config (DDPConfig, ZeroConfig, FSDPConfig)"
            )
        return strategy
    if strategy not in STRATEGIES:
        raise ConfigError(
            f"strategy={strategy!r} is not known: pick one of {', '.join(STRATEGIES)}"
        )
    cls, options = STRATEGIES[strategy][0], dict(options or {})
    valid = {f.name for f in dataclasses.fields(cls)}
    if unknown := sorted(set(options) - valid):
        raise ConfigError(
            f"strategy {strategy!r} has no option {', '.join(map(repr, unknown))}: its options are "
            f"{sorted(valid)}"
        )
    return cls(**options)


@checked_arguments
def build_strategy(
    strategy: str | StrategyConfig,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    runtime: Runtime | None = None,
    sync_batchnorm: bool = False,
    scheduler: Any = None,
) -> Strategy:
    """Wrap ``model`` the way ``strategy`` does (a name, or a config with its options), over the
    ranks of ``runtime`` (default: the job's).

    Use ``strategy.model`` and ``strategy.optimizer`` from here on: ``zero`` and ``fsdp`` rebuild
    the optimizer (same class, defaults and parameter groups) over the parameters they manage, and
    an LR ``scheduler`` built on the old one is pointed at the new one.
    """
    config = strategy_config(strategy)
    cls = STRATEGIES[config.name][1]
    built = cls(
        model,
        optimizer,
        runtime=runtime or get_runtime(),
        config=config,
        sync_batchnorm=sync_batchnorm,
    )
    rebind_scheduler(scheduler, optimizer, built.optimizer)
    return built


__all__ = [
    "DDPConfig", "DDPStrategy", "FSDPConfig", "FSDPStrategy", "GradientVerdict", "STRATEGIES",
    "Strategy", "StrategyConfig", "ZeroConfig", "ZeroStrategy", "build_strategy",
    "strategy_config",
]  # fmt: skip
