"""A small job whose rank 1 can be made slow on purpose: the job of the slow-rank and throughput
tests.

Every rank's dataset sleeps ``SLEEP`` seconds a sample, so that a step's time is mostly waiting,
which other work on a shared CPU stretches far less than computing, and equal ranks stay equal; few
long sleeps rather than many short ones, as a loaded machine adds its wake-up latency to each.
``slow="data"`` makes rank 1's samples sleep ``SLOW_SLEEP`` more; ``slow="compute"`` gives rank 1's
forward a loop of matmuls.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit.testing import read_records
from ddpkit.training._config import LoggingConfig, SnapshotConfig, TrainerConfig
from ddpkit.training._trainer import Trainer

N, FEATURES, HIDDEN, CLASSES = 64, 32, 64, 4
SLEEP, SLOW_SLEEP = 0.025, 0.075
GLOBAL_BATCH = 4  # 2 samples per rank
TOKENS_PER_SAMPLE = 3


class SleepyData(torch.utils.data.Dataset):
    def __init__(self, sleep: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = (
            torch.randn(N, FEATURES, generator=g),
            torch.randint(0, CLASSES, (N,), generator=g),
        )
        self.sleep = sleep

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        time.sleep(self.sleep)  # a slow disk or decoder: blocked, not computing
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self, extra_matmuls: int = 0) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(FEATURES, HIDDEN, bias=False), nn.ReLU(), nn.Linear(HIDDEN, CLASSES)
        )
        self.extra = extra_matmuls
        self.register_buffer("square", torch.randn(256, 256) / 16, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.extra:  # a slower device: work whose result the step does not need
            h = self.square
            for _ in range(self.extra):
                h = torch.tanh(h @ self.square)
            x = x + 0 * h.sum()
        return self.body(x)


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def train(
    run_dir: str,
    *,
    slow: str | None = None,
    steps: int = 16,
    every: int = 4,
    tokens: bool = False,
    peak_flops: float | None = None,
    step_timings: bool = True,
) -> list[dict]:
    """Train ``steps`` steps (one epoch) of a global batch of 4; the records of metrics.jsonl (main
    rank; [] elsewhere)."""
    ddpkit.init()
    # two ranks on a shared machine: no rank's matmuls take the other's core
    torch.set_num_threads(1)
    rank = ddpkit.get_runtime().rank
    torch.manual_seed(0)
    # Rank 1's forward takes ~2x the 50 ms its samples sleep: with two ranks the median is their
    # mean, so a busy time b against a's gives a ratio 2b / (a + b), far above the 1.2 that names
    # a slow rank (40 matmuls, ~29 ms here, gave 1.21: one faster core away from not slow).
    model = Net(extra_matmuls=160 if slow == "compute" and rank == 1 else 0)
    data = SleepyData(SLEEP + (SLOW_SLEEP if slow == "data" and rank == 1 else 0.0))
    config = TrainerConfig(
        run_dir=run_dir,
        max_steps=steps,
        epochs=100,
        global_batch_size=GLOBAL_BATCH,
        num_workers=0,
        snapshot=SnapshotConfig(every_epochs=0),
        logging=LoggingConfig(
            every_steps=every, progress=True, step_timings=step_timings, peak_flops=peak_flops
        ),
    )
    count_fn = (lambda batch: TOKENS_PER_SAMPLE * batch[0].shape[0]) if tokens else None
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        config,
        batch_loss_fn=loss_fn,
        count_fn=count_fn,
    )
    trainer.fit()
    if not trainer.runtime.is_main:
        return []
    return read_records(trainer.run_dir)
