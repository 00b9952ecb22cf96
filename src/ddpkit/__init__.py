"""ddpkit: correct, fast, fault-tolerant DistributedDataParallel training for PyTorch.

A single-device script becomes a DDP script with a handful of calls::

    rt = ddpkit.init()                                   # rank, world size, device, backend
    model = ddpkit.prepare_model(Net())                  # to the device, inside DDP
    loader = ddpkit.build_loader(train_set, batch_size=64)
    for epoch in range(epochs):
        for x, y in loader:                              # the epoch advances by itself
            ...
        ddpkit.print0(ddpkit.evaluate(model, test_set))  # exact: every sample counted once

and runs with ``ddpkit run script.py``, ``torchrun``, ``srun`` or plain ``python``.
"""

from ddpkit.batchnorm import CPUSyncBatchNorm, convert_sync_batchnorm
from ddpkit.collectives import (
    MetricSums,
    all_reduce,
    barrier,
    broadcast_object,
    gather_object,
    gather_tensors,
    get_logger,
    is_main,
    main_first,
    print0,
    rank,
    world_size,
)
from ddpkit.data import (
    EvalShardSampler,
    ShardedBatchSampler,
    build_eval_loader,
    build_loader,
    default_num_workers,
    epoch_permutation,
    to_device,
)
from ddpkit.dropout import GlobalBatchDropout
from ddpkit.errors import ConfigError
from ddpkit.evaluation import classification_metrics, evaluate, regression_metrics
from ddpkit.model import prepare_model, unwrap
from ddpkit.runtime import Runtime, get_runtime, init, shutdown
from ddpkit.seeding import rng_state, seed_everything, set_rng_state
from ddpkit.spawn import spawn
from ddpkit.trainer import Trainer, TrainerConfig

__version__ = "0.1.0"

__all__ = [
    "all_reduce",
    "barrier",
    "broadcast_object",
    "build_eval_loader",
    "build_loader",
    "classification_metrics",
    "ConfigError",
    "convert_sync_batchnorm",
    "CPUSyncBatchNorm",
    "default_num_workers",
    "epoch_permutation",
    "EvalShardSampler",
    "evaluate",
    "gather_object",
    "gather_tensors",
    "get_logger",
    "get_runtime",
    "GlobalBatchDropout",
    "init",
    "is_main",
    "main_first",
    "MetricSums",
    "prepare_model",
    "print0",
    "rank",
    "regression_metrics",
    "rng_state",
    "Runtime",
    "seed_everything",
    "set_rng_state",
    "ShardedBatchSampler",
    "shutdown",
    "spawn",
    "to_device",
    "Trainer",
    "TrainerConfig",
    "unwrap",
    "world_size",
]
