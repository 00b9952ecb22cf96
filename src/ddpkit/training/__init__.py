"""The Trainer: its config, state, step loop, callbacks, evaluation and losses."""

from ddpkit.training.callbacks import Callback
from ddpkit.training.config import (
    EarlyStoppingConfig,
    LoggingConfig,
    TrainerConfig,
)
from ddpkit.training.step_output import StopReason
from ddpkit.training.trainer import Trainer

__all__ = [
    "Callback",
    "EarlyStoppingConfig",
    "LoggingConfig",
    "StopReason",
    "Trainer",
    "TrainerConfig",
]
