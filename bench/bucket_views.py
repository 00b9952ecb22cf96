"""What ``gradient_as_bucket_view`` (ddpkit's default, torch's DDP off) saves a DDP step.

With it each gradient is a view into the bucket DDP all-reduces; without it DDP copies the
all-reduced bucket back into gradients of their own after every backward. The model is
``bench/loader_overhead.py``'s MLP (20-H-H-1, 620 KB of gradients at H = 384), SGD, batch 32 a rank,
one fixed batch (no loader: the step alone). Several instances of each kind are made, since two
instances of one model differ by a few percent in step time by where their tensors landed; they
train in interleaved rounds (an order that rotates and reverses), and each view instance is
paired with the copy instance made beside it. Per round, the median of 10 timed steps after 3
untimed; reported per pair, the median over rounds of the difference (views - copies) with a
distribution-free 95% interval.

``--trainer``: the same pairs as ``ddpkit.Trainer`` runs
(``DDPConfig(gradient_as_bucket_view=...)``, its defaults otherwise: NaN/inf verdict, step
timings, per-sample seeding) on
``bench/loader_overhead.py``'s dataset, one epoch of 10 steps a round, the step time the median
between consecutive optimizer steps. The Trainer's verdict reads every gradient after the
all-reduce: with views it is the first to read what the all-reduce wrote, which DDP's copy read
before.

    python bench/bucket_views.py             # 2 ranks (gloo, 1 thread each, pinned)
    python bench/bucket_views.py --nproc 1   # one rank: DDP at a world of one
    python bench/bucket_views.py --trainer   # the Trainer's steps
    python bench/bucket_views.py --nproc 1 --hidden 4096   # on a GPU (nccl)

On a GPU each rank takes its runtime's device (nccl); the step is timed between synchronizations,
and each instance's memory held after its first step (model, gradients, DDP's buckets) is
reported.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import io
import os
import statistics
import tempfile
import time

import torch
from loader_overhead import MyTrainDataset, mlp, run_line
from torch import nn
from trainer_overhead import median_interval, steady_malloc

import ddpkit
import ddpkit.platforms._cpus
from ddpkit.strategies import DDPConfig
from ddpkit.training._config import LoggingConfig, SnapshotConfig
from ddpkit.training._trainer import Trainer, TrainerConfig


def bench(rounds: int, hidden: int, instances: int, trainer: bool) -> dict:
    rt = ddpkit.init()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= rt.world_size:  # a rank that migrates between cores adds noise to both kinds
        os.sched_setaffinity(0, {cores[rt.rank]})
    steady_malloc()
    make = trainer_run if trainer else step_run
    held: dict[tuple[bool, int], int] = {}
    if rt.device.type == "cuda":
        # What the first step on a device allocates once (cuBLAS's workspaces, 65 MiB on an H200)
        # is allocated here, outside every instance's count.
        make(True, hidden)
    runs = {}
    for i in range(instances):
        for view in (True, False):
            # What an instance holds, and only that: garbage in reference cycles (the process's
            # first optimizer step leaves its model in one) is freed by the collector, at a time of
            # its choosing, so it is collected on both sides of the count.
            gc.collect()
            before = torch.cuda.memory_allocated() if rt.device.type == "cuda" else 0
            runs[view, i] = make(view, hidden)
            gc.collect()
            if rt.device.type == "cuda":
                held[view, i] = torch.cuda.memory_allocated() - before
    names = list(runs)
    out: dict[tuple[bool, int], list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):  # the first round warms up, excluded
        k = r % len(names)
        order = names[k:] + names[:k]
        # every instance in every place, both ways round
        for name in order if r % 2 == 0 else order[::-1]:
            seconds = runs[name]()
            if r:
                out[name].append(seconds)
    res = {f"{'views' if view else 'copies'} {i}": xs for (view, i), xs in out.items()}
    res["held"] = {f"{'views' if view else 'copies'} {i}": b for (view, i), b in held.items()}
    res["device"] = str(rt.device)
    return res


def step_run(view: bool, hidden: int):
    """A prepare_model'd MLP on one fixed batch: 10 timed steps after 3 untimed, their median.
    Built and stepped once here, so that what it holds is counted where it is made."""
    device = ddpkit.get_runtime().device
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    torch.manual_seed(0)
    model = ddpkit.prepare_model(mlp(hidden), gradient_as_bucket_view=view)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 20, device=device), torch.randn(32, 1, device=device)

    def step() -> None:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()

    def run() -> float:
        for _ in range(3):
            step()
        times = []
        for _ in range(10):
            sync()
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    step()
    sync()
    return run


def trainer_run(view: bool, hidden: int):
    """A Trainer over 10 steps of 32 samples a rank: one epoch a call, its median step."""
    rt = ddpkit.get_runtime()
    torch.manual_seed(0)
    data = MyTrainDataset(10 * 32 * rt.world_size)
    net = mlp(hidden)
    run_dir = ddpkit.broadcast_object(
        tempfile.mkdtemp(prefix="ddpkit-bench-") if rt.is_main else ""
    )
    config = TrainerConfig(
        run_dir=run_dir,
        batch_size=32,
        epochs=1,
        num_workers=0,
        snapshot=SnapshotConfig(every_epochs=0),
        logging=LoggingConfig(progress=False),
        strategy=DDPConfig(gradient_as_bucket_view=view),
    )
    trainer = Trainer(
        net,
        torch.optim.SGD(net.parameters(), lr=1e-3),
        data,
        config,
        loss_fn=nn.functional.mse_loss,
    )
    stamps: list[float] = []
    trainer.optimizer.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))

    def run() -> float:
        stamps.clear()
        trainer.epoch = trainer.cursor = 0  # the same single epoch again, as a new Trainer
        trainer.stopped_by = None
        ddpkit.barrier()
        with contextlib.redirect_stdout(io.StringIO()):  # its summary of each fit()
            trainer.fit()
        ddpkit.barrier()
        return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))

    return run


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--instances", type=int, default=3)
    p.add_argument("--trainer", action="store_true", help="the Trainer's steps")
    a = p.parse_args()
    import torch._dynamo  # noqa: F401  (DDP's constructor imports it: once here rather than in every rank)

    res = ddpkit.spawn(
        functools.partial(bench, a.rounds, a.hidden, a.instances, a.trainer), a.nproc
    )[0]
    print(run_line())
    print(
        f"config: {a.nproc} rank(s) ({res['device']}), MLP 20-{a.hidden}-{a.hidden}-1, "
        "batch 32/rank, "
        f"{'the Trainer' if a.trainer else 'a hand step'}, {a.instances} instances of each kind, "
        f"{a.rounds} interleaved rounds"
    )
    for i in range(a.instances):
        views, copies = res[f"views {i}"], res[f"copies {i}"]
        diffs = sorted((v - c) * 1e6 for v, c in zip(views, copies, strict=True))
        lo, hi = median_interval(diffs)
        print(
            f"  instance {i}: views {statistics.median(views) * 1e3:.3f} ms, copies "
            f"{statistics.median(copies) * 1e3:.3f} ms; views - copies "
            f"{statistics.median(diffs):+.1f} us/step (95% interval {lo:+.1f} to {hi:+.1f})"
        )
    for name, held in res["held"].items():
        print(f"  {name}: {held / 2**20:.1f} MiB held after its first step")


if __name__ == "__main__":
    main()
