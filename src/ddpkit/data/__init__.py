"""Sharded data: a global sample order that does not depend on the world size, loaders over a rank's
shard, and exact evaluation shards.

Streams (:class:`Stream` and its adapters :class:`JsonlStream`, :class:`TokenStream`,
:class:`IterableStream`) are an extra that needs numpy: imported on first use, not by ``import
ddpkit``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ddpkit.data._loader import (
    SeededSamples,
    build_eval_loader,
    build_loader,
    check_map_style,
    default_num_workers,
    to_device,
)
from ddpkit.data._sampler import (
    EpochIndices,
    EvalShardSampler,
    ShardedBatchSampler,
    epoch_permutation,
    shard_bounds,
)

if TYPE_CHECKING:
    from ddpkit.data._stream import Stream
    from ddpkit.data._stream_sources import IterableStream, JsonlStream, TokenStream

_LAZY = {
    "Stream": "_stream",
    **dict.fromkeys(("IterableStream", "JsonlStream", "TokenStream"), "_stream_sources"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"ddpkit.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'ddpkit.data' has no attribute {name!r}")


__all__ = [
    "EpochIndices",
    "EvalShardSampler",
    "IterableStream",
    "JsonlStream",
    "SeededSamples",
    "ShardedBatchSampler",
    "Stream",
    "TokenStream",
    "build_eval_loader",
    "build_loader",
    "check_map_style",
    "default_num_workers",
    "epoch_permutation",
    "shard_bounds",
    "to_device",
]
