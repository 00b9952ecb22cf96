"""What seeding each sample from (seed, epoch, index) costs when a batch is loaded in the main
process.

``build_loader`` wraps the dataset in :class:`ddpkit.data.SeededSamples`: a batch is read as it is
with the generators held (python's and torch's states read before and compared after, numpy's
global functions pointed at a stand-in generator); once a sample has drawn, each sample is read with
python's ``random``, numpy's global generator and torch's CPU generator seeded, and python's and
torch's states are put back after the batch. This loads the same batches with and without the
wrapper, in interleaved rounds within one process, and reports per round the time to fetch one
batch (``__getitems__`` of a batch's keys, as the DataLoader's fetcher calls it), then the median
over rounds of the difference and of the ratio seeded / plain.

Two datasets: pytorch/examples' case of pairs of tensors in a list, read as they are (nothing draws:
the watch is all it costs), and an 8x8 image with a light augmentation (a random shift and noise:
every sample seeded).

    python bench/sample_seeding.py                  # batch 64, 200 rounds
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import numpy as np
import torch
from torch.utils.data import Dataset

from ddpkit.data import SeededSamples
from ddpkit.data._sampler import EpochIndices


class Pairs(Dataset):
    def __init__(self, n: int) -> None:
        self.data = [(torch.rand(64), torch.rand(1)) for _ in range(n)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i]


class Augmented(Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 1, 8, 8)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        shift = int(torch.randint(-1, 2, ()))
        return torch.roll(self.x[i], shift, dims=2) + 0.1 * torch.randn(1, 8, 8), i


def fetch_time(fetch, repeats: int) -> float:
    t0 = time.perf_counter()
    for _ in range(repeats):
        fetch()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--repeats", type=int, default=20, help="batches per round and loader")
    a = p.parse_args()
    torch.set_num_threads(1)
    print(
        f"{datetime.date.today()} {platform.node()} python {platform.python_version()} torch "
        f"{torch.__version__} numpy {np.__version__}; batch {a.batch_size}, {a.rounds} rounds of "
        f"{a.repeats} batches; main process"
    )
    for name, data in [
        ("tensors in a list", Pairs(4096)),
        ("8x8 + augmentation", Augmented(4096)),
    ]:
        seeded = SeededSamples(data, seed=0)
        keys = EpochIndices(range(a.batch_size), 0)
        plain_ms, seeded_ms = [], []
        for r in range(a.rounds):
            pair = [
                ("plain", lambda data=data, keys=keys: [data[i] for i in keys]),
                ("seeded", lambda seeded=seeded, keys=keys: seeded.__getitems__(keys)),
            ]
            # alternate the order: drift falls on both
            for label, fetch in pair if r % 2 == 0 else pair[::-1]:
                (plain_ms if label == "plain" else seeded_ms).append(
                    1e3 * fetch_time(fetch, a.repeats)
                )
        extra = statistics.median(s - p for s, p in zip(seeded_ms, plain_ms))
        ratio = statistics.median(s / p for s, p in zip(seeded_ms, plain_ms))
        print(
            f"  {name:20s} plain {statistics.median(plain_ms):.3f} ms/batch, seeded "
            f"{statistics.median(seeded_ms):.3f} ms/batch: +{extra * 1e3:.0f} us per batch "
            f"({extra * 1e3 / a.batch_size:.1f} us per sample), ratio {ratio:.2f}"
        )


if __name__ == "__main__":
    main()
