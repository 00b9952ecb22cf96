"""How long the snapshot in memory holds the training loop, against the step, as the model grows.

The Trainer on 2 CPU ranks (gloo, 1 thread each; :func:`ddpkit.spawn`), snapshots in memory after
every step into a job folder on ``/dev/shm`` (made here as the agent of ``ddpkit run`` makes it);
the stall is the time the save takes (the copy of model, Adam state, RNG states and counters into
the older slot, and its commit), the step the time between two steps' ends. Medians over the steps
after the first 5 (the first save of each slot reserves and maps it). Two families: the DDP
tutorials' CNN on 28x28 inputs at growing widths (batch 32 per rank), and an MLP of two residual
blocks at growing widths (batch 32 per rank), whose step does ~6 x batch flops per parameter against
the CNN's thousands: where the copy catches up with the step, and the 5% budget stops holding at
every step (the Trainer then saves every N steps, N chosen after its first saves).

    python bench/memory_stall.py                  # both families, 40 steps each
    python bench/memory_stall.py --family cnn --steps 100
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn

import ddpkit
from ddpkit.demo._models import Block, DigitsCNN
from ddpkit.distributed._channels import JOB_DIR_ENV, MEMORY
from ddpkit.training._config import LoggingConfig, SnapshotConfig, TrainerConfig
from ddpkit.training._trainer import Trainer

CNN_WIDTHS = (16, 32, 64, 128)
MLP_WIDTHS = (128, 256, 512, 1024, 2048)


class StepTimes:
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, trainer: Any, taken: bool, output: Any) -> None:
        self.ends.append(time.perf_counter())


def job(family: str, width: int, steps: int, runs: str) -> dict:
    ddpkit.init()
    torch.manual_seed(0)
    if family == "cnn":
        model: nn.Module = DigitsCNN(28, channels=width)
        x = torch.randn(64 * steps, 1, 28, 28)
    else:
        model = nn.Sequential(Block(width), Block(width), nn.Linear(width, 10))
        x = torch.randn(64 * steps, width)
    data = torch.utils.data.TensorDataset(x, torch.randint(0, 10, (len(x),)))
    times = StepTimes()
    config = TrainerConfig(
        run_dir=os.path.join(runs, f"{family}-{width}"),
        batch_size=32,
        num_workers=0,
        snapshot=SnapshotConfig(every_epochs=0, memory=True, memory_every_steps=1),
        logging=LoggingConfig(progress=False, every_steps=10_000),
    )
    trainer = Trainer(
        model, torch.optim.Adam(model.parameters(), lr=1e-3), data, config, callbacks=[times]
    )
    assert trainer.memory is not None, "no memory folder"
    trainer.fit()
    stalls = trainer.memory.stalls[5:]
    gaps = [b - a for a, b in zip(times.ends[5:], times.ends[6:])]
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "stall": statistics.median(stalls), "step": statistics.median(gaps)}


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--family", choices=("cnn", "mlp", "both"), default="both")
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args()
    root = os.path.join("/dev/shm", f"ddpkit-memory-stall-{os.getpid()}")
    os.makedirs(root, mode=0o700)
    runs = tempfile.mkdtemp(prefix="memory-stall-")  # the run directories (disk)
    # a job folder, as ddpkit run's agent makes one, with its folder of snapshots in memory
    os.makedirs(os.path.join(root, MEMORY))
    os.environ[JOB_DIR_ENV] = root
    families = ["cnn", "mlp"] if a.family == "both" else [a.family]
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(
        f"memory snapshot stall: {platform.node()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, 2 ranks (gloo, 1 thread each), batch 32 per rank, Adam, {a.steps} "
        f"steps; {now}"
    )
    print("| model | parameters | state copied (MB) | step (ms) | stall (us) | stall / step |")
    print("|---|---|---|---|---|---|")
    try:
        for family in families:
            for width in CNN_WIDTHS if family == "cnn" else MLP_WIDTHS:
                run = functools.partial(job, family, width, a.steps, runs)
                r = ddpkit.spawn(run, 2, threads_per_process=1)[0]
                megabytes = 3 * 4 * r["params"] / 1e6  # weights and Adam's two moments, fp32
                name = (
                    f"DDP tutorials' CNN, {width} channels"
                    if family == "cnn"
                    else f"MLP, 2 blocks of width {width}"
                )
                print(
                    f"| {name} | {r['params'] / 1e6:.2f} M | {megabytes:.1f} | "
                    f"{1e3 * r['step']:.1f} | {1e6 * r['stall']:.0f} | "
                    f"{100 * r['stall'] / r['step']:.1f}% |",
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(runs, ignore_errors=True)


if __name__ == "__main__":
    main()
