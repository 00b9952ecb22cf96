"""ddpkit: correct, fast, fault-tolerant DistributedDataParallel training for PyTorch.

A single-device script becomes a DDP script with a handful of calls (``init``, ``prepare_model``,
``build_loader``, ``evaluate``, docs/getting-started.md), and runs with ``ddpkit run script.py``,
``torchrun``, ``srun`` or plain ``python``.
"""

from ddpkit._errors import ConfigError, Preempted
from ddpkit.data import build_eval_loader, build_loader, to_device
from ddpkit.distributed._collectives import (
    MetricSums,
    all_gather_object,
    all_reduce,
    barrier,
    broadcast_object,
    gather_tensors,
    main_first,
)
from ddpkit.distributed._groups import split_world
from ddpkit.distributed._runtime import Runtime, get_logger, get_runtime, init, print0, shutdown
from ddpkit.distributed._seeding import seed_everything
from ddpkit.distributed._spawn import spawn
from ddpkit.snapshot._snapshots import Snapshots
from ddpkit.snapshot._state import SnapshotConfig
from ddpkit.strategies import DDPConfig, FSDPConfig, ZeroConfig
from ddpkit.strategies._prepare import no_sync, prepare_model, unwrap
from ddpkit.training._config import (
    EarlyStoppingConfig,
    LoggingConfig,
    TrainerConfig,
)
from ddpkit.training._evaluation import (
    classification_metrics,
    evaluate,
    regression_metrics,
)
from ddpkit.training._trainer import Callback, Trainer

__version__ = "0.1.0"

# What scripts call; the rest is in each subpackage's ``__all__`` (docs/runtime.md).
__all__ = [
    # the job
    "init",
    "shutdown",
    "get_runtime",
    "Runtime",
    "split_world",
    "spawn",
    "seed_everything",
    # model and data
    "prepare_model",
    "unwrap",
    "no_sync",
    "build_loader",
    "build_eval_loader",
    "to_device",
    # evaluation and training
    "evaluate",
    "classification_metrics",
    "regression_metrics",
    "Trainer",
    "TrainerConfig",
    "SnapshotConfig",
    "EarlyStoppingConfig",
    "LoggingConfig",
    "DDPConfig",
    "ZeroConfig",
    "FSDPConfig",
    "Callback",
    "Snapshots",
    # what the DDP tutorials write by hand
    "print0",
    "get_logger",
    "barrier",
    "main_first",
    "all_reduce",
    "broadcast_object",
    "all_gather_object",
    "gather_tensors",
    "MetricSums",
    # errors
    "ConfigError",
    "Preempted",
]
