"""Mistake: a plain shuffled DataLoader on every rank (no sharding), so ranks train on the same
samples."""

import torch.nn.functional as F
from check_common import mlp, sgd, toy_data
from torch.utils.data import DataLoader

from ddpkit.tools._workload import Workload


def loader(dataset, batch_size, rank, world_size):
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True)


def ddpkit_workload():
    return Workload(
        model=mlp(),
        dataset=toy_data(),
        loss_fn=F.cross_entropy,
        optimizer=sgd,
        batch_size=8,
        loader=loader,
    )
