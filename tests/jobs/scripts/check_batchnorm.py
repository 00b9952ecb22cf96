"""Mistake: BatchNorm normalises each rank's slice (no sync_batchnorm)."""

import torch.nn.functional as F
from check_common import mlp, sgd, toy_data
from torch import nn


def ddpkit_workload():
    return mlp(nn.BatchNorm1d(16)), toy_data(), F.cross_entropy, sgd
