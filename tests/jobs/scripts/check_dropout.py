"""Mistake: nn.Dropout draws each rank's masks from that rank's RNG."""

import torch.nn.functional as F
from check_common import mlp, sgd, toy_data
from torch import nn


def ddpkit_workload():
    return mlp(nn.Dropout(0.3)), toy_data(), F.cross_entropy, sgd
