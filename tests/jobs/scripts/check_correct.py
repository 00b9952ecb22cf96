"""A correct script: N ranks train the same model as one process."""

import torch.nn.functional as F
from check_common import mlp, sgd, toy_data

from ddpkit.tools._workload import Workload


def ddpkit_workload():
    return Workload(
        model=mlp(), dataset=toy_data(), loss_fn=F.cross_entropy, optimizer=sgd, batch_size=8
    )
