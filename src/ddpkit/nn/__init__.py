"""Layers for data parallelism: BatchNorm and dropout over the global batch."""
