"""A SimCLR/CLIP-style contrastive model on ddpkit: ``examples/originals/contrastive.py`` (the
single-device program) ported in a hand-written loop. The same on 1 or N processes; snapshots in
shared memory and on disk, resumed bit for bit after a kill:

    ddpkit run --nproc 2 --max-restarts 3 examples/contrastive.py --batch-size 32
    python examples/contrastive.py

Two augmented views of each image drawn in ``__getitem__``, an encoder and a projection head with
BatchNorm, the symmetric InfoNCE loss with a learnable temperature, evaluated by how often a test
image's second view is the nearest to its first (scikit-learn's 8x8 digits, no download). What the
port changed (``diff`` the two files):

- ``ddpkit.init()`` and ``ddpkit.seed_everything``; the model in
  ``ddpkit.prepare_model(..., sync_batchnorm=True)``: BatchNorm's statistics over the global batch,
  as SimCLR's global BatchNorm (per rank, each rank's batch would leak which images are together);
- ``ddpkit.build_loader``: this rank's slice of each global batch, each image's views drawn from
  ``(seed, epoch, index)`` whichever rank loads it;
- the loss over the global batch: every rank's embeddings gathered **with their gradients**
  (``ddpkit.gather_tensors(z, grad=True)``) as the negatives, this rank's rows the queries, their
  partners at this rank's place in the global batch; a detached gather trains another model;
- ``ddpkit.Snapshots(memory=True)``: ``resume()``, ``step()`` after each optimizer step,
  ``close()``, the loops from ``loader.epoch``;
- the loss reported as the mean over every rank's batches, ``ddpkit.print0``, the weights saved by
  rank 0; the evaluation, the same on every rank (of the model's own module), unchanged.

With a per-rank batch of B/N, N ranks train the 1-process model within rounding.
"""

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import ddpkit
from ddpkit.demo import digits  # the data alone: scikit-learn's bundled digits


class TwoViews(Dataset):
    """Each image as two random views of it."""

    def __init__(self, images: torch.Tensor) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def view(self, x: torch.Tensor) -> torch.Tensor:
        dy, dx = torch.randint(-1, 2, (2,)).tolist()
        x = torch.roll(F.pad(x, (1, 1, 1, 1)), (dy, dx), dims=(1, 2))[:, 1:-1, 1:-1]
        return x * (0.8 + 0.4 * torch.rand(())) + 0.1 * torch.randn_like(x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[i]
        return self.view(x), self.view(x)


class Contrastive(nn.Module):
    """Encoder and projection head; ``forward`` gives both views' unit embeddings and the scale of
    their similarities (exp of the learnable ``logit_scale``, at most 100 as in CLIP)."""

    def __init__(self, width: int = 32, out: int = 16) -> None:
        super().__init__()
        # no bias before a BatchNorm, which cancels it (SimCLR's convolutions and head too)
        half = width // 2
        self.encoder = nn.Sequential(
            nn.Conv2d(1, half, 3, padding=1, bias=False), nn.BatchNorm2d(half), nn.ReLU(),
            nn.Conv2d(half, width, 3, padding=1, stride=2, bias=False), nn.BatchNorm2d(width),
            nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.head = nn.Sequential(
            nn.Linear(width, width, bias=False), nn.BatchNorm1d(width), nn.ReLU(),
            nn.Linear(width, out),
        )  # fmt: skip
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.1)))

    def forward(self, view1, view2):
        # both views through BatchNorm together: its statistics over the batch's 2 x B images
        z = F.normalize(self.head(self.encoder(torch.cat([view1, view2]))), dim=1)
        z1, z2 = z.chunk(2)
        return z1, z2, self.logit_scale.exp().clamp(max=100)


def info_nce(z1, z2, scale):
    """Symmetric InfoNCE: view 1 of image i picks view 2 of image i among the global batch's, and
    back; this rank's images are the queries, every rank's the keys (gathered with gradients)."""
    every1, every2 = ddpkit.gather_tensors(z1, grad=True), ddpkit.gather_tensors(z2, grad=True)
    first = ddpkit.get_runtime().rank * len(z1)  # this rank's place (drop_last: even slices)
    targets = torch.arange(first, first + len(z1), device=z1.device)
    logits = scale * z1 @ every2.T
    return (F.cross_entropy(logits, targets) + F.cross_entropy(scale * z2 @ every1.T, targets)) / 2


@torch.no_grad()
def retrieval_accuracy(model, images, device) -> float:
    """The share of test images whose second view is, of all their second views, the nearest to
    their first view (the views drawn from seed 0, whatever the training's random state)."""
    model.eval()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        views = TwoViews(images)
        pairs = [views[i] for i in range(len(views))]
    z1, z2, _ = model(*(torch.stack(v).to(device) for v in zip(*pairs)))
    return float(((z1 @ z2.T).argmax(dim=1) == torch.arange(len(z1), device=device)).float().mean())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/contrastive")
    args = parser.parse_args()

    rt = ddpkit.init()
    ddpkit.seed_everything(args.seed)
    device = rt.device
    train, test = digits("train", seed=args.seed), digits("test", seed=args.seed)
    model = ddpkit.prepare_model(Contrastive(), sync_batchnorm=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    loader = ddpkit.build_loader(
        TwoViews(train.tensors[0]), batch_size=args.batch_size, seed=args.seed, num_workers=0
    )
    snapshots = ddpkit.Snapshots(
        args.out, model=model, optimizer=optimizer, loader=loader, memory=True, every_steps=10
    )
    snapshots.resume()  # from the newest snapshot in memory or on disk, if any

    for epoch in range(loader.epoch, args.epochs):
        model.train()
        total = ddpkit.MetricSums()
        for view1, view2 in loader:
            loss = info_nce(*model(view1.to(device), view2.to(device)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            snapshots.step()
            total.update("loss", loss.detach().reshape(1))
        accuracy = retrieval_accuracy(ddpkit.unwrap(model), test.tensors[0], device)
        scale = ddpkit.unwrap(model).logit_scale.exp().item()
        ddpkit.print0(
            f"epoch {epoch}: loss {total.compute()['loss']:.4f}, temperature "
            f"{1 / scale:.4f}, retrieval accuracy {accuracy:.4f}"
        )

    ddpkit.print0(f"retrieval accuracy: {accuracy:.4f} ({len(test)} test images)")
    if rt.is_main:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        torch.save(ddpkit.unwrap(model).state_dict(), Path(args.out) / "model.pt")
    snapshots.close()
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
