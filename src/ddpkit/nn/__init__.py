"""Layers for data parallelism: a model put on its device inside DDP, BatchNorm and dropout over the global batch."""
