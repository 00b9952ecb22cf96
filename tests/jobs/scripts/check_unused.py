"""Mistake: a layer the forward pass never uses, wrapped in DDP without find_unused_parameters."""

import torch.nn.functional as F
from check_common import mlp, sgd, toy_data
from torch import nn


class WithSpareHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.spare_head = nn.Linear(3, 3)  # built, never called

    def forward(self, x):
        return self.body(x)


def ddpkit_workload():
    return WithSpareHead(), toy_data(), F.cross_entropy, sgd
