"""A GAN on the Trainer: a generator and a discriminator, two optimizers, one step function.

    ddpkit run --nproc 2 examples/gan.py --run-dir runs/gan
    # resumes both models after a crash
    ddpkit run --nproc 2 --max-restarts 1 examples/gan.py --run-dir runs/gan
    python examples/gan.py

The data is a ring of 8 Gaussians in the plane (std 0.05, radius 2). The Trainer wraps both models
in DDP, agrees on each optimizer's non-finite verdict, clips, snapshots both models and optimizers,
and records the mean of each loss over every rank (``train/loss_d``, ``train/loss_g``). At the end
the generator's samples are counted near the ring's modes.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit import SnapshotConfig, Trainer, TrainerConfig

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--run-dir", default="runs/gan")
parser.add_argument("--epochs", type=int, default=12)
parser.add_argument("--batch-size", type=int, default=64, help="per rank")
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()

NOISE, MODES = 8, 8
angles = torch.arange(MODES) * 2 * math.pi / MODES
CENTRES = 2 * torch.stack([angles.cos(), angles.sin()], dim=1)


def ring(n: int, seed: int) -> TensorDataset:
    # Its own generator: every rank draws the same data set.
    gen = torch.Generator().manual_seed(seed)
    centres = CENTRES[torch.randint(MODES, (n,), generator=gen)]
    return TensorDataset(centres + 0.05 * torch.randn(n, 2, generator=gen))


def mlp(inputs: int, outputs: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(inputs, 64),
        nn.LeakyReLU(0.2),
        nn.Linear(64, 64),
        nn.LeakyReLU(0.2),
        nn.Linear(64, outputs),
    )


def gan_step(step):
    g, d = step.models["g"], step.models["d"]
    for (real,) in step.micro_batches():
        # noise from this rank's own stream
        fake = g(torch.randn(len(real), NOISE, device=real.device))
        # One forward of the discriminator on real and fake together: DDP pairs each forward with
        # one backward.
        logits = d(torch.cat([real, fake.detach()]))
        labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)]).to(logits)
        step.backward(F.binary_cross_entropy_with_logits(logits, labels), "d")
    step.optimizer_step("d")
    for (real,) in step.micro_batches():
        logits = d(g(torch.randn(len(real), NOISE, device=real.device)))
        # non-saturating
        step.backward(F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits)), "g")
    step.optimizer_step("g")


ddpkit.init()
ddpkit.seed_everything(args.seed)
generator, discriminator = mlp(NOISE, 2), mlp(2, 1)
optimizers = {
    "g": torch.optim.Adam(generator.parameters(), lr=args.lr, betas=(0.5, 0.999)),
    "d": torch.optim.Adam(discriminator.parameters(), lr=args.lr, betas=(0.5, 0.999)),
}
config = TrainerConfig(
    run_dir=args.run_dir,
    epochs=args.epochs,
    batch_size=args.batch_size,
    seed=args.seed,
    num_workers=0,  # tensors in memory
    clip_grad_norm=10.0,  # per optimizer: each one's own norm
    snapshot=SnapshotConfig(every_steps=20),
)
trainer = Trainer(
    {"g": generator, "d": discriminator},
    optimizers,
    ring(4096, args.seed),
    config,
    step_fn=gan_step,
)
trainer.fit()

with torch.no_grad():
    samples = generator(torch.randn(2000, NOISE, device=ddpkit.get_runtime().device)).cpu()
nearest = torch.cdist(samples, CENTRES).min(dim=1)
near = nearest.values < 0.3
modes = len(set(nearest.indices[near].tolist()))
ddpkit.print0(f"samples near a mode: {near.float().mean():.3f}, modes covered: {modes}/{MODES}")
ddpkit.shutdown()
