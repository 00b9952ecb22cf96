"""A mistake outside ddpkit's list: each rank's optimizer takes its own learning rate."""

import torch
import torch.nn.functional as F
from check_common import mlp, toy_data

import ddpkit


def ddpkit_workload():
    lr = 0.1 * (1 + ddpkit.get_runtime().rank)
    return mlp(), toy_data(), F.cross_entropy, lambda params: torch.optim.SGD(params, lr=lr)
