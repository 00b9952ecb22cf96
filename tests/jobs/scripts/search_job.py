"""The search the tests run: a tiny classifier on the Trainer, one candidate per group of ranks.

``python search_job.py SEARCH_DIR --trials N --group-size K [options]``, alone or under
``ddpkit run``. The options below are the tests' hooks; each proves it acted by a mark the process
writes itself before acting:

- ``--kill EPOCH``: global rank 1 SIGKILLs itself on the first attempt when its first candidate
  reaches epoch EPOCH, having written that candidate's number to ``SEARCH_DIR/killed_trial``;
- ``--kill-in-ask TRIAL``: on the first attempt, the process drawing trial TRIAL's parameters
  SIGKILLs itself between its first and its second parameter (inside the sampler), having written
  ``SEARCH_DIR/killed_in_ask``;
- ``--same-seed-every-start``: every start seeds its samplers as the first did (the behaviour this
  package had before a start was counted), to show what that does;
- ``--storage URL``: the study in a database, which several searches may share;
  ``--first-start``: this start reads the study's count of starts as 0 (as two searches that start
  together both do); ``--seed-without-search-id``: the sampler's seed leaves out the search's own
  id (the behaviour before it was in), to show what that does;
- ``--gate``: at the end of its first epoch (its run directory held by its Trainer), trial 0 prints
  ``gate: trial 0 is running`` and waits for a line on stdin;
- ``--fault ERRNO:TRIAL``: trial TRIAL raises ``OSError(ERRNO)`` at the end of its first epoch;
- ``--fill-disk-after TRIAL``: the same once trial TRIAL has trained, so that the study's own write
  (the trial's result, or the next candidate) meets the full disk.
- ``--fill-disk TRIAL``: at the end of trial TRIAL's first epoch, the file system holding SEARCH_DIR
  is filled (``SEARCH_DIR/filler``) so that the next write of the Trainer or the study meets a full
  disk.
- ``--plots``: the search's report draws Optuna's plots (``SearchConfig(plots=False)`` otherwise).
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys

import optuna
import torch
from torch import nn

import ddpkit
from ddpkit.search import SearchConfig, search, uniform
from ddpkit.training._config import LoggingConfig, SnapshotConfig
from ddpkit.training._trainer import Trainer, TrainerConfig

SPACE = {"lr": uniform(0.01, 0.5, log=True), "momentum": uniform(0.0, 0.9)}


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
    """SIGKILLs global rank 1 on the first attempt at the end of an epoch of its first candidate."""

    def __init__(self, search_dir: str, epoch: int) -> None:
        self.search_dir, self.epoch, self.trial = search_dir, epoch, None

    def on_epoch_end(self, trainer, metrics) -> None:
        rt = ddpkit.get_runtime()
        if rt.restart_count == 0 and rt.rank == 1 and trainer.epoch == self.epoch:
            with open(f"{self.search_dir}/killed_trial", "w") as f:
                f.write(str(self.trial))
            os.kill(os.getpid(), signal.SIGKILL)


class AtFirstEpoch:
    """Calls ``action()`` at the end of the first epoch of trial ``number`` (on every rank of its
    group)."""

    def __init__(self, number: int, action) -> None:
        self.number, self.action, self.trial = number, action, None

    def on_epoch_end(self, trainer, metrics) -> None:
        if self.trial == self.number and trainer.epoch == 1:
            self.action()


def kill_in_ask(search_dir: str, number: int) -> None:
    original = optuna.samplers.TPESampler.sample_independent

    def sample_independent(self, study, trial, name, distribution):
        if (
            trial.number == number
            and name == "momentum"
            and ddpkit.get_runtime().restart_count == 0
        ):
            with open(f"{search_dir}/killed_in_ask", "w") as f:
                f.write(str(number))
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, study, trial, name, distribution)

    optuna.samplers.TPESampler.sample_independent = sample_independent


def fill_disk(search_dir: str) -> None:
    if ddpkit.get_runtime().rank != 0:
        return
    # unbuffered: close() has nothing left to write
    with open(f"{search_dir}/filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC, err
    print("filled the disk", flush=True)


def wait_at_gate() -> None:
    print("gate: trial 0 is running", flush=True)
    sys.stdin.readline()


def same_seed_every_start() -> None:
    from ddpkit.search import _study as search_study

    counted = search_study.count_start

    def first_start_always(study):
        counted(study)
        return 0

    search_study.count_start = first_start_always


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("search_dir")
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--group-size", type=int, default=1)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--kill", type=int, default=None, metavar="EPOCH")
    p.add_argument("--kill-in-ask", type=int, default=None, metavar="TRIAL")
    p.add_argument("--same-seed-every-start", action="store_true")
    p.add_argument("--storage", default=None)
    p.add_argument("--first-start", action="store_true")
    p.add_argument("--seed-without-search-id", action="store_true")
    p.add_argument("--gate", action="store_true")
    p.add_argument("--fault", default=None, metavar="ERRNO:TRIAL")
    p.add_argument("--fill-disk", type=int, default=None, metavar="TRIAL")
    p.add_argument("--fill-disk-after", type=int, default=None, metavar="TRIAL")
    # Optuna's plots cost ~3 s a job (sklearn's import for the importances, matplotlib's layout):
    # drawn only where a test looks at them
    p.add_argument("--plots", action="store_true")
    a = p.parse_args()
    ddpkit.init()
    hooks = []
    if a.kill:
        hooks.append(KillAt(a.search_dir, a.kill))
    if a.kill_in_ask is not None:
        kill_in_ask(a.search_dir, a.kill_in_ask)
    if a.same_seed_every_start or a.first_start:
        same_seed_every_start()
    if a.seed_without_search_id:
        from ddpkit.search import _study as search_study

        sampler = search_study.new_sampler
        search_study.new_sampler = lambda *args: sampler(*args[:4])
    if a.fault:
        code, number = (int(x) for x in a.fault.split(":"))

        def fault():
            raise OSError(code, os.strerror(code))

        hooks.append(AtFirstEpoch(number, fault))
    if a.fill_disk is not None:
        hooks.append(AtFirstEpoch(a.fill_disk, lambda: fill_disk(a.search_dir)))

    if a.gate:
        hooks.append(AtFirstEpoch(0, wait_at_gate))

    def objective(candidate):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
        config = TrainerConfig(
            run_dir=str(candidate.run_dir),
            epochs=a.epochs,
            global_batch_size=12,
            logging=LoggingConfig(progress=False),
            snapshot=SnapshotConfig(every_steps=5),
        )
        for hook in hooks:
            hook.trial = candidate.number
        optimizer = torch.optim.SGD(
            model.parameters(), lr=candidate.params["lr"], momentum=candidate.params["momentum"]
        )
        trainer = Trainer(
            model,
            optimizer,
            Data(96, 1),
            config,
            val_data=Data(40, 2),
            group=candidate.group,
            callbacks=[candidate, *hooks],
        )
        trainer.fit()
        metrics = trainer.evaluate(Data(40, 2), prefix="val")
        if candidate.number == a.fill_disk_after:
            fill_disk(a.search_dir)
        return metrics

    search(
        objective,
        SPACE,
        SearchConfig(
            n_trials=a.trials,
            group_size=a.group_size,
            pruner="none",
            search_dir=a.search_dir,
            storage=a.storage,
            plots=a.plots,
        ),
    )
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
