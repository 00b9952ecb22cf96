"""The pieces the ``ddpkit check`` test scripts share: a tiny classification problem and an MLP for
it."""

import torch
from torch import nn
from torch.utils.data import TensorDataset


def toy_data(n: int = 64, features: int = 8, classes: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)
    )


def mlp(*middle: nn.Module, features: int = 8, hidden: int = 16, classes: int = 3) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(features, hidden), *middle, nn.ReLU(), nn.Linear(hidden, classes)
    )


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)
