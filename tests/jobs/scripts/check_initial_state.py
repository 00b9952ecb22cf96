"""Mistake: every rank seeds with its rank, and the model keeps a random projection as a plain
attribute (not a buffer), which DDP does not broadcast."""

import torch
import torch.nn.functional as F
from check_common import mlp, sgd, toy_data
from torch import nn

import ddpkit


class Projected(nn.Module):
    def __init__(self):
        super().__init__()
        self.projection = torch.randn(8, 8)  # a plain tensor: DDP never sees it
        self.body = mlp()

    def forward(self, x):
        return self.body(x @ self.projection)


def ddpkit_workload():
    torch.manual_seed(ddpkit.get_runtime().rank)
    return Projected(), toy_data(), F.cross_entropy, sgd
