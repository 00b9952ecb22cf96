"""What ``build_loader`` and the Trainer cost over ``DataLoader`` + ``DistributedSampler`` on a
plain Dataset.

The case of pytorch/examples' ddp-tutorial-series: a ``Dataset`` (not a ``TensorDataset``) holding a
list of ``(torch.rand(20), torch.rand(1))`` pairs, read as they are, in the main process (no loader
workers), a small MLP with MSE loss and SGD, ~2 ms steps. Five loops train on it in the same job, in
interleaved rounds (one epoch of each per round, in an order that rotates), so that noise from other
work on the machine falls on all. Every loop trains the same model with the same optimizer, the
Trainer's (DDP-wrapped as ``prepare_model`` wraps it), and the Trainer loops are one Trainer, fed by
each loader in turn:

- ``hand``: the tutorial's loop over ``DataLoader(dataset, batch_size,
  sampler=DistributedSampler(dataset))``;
- ``hand+build_loader``: the same loop over ``ddpkit.build_loader(dataset,
  batch_size, num_workers=0)`` (per-sample seeding on, the default), and with
  ``seed_samples=False``. The tutorial's ``__getitem__`` only subscripts the list it holds, which
  ``SeededSamples`` proves draws nothing, so no batch is watched for draws;
- ``hand+build_loader, watched read``: the same data read by a ``__getitem__`` the proof does not
  cover (``self.data[index][0], self.data[index][1]``: it draws nothing either), so every batch is
  watched: what the watch for draws costs a dataset that decodes without augmenting;
- ``trainer``: ``ddpkit.Trainer`` with its defaults (``seed_samples=True``);
- ``trainer, seed_samples=False``: the Trainer with the seeding switched off;
- ``trainer, seed_samples=False, no NaN/inf verdict``: the same with the strategy's check of the
  gradients replaced by a finite verdict (a private helper, for this bench only: no option turns it
  off), to show what the verdict costs inside a step, where the gradients are no longer in cache,
  against ``bench/trainer_step_pieces.py``'s figure for it alone.

Step time is the time between consecutive optimizer steps on rank 0 (a post-step hook), so a step is
all between two updates: loading the batch, forward, backward and its all-reduce, the update,
bookkeeping. Per round, the median step of each loop; reported, for each pair, the median over
rounds of the per-round ratio with a distribution-free 95% interval. Targets:
``hand+build_loader / hand`` at most 1.01 and ``trainer / hand`` at most 1.03.
``trainer / hand`` holds the Trainer's own per-step work as well (see
``bench/trainer_overhead.py --model tiny``).

    python bench/loader_overhead.py            # 2 ranks, batch 32 per rank, hidden 384, 400 rounds
    python bench/loader_overhead.py --nproc 1  # one process: no all-reduce in the step
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import io
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from trainer_overhead import median_interval, steady_malloc

import ddpkit
import ddpkit.platforms._cpus
from ddpkit.strategies._ddp import GradientVerdict
from ddpkit.training._config import LoggingConfig, SnapshotConfig
from ddpkit.training._trainer import Trainer, TrainerConfig

LOOPS = (
    "hand",
    "hand+build_loader",
    "hand+build_loader, watched read",
    "hand+build_loader, seed_samples=False",
    "trainer",
    "trainer, seed_samples=False",
    "trainer, seed_samples=False, no NaN/inf verdict",
)
PAIRS = [
    ("hand+build_loader", "hand"),
    ("hand+build_loader, watched read", "hand"),
    ("hand+build_loader, seed_samples=False", "hand"),
    ("hand+build_loader", "hand+build_loader, seed_samples=False"),
    ("trainer", "trainer, seed_samples=False"),
    ("trainer", "hand"),
    # the Trainer's own per-step work, each on the same loader as the hand loop
    ("trainer, seed_samples=False", "hand+build_loader, seed_samples=False"),
    # ... less the verdict on the gradients (a pass over every gradient, every step)
    ("trainer, seed_samples=False, no NaN/inf verdict", "hand+build_loader, seed_samples=False"),
    # the verdict alone
    ("trainer, seed_samples=False", "trainer, seed_samples=False, no NaN/inf verdict"),
]


class MyTrainDataset(Dataset):
    """pytorch/examples' ddp-tutorial-series dataset: random pairs in a list, read as they are."""

    def __init__(self, size: int) -> None:
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        return self.data[index]


class WatchedRead(MyTrainDataset):
    """The same samples, read by a ``__getitem__`` whose code the loader cannot prove draws nothing
    (a subscript of what a subscript gave may run any code): watched for draws every batch."""

    def __init__(self, data: list) -> None:
        self.data = data

    def __getitem__(self, index: int):
        return self.data[index][0], self.data[index][1]


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
    )


def hand_epoch(
    model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, epoch: int
) -> None:
    """The tutorial's _run_epoch: set_epoch where there is a DistributedSampler, then zero_grad,
    loss, step."""
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(epoch)
    for source, targets in loader:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(source), targets)
        loss.backward()
        optimizer.step()


def bench(steps: int, rounds: int, batch_size: int, hidden: int) -> dict:
    rt = ddpkit.init()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    threads = torch.get_num_threads()
    pinned = len(cores) >= rt.world_size * threads
    if pinned:  # a rank that migrates between cores adds noise to every loop
        os.sched_setaffinity(0, set(cores[rt.rank * threads : (rt.rank + 1) * threads]))
    steady = steady_malloc()
    torch.manual_seed(0)
    data = MyTrainDataset(steps * batch_size * rt.world_size)

    # One model and optimizer for every loop: the Trainer's, which the hand loops train too. Two
    # instances of the same model differ by a few percent in step time by where their tensors
    # landed, which would hide a 2% effect.
    torch.manual_seed(0)
    net = mlp(hidden)
    run_dir = ddpkit.broadcast_object(
        tempfile.mkdtemp(prefix="ddpkit-bench-") if rt.is_main else ""
    )
    config = TrainerConfig(
        run_dir=run_dir,
        batch_size=batch_size,
        epochs=1,
        num_workers=0,
        snapshot=SnapshotConfig(every_epochs=0),
        logging=LoggingConfig(progress=False),
        # resume=True, with nothing to resume: resume=False sets the previous epoch's records aside
        # each time
    )
    trainer = Trainer(
        net,
        torch.optim.SGD(net.parameters(), lr=1e-3),
        data,
        config,
        loss_fn=nn.functional.mse_loss,
    )
    # The DDP-wrapped model prepare_model gives, as a hand loop has it. It carries the Trainer's
    # step-timings hook on one parameter's gradient accumulation, which returns at once in the hand
    # loops' backward (one Python call a step: a few us).
    model, opt = trainer.model, trainer.optimizer
    runs: dict[str, Any] = {}
    for name, loader in (
        ("hand", DataLoader(data, batch_size=batch_size, sampler=DistributedSampler(data))),
        ("hand+build_loader", ddpkit.build_loader(data, batch_size, num_workers=0)),
        (
            "hand+build_loader, watched read",
            ddpkit.build_loader(WatchedRead(data.data), batch_size, num_workers=0),
        ),
        (
            "hand+build_loader, seed_samples=False",
            ddpkit.build_loader(data, batch_size, num_workers=0, seed_samples=False),
        ),
    ):
        runs[name] = functools.partial(hand_epoch, model, opt, loader)
    # What TrainerConfig(seed_samples=False) builds (the same arguments as the Trainer's own
    # loader).
    unseeded = ddpkit.build_loader(data, batch_size, num_workers=0, seed_samples=False)
    trainer_loaders = {
        "trainer": trainer.loader,
        "trainer, seed_samples=False": unseeded,
        "trainer, seed_samples=False, no NaN/inf verdict": unseeded,
    }
    strategy = trainer.strategy
    finite = GradientVerdict(True, None)

    def trainer_epoch(name: str, epoch: int) -> None:
        trainer.loader = trainer_loaders[name]
        trainer.sampler = trainer.loader.batch_sampler  # type: ignore[assignment]
        trainer.epoch = trainer.cursor = 0  # the same single epoch again
        trainer.stopped_by = None  # as a new Trainer has it: fit() ends with the reason it stopped
        if name.endswith("no NaN/inf verdict"):
            strategy.check_gradients = lambda max_norm=None: finite  # type: ignore[method-assign]
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # its summary of each fit()
                trainer.fit()
        finally:
            vars(strategy).pop("check_gradients", None)

    for name in trainer_loaders:
        runs[name] = functools.partial(trainer_epoch, name)

    stamps: list[float] = []
    opt.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))

    def timed(name: str, epoch: int) -> float:
        stamps.clear()
        ddpkit.barrier()
        runs[name](epoch)
        ddpkit.barrier()
        return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))

    # The loaders alone, fetching one epoch with nothing else in the loop: the same extra as in a
    # step, with less of the step's noise around it.
    alone = {
        "DataLoader + DistributedSampler": DataLoader(
            data, batch_size=batch_size, sampler=DistributedSampler(data)
        ),
        "build_loader": ddpkit.build_loader(data, batch_size, num_workers=0),
        "build_loader, seed_samples=False": ddpkit.build_loader(
            data, batch_size, num_workers=0, seed_samples=False
        ),
    }

    def fetch(name: str, epoch: int) -> float:
        loader = alone[name]
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        start = time.perf_counter()
        count = sum(1 for _ in loader)
        return (time.perf_counter() - start) / count

    for name in LOOPS:  # warm-up, excluded
        timed(name, 0)
    out: dict[str, list[float]] = {name: [] for name in [*LOOPS, *alone]}
    for r in range(rounds):
        for names, run in ((LOOPS, timed), (tuple(alone), fetch)):
            k = r % len(names)
            order = list(names[k:] + names[:k])
            # every loop in every place, both ways round
            for name in order if r % 2 == 0 else order[::-1]:
                out[name].append(run(name, r + 1))
    return {"steps": out, "pinned": pinned, "threads": threads, "steady_malloc": steady}


def run_line() -> str:
    """When and where a run was made: the date, the machine, its load, Python and torch."""
    return (
        f"date {datetime.datetime.now():%Y-%m-%d %H:%M}  machine {platform.machine()}, "
        f"{ddpkit.platforms._cpus.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}  "
        f"python {platform.python_version()}  torch {torch.__version__}"
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="steps per timed epoch")
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=32, help="per rank (the tutorial's 32)")
    p.add_argument("--hidden", type=int, default=384, help="the MLP's width: sets the step time")
    a = p.parse_args()
    import torch._dynamo  # noqa: F401  (DDP's constructor imports it: once here rather than in every rank)

    res = ddpkit.spawn(
        functools.partial(bench, a.steps, a.rounds, a.batch_size, a.hidden), a.nproc
    )[0]
    print(run_line())
    print(
        f"config: {a.nproc} rank(s) (gloo, CPU, {res['threads']} thread(s) each, "
        f"{'pinned' if res['pinned'] else 'not pinned'}, "
        f"{'fixed' if res['steady_malloc'] else 'adaptive'} malloc thresholds), MyTrainDataset (a "
        f"list of (rand(20), rand(1))), MLP 20-{a.hidden}-{a.hidden}-1, batch {a.batch_size}/rank, "
        f"no loader workers, {a.steps} steps x {a.rounds} interleaved rounds, warm-up excluded"
    )
    steps = {name: [s * 1e3 for s in xs] for name, xs in res["steps"].items()}
    for name in LOOPS:
        print(f"  {name:48s} {statistics.median(steps[name]):.3f} ms/step (median over rounds)")
    print(
        "step time, median over rounds of the per-round ratio (95% interval), and of the "
        "difference:"
    )
    for top, bottom in PAIRS:
        ratios = sorted(t / b for t, b in zip(steps[top], steps[bottom]))
        lo, hi = median_interval(ratios)
        diffs = sorted((t - b) * 1e3 for t, b in zip(steps[top], steps[bottom]))
        dlo, dhi = median_interval(diffs)
        print(
            f"  {top} / {bottom}: ratio {statistics.median(ratios):.3f}, 95% interval "
            f"{lo:.3f}-{hi:.3f}; {statistics.median(diffs):+.0f} us/step ({dlo:+.0f} to {dhi:+.0f})"
        )
    hand = statistics.median(steps["hand"])
    reference = steps["DataLoader + DistributedSampler"]
    print(
        "the loaders alone (one epoch fetched per round), per batch, and as a share of the hand "
        "loop's step:"
    )
    for name in ("build_loader", "build_loader, seed_samples=False"):
        diffs = sorted((o - t) * 1e3 for o, t in zip(steps[name], reference))
        dlo, dhi = median_interval(diffs)
        extra = statistics.median(diffs)
        print(
            f"  {name} {statistics.median(steps[name]) * 1e3:.1f} us, DataLoader + "
            f"DistributedSampler {statistics.median(reference) * 1e3:.1f} us: {extra:+.1f} "
            f"us/batch ({dlo:+.1f} to {dhi:+.1f}), {1 + extra / 1e3 / hand:.3f}x a {hand:.2f} ms "
            f"step ({1 + dlo / 1e3 / hand:.3f}-{1 + dhi / 1e3 / hand:.3f})"
        )


if __name__ == "__main__":
    main()
