"""Mistake: the dataset augments a sample with noise drawn from the process's RNG."""

import torch
import torch.nn.functional as F
from check_common import mlp, sgd, toy_data
from torch.utils.data import Dataset


class Noisy(Dataset):
    def __init__(self):
        self.base = toy_data()

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return x + 0.5 * torch.randn_like(x), y


def ddpkit_workload():
    return mlp(), Noisy(), F.cross_entropy, sgd
