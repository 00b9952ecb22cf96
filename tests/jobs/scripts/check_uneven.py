"""Mistake: drop_last=False leaves an epoch's last global batch uneven over the ranks (21 samples, 8
per step: the third step has 5, split 3 + 2), and the loss is each rank's mean."""

import torch.nn.functional as F
from check_common import mlp, sgd, toy_data

from ddpkit.tools._workload import Workload


def ddpkit_workload():
    return Workload(
        model=mlp(),
        dataset=toy_data(21),
        loss_fn=F.cross_entropy,
        optimizer=sgd,
        batch_size=4,
        drop_last=False,
    )
