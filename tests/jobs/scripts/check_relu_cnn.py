"""A correct ReLU CNN with global-batch BatchNorm (``sync_batchnorm``), no pooling before its last
layer, on the digits scaled to 16x16: enough activations a step that float32 rounding moves one
ReLU input across 0 at some seeds, and through BatchNorm that moves every gradient by 1e-3.
``--per-rank-lr``: each rank's SGD takes its own learning rate, 10% apart (the check's control)."""

import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.demo import digits
from ddpkit.tools._workload import Workload


def ddpkit_workload() -> Workload:
    x, y = digits("train").tensors
    x = F.interpolate(x, size=16, mode="bilinear", align_corners=False)
    model = nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip
    lr = 0.1 * (1 + 0.1 * ddpkit.get_runtime().rank if "--per-rank-lr" in sys.argv else 1)
    return Workload(
        model=model, dataset=TensorDataset(x, y), loss_fn=F.cross_entropy, batch_size=64,
        optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9),
        sync_batchnorm=True,
    )  # fmt: skip
