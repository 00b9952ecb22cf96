"""The seeds' CNN: the one definition the examples, the benchmarks and ``ddpkit bench``'s default share."""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two conv(5x5) + BatchNorm + ReLU + max-pool blocks and one linear layer, as in the seeds' MNIST example.

    ``image_size`` is the side of the square input: 28 for MNIST, 8 for scikit-learn's digits. ``channels`` (16
    in the seeds) sets the first block's width, the second has twice as many; ``dropout`` before the linear layer
    is off by default, as in the seeds.
    """

    def __init__(self, image_size: int = 28, num_classes: int = 10, channels: int = 16, dropout: float = 0.0) -> None:
        super().__init__()

        def block(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, kernel_size=5, padding=2), nn.BatchNorm2d(c_out), nn.ReLU(), nn.MaxPool2d(2)
            )

        self.features = nn.Sequential(block(1, channels), block(channels, 2 * channels))
        side = image_size // 2 // 2  # each max-pool halves the side: 28 -> 7, 8 -> 2
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * channels * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.dropout(self.features(x).flatten(1)))


class Block(nn.Module):
    """A residual MLP block (``x + W2 relu(W1 x)``, 4x wide inside): the unit of the large models of the memory
    and snapshot benchmarks, and the class FSDP shards by (``shard_blocks=["Block"]``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))
