"""A SimCLR/CLIP-style contrastive model on one device: the single-device program that
``examples/contrastive.py`` ports to ddpkit (the diff between the two is the port).

Two augmented views of each image (a shift of up to a pixel, a contrast change, noise, drawn in
``__getitem__``), one encoder (a small CNN with BatchNorm) and a projection head (BatchNorm too),
the symmetric InfoNCE loss over the batch (each view's partner is the positive, the batch's other
images the negatives) with a learnable temperature (CLIP's ``logit_scale``). Evaluated by how often
a test image's second view is the nearest to its first among all the test images' (no labels).
scikit-learn's 8x8 digits, no download.

    python examples/originals/contrastive.py
"""

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

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
    """Symmetric InfoNCE: view 1 of image i picks view 2 of image i among the batch's, and back."""
    targets = torch.arange(len(z1), device=z1.device)
    logits = scale * z1 @ z2.T
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2


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
    parser.add_argument("--out", default="runs/contrastive_original")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train, test = digits("train", seed=args.seed), digits("test", seed=args.seed)
    model = Contrastive().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    loader = DataLoader(
        TwoViews(train.tensors[0]), batch_size=args.batch_size, shuffle=True, drop_last=True
    )

    for epoch in range(args.epochs):
        model.train()
        total = 0.0
        for view1, view2 in loader:
            loss = info_nce(*model(view1.to(device), view2.to(device)))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        accuracy = retrieval_accuracy(model, test.tensors[0], device)
        print(
            f"epoch {epoch}: loss {total / len(loader):.4f}, temperature "
            f"{1 / model.logit_scale.exp().item():.4f}, retrieval accuracy {accuracy:.4f}"
        )

    print(f"retrieval accuracy: {accuracy:.4f} ({len(test)} test images)")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), Path(args.out) / "model.pt")


if __name__ == "__main__":
    main()
