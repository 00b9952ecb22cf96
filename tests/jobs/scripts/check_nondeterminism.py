"""Mistake: an op whose result varies from run to run unless torch's deterministic mode is on.

CPU kernels repeat themselves, so this stands in for a GPU one (an atomic scatter-add, say): outside
deterministic mode it adds noise from an unseeded generator, as float atomics add in a varying
order.
"""

import os

import torch
import torch.nn.functional as F
from check_common import mlp, sgd, toy_data
from torch import nn


class AtomicLike(nn.Module):
    def forward(self, x):
        if torch.are_deterministic_algorithms_enabled():
            return x
        g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        return x + 1e-2 * torch.randn(x.shape, generator=g)


def ddpkit_workload():
    return mlp(AtomicLike()), toy_data(), F.cross_entropy, sgd
