"""Layers for data parallelism: BatchNorm and dropout over the global batch."""

from ddpkit.nn._batchnorm import CPUSyncBatchNorm, convert_sync_batchnorm
from ddpkit.nn._dropout import GlobalBatchDropout, convert_dropout, global_batch

__all__ = [
    "CPUSyncBatchNorm", "GlobalBatchDropout", "convert_dropout", "convert_sync_batchnorm",
    "global_batch",
]  # fmt: skip
