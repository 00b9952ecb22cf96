"""A GAN's step function with validation (``val_data``, ``metric_fn(models, batch)``), a
discriminator with BatchNorm, and a metric-driven scheduler of the discriminator's optimizer.

``python several_val_job.py RUN_DIR OUT [--kill-step N] [--forget-plateau]`` under ``ddpkit run``:
rank 1 SIGKILLs itself after step N on the first attempt; each rank writes its final state to
``OUT.rank<r>``. ``--forget-plateau``: the control, a resume that leaves the schedulers' state out.
The tests import :func:`build` and :func:`metrics` too.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit import EarlyStoppingConfig, LoggingConfig, SnapshotConfig, Trainer, TrainerConfig
from ddpkit.training._several import Schedulers

NOISE = 4


def models() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    g = nn.Sequential(nn.Linear(NOISE, 8), nn.Tanh(), nn.Linear(8, 2))
    d = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    return {"g": g, "d": d}


def data(n: int, seed: int) -> TensorDataset:
    return TensorDataset(torch.randn(n, 2, generator=torch.Generator().manual_seed(seed)) + 2.0)


def gan_step(step: Any) -> None:
    g, d = step.models["g"], step.models["d"]
    for (real,) in step.micro_batches():
        fake = g(torch.randn(len(real), NOISE))  # from the training stream
        logits = d(torch.cat([real, fake.detach()]))
        labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(real), 1)])
        step.backward(F.binary_cross_entropy_with_logits(logits, labels), "d")
    step.optimizer_step("d")
    for (real,) in step.micro_batches():
        logits = d(g(torch.randn(len(real), NOISE)))
        step.backward(F.binary_cross_entropy_with_logits(logits, torch.ones_like(logits)), "g")
    step.optimizer_step("g")


def metrics(models: dict[str, nn.Module], batch: Any) -> dict[str, Any]:
    """Per-sample values and a (sum, count) pair; the fakes from the batch, not from an RNG."""
    (real,) = batch
    g, d = models["g"], models["d"]
    fake = g(torch.cat([real, real], dim=1))
    d_real, d_fake = d(real).squeeze(1), d(fake).squeeze(1)
    d_loss = F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real), reduction="none")
    return {"d_loss": d_loss, "fake_score": (torch.sigmoid(d_fake).sum(), len(real))}


def build(
    run_dir: str, val: bool = True, metric_fn: Any = metrics, plateau: bool = True
) -> Trainer:
    """The Trainer: 96 samples, 8 a rank (16 a step at 2 ranks), 2 epochs; with ``val``, 13
    validation samples every 2 steps and best weights by ``val/d_loss``; with ``plateau`` too, d's
    lr halved by a metric-driven scheduler at every second validation (it never counts one as an
    improvement), whose count a resume must restore."""
    ddpkit.seed_everything(0)
    nets = models()
    optimizers = {
        "g": torch.optim.Adam(nets["g"].parameters(), lr=1e-2),
        "d": torch.optim.SGD(nets["d"].parameters(), lr=5e-2, momentum=0.9),
    }
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        optimizers["d"], factor=0.5, patience=1, threshold=math.inf
    )
    validation: dict[str, Any] = {
        "val_every_steps": 2, "early_stopping": EarlyStoppingConfig(metric="val/d_loss",
        patience=None),
    } if val else {}  # fmt: skip
    config = TrainerConfig(
        run_dir=run_dir, epochs=2, batch_size=8, eval_batch_size=4, seed=0, num_workers=0,
        logging=LoggingConfig(progress=False, every_steps=2),
        snapshot=SnapshotConfig(every_steps=3, async_write=False), **validation,
    )  # fmt: skip
    return Trainer(
        nets, optimizers, data(96, 1), config, step_fn=gan_step,
        val_data=data(13, 2) if val else None, metric_fn=metric_fn if val else None,
        scheduler={"d": scheduler} if val and plateau else None,
    )  # fmt: skip


class Kill:
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: Any, taken: bool, output: Any) -> None:
        rt = trainer.runtime
        if rt.restart_count == 0 and rt.rank == 1 and trainer.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("out")
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--forget-plateau", action="store_true")
    a = p.parse_args()
    if a.forget_plateau:
        Schedulers.load_state_dict = lambda self, state: None  # type: ignore[method-assign]
    rt = ddpkit.init()
    trainer = build(a.run_dir)
    trainer.callbacks.append(Kill(a.kill_step))
    trainer.fit()
    state = {
        "strategy": trainer.strategy.full_state_dict(),
        "step": trainer.step,
        "attempt": rt.restart_count,
        "resumed_from": trainer.resumed_from,
        "lr_d": trainer.strategy.optimizers["d"].param_groups[0]["lr"],  # type: ignore[attr-defined]
    }
    torch.save(state, f"{a.out}.rank{rt.rank}")
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
