"""A small GAN's step_fn Trainer, unchanged for ``ddpkit check`` (no ``ddpkit_workload()``).

``--batchnorm``: the discriminator normalises each rank's slice (sync_batchnorm stays off);
``--dropout``: the generator has a dropout; ``--global-dropout``: the config's
``global_batch_dropout``. The noise is the data's (a sample's own), so no rank draws any."""

import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    real = torch.randn(n, 2, generator=g) * 0.5 + torch.tensor([2.0, -1.0])
    return TensorDataset(real, torch.randn(n, 4, generator=g))


def gan_step(step: Any) -> None:
    g, d = step.models["g"], step.models["d"]
    for real, z in step.micro_batches():
        logits = d(torch.cat([real, g(z).detach()]))
        labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
        step.backward(F.binary_cross_entropy_with_logits(logits, labels), "d")
    step.optimizer_step("d")
    for _, z in step.micro_batches():
        logits = d(g(z))
        step.backward(F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits)), "g")
    step.optimizer_step("g")


ddpkit.seed_everything(0)
middle = [nn.Dropout(0.3)] if "--dropout" in sys.argv else []
g = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), *middle, nn.Linear(16, 2))
norm = [nn.BatchNorm1d(16)] if "--batchnorm" in sys.argv else []
d = nn.Sequential(nn.Linear(2, 16), *norm, nn.ReLU(), nn.Linear(16, 1))
config = ddpkit.TrainerConfig(
    run_dir="runs/gan", epochs=1, batch_size=8, num_workers=0,
    global_batch_dropout="--global-dropout" in sys.argv,
)  # fmt: skip
optimizers = {
    "g": torch.optim.SGD(g.parameters(), lr=0.1, momentum=0.9),
    "d": torch.optim.SGD(d.parameters(), lr=0.05),
}
trainer = ddpkit.Trainer({"g": g, "d": d}, optimizers, data(), config, step_fn=gan_step)
trainer.fit()
