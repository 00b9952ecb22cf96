"""Sharded data: a global sample order that does not depend on the world size, loaders over a rank's shard, and
exact evaluation shards."""

from ddpkit.data._loader import (
    build_eval_loader,
    build_loader,
    check_map_style,
    default_num_workers,
    to_device,
)
from ddpkit.data._sample_seeding import SeededSamples
from ddpkit.data._sampler import (
    EvalShardSampler,
    ShardedBatchSampler,
    epoch_permutation,
    shard_bounds,
)

__all__ = [
    "EvalShardSampler",
    "SeededSamples",
    "ShardedBatchSampler",
    "build_eval_loader",
    "build_loader",
    "check_map_style",
    "default_num_workers",
    "epoch_permutation",
    "shard_bounds",
    "to_device",
]
