"""The search the tests run: a tiny classifier on the Trainer, one candidate per group of ranks.

``python search_job.py SEARCH_DIR --trials N --group-size K [--kill TRIAL EPOCH]`` under ``ddpkit run``; with
``--kill``, global rank 1 SIGKILLs itself on the first attempt when candidate TRIAL reaches epoch EPOCH.
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
from torch import nn

import ddpkit
from ddpkit.search import SearchConfig, search, uniform
from ddpkit.trainer import Trainer, TrainerConfig


class Data(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x[:, 0] - self.x[:, 1] > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class KillAt:
    """SIGKILLs global rank 1 on the first attempt at the end of an epoch of one candidate."""

    def __init__(self, trial: int, epoch: int) -> None:
        self.trial, self.epoch = trial, epoch

    def on_epoch_end(self, trainer, metrics) -> None:
        rt = ddpkit.get_runtime()
        if rt.restart_count == 0 and rt.rank == 1 and self.number == self.trial and trainer.epoch == self.epoch:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("search_dir")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--group-size", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--kill", type=int, nargs=2, default=None)
    a = p.parse_args()
    ddpkit.init()
    killer = KillAt(*a.kill) if a.kill else None

    def objective(candidate):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
        config = TrainerConfig(run_dir=str(candidate.run_dir), epochs=a.epochs, global_batch_size=12,
                               progress=False, snapshot_every_steps=5)
        callbacks = []
        if killer is not None:
            killer.number = candidate.number
            callbacks.append(killer)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=candidate.params["lr"]), Data(96, 1), config,
                          val_data=Data(40, 2), group=candidate.group, callbacks=callbacks)
        trainer.fit()
        return trainer.evaluate(Data(40, 2), prefix="val")

    search(objective, {"lr": uniform(0.01, 0.5, log=True)},
           SearchConfig(n_trials=a.trials, group_size=a.group_size, pruner="none", search_dir=a.search_dir))
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
