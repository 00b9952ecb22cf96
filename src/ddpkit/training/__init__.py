"""The Trainer: its config, state, step loop, callbacks, evaluation and losses."""

from ddpkit.training._config import EarlyStoppingConfig, LoggingConfig, TrainerConfig
from ddpkit.training._step import StepOutput, StopReason, loss_divisor
from ddpkit.training._trainer import Callback, Trainer

__all__ = [
    "Callback",
    "EarlyStoppingConfig",
    "LoggingConfig",
    "StepOutput",
    "StopReason",
    "Trainer",
    "TrainerConfig",
    "loss_divisor",
]
