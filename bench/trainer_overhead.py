"""What the Trainer costs over a hand-written DDP loop like the DDP tutorials', and how long a
snapshot stalls training.

Both loops train the DDP tutorials' MNIST CNN (two conv+BatchNorm blocks, one linear layer;
``--model tiny``: one linear layer, ~1-2 ms steps, where a per-step cost in microseconds shows) on
MNIST-shaped synthetic data, with the same per-rank batch, in the same job, in interleaved rounds
(hand, trainer, trainer, hand, ...) so that noise from other work on the machine falls on both. A
round is one epoch of each loop. Each rank is pinned to its own core(s) when there are enough, and
glibc malloc's thresholds are fixed (see steady_malloc; ``--default-malloc`` leaves them adaptive).

Two measures, both on rank 0:
- step time: the time between consecutive optimizer steps (a post-step hook on each loop's
  optimizer), so a step is everything between two updates (data, forward, backward and its
  all-reduce, update, bookkeeping). Per round, the median step; reported: the median over rounds of
  the paired ratio trainer / hand, with a distribution-free 95% interval. Target: <= 1.02 at ~20 ms
  steps.
- epoch time: barrier to barrier, divided by the steps, so that the Trainer's once-per-epoch and
  every-N-steps work (loss agreement, logging, the end of the epoch) is in it too.
Each is also given as the Trainer's extra microseconds per step (median of the per-round
differences). ``bench/loader_overhead.py`` pairs the Trainer with hand loops on three models in one
job, over ``build_loader`` too.

    # 2 ranks, gloo, batch 64 per rank
    python bench/trainer_overhead.py
    # ~20 ms steps on a 2-core machine
    python bench/trainer_overhead.py --batch-size 24
    # a linear layer: ~1-2 ms steps, the cost in us
    python bench/trainer_overhead.py --model tiny
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import math
import os
import platform
import statistics
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit
import ddpkit.platforms._cpus
from ddpkit.demo._models import DigitsCNN
from ddpkit.training._config import LoggingConfig, SnapshotConfig
from ddpkit.training._trainer import Trainer, TrainerConfig


def hand_loop(
    model: nn.Module, optimizer, loader: DataLoader, sampler: DistributedSampler, epoch: int
) -> None:
    """The DDP tutorials' loop: set_epoch, forward, loss, zero_grad, backward, step."""
    criterion = nn.CrossEntropyLoss()
    device = ddpkit.get_runtime().device
    sampler.set_epoch(epoch)
    model.train()
    for image, target in loader:
        image, target = image.to(device), target.to(device)
        loss = criterion(model(image), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def steady_malloc() -> bool:
    """Fix glibc malloc's thresholds in this process, so that the loops are compared and not
    allocator luck.

    glibc serves large blocks (a batch's activations) with mmap, and raises its mmap and trim
    thresholds as such blocks are freed; whether a step's tensors come from reused heap memory or
    from fresh pages (page faults, zeroing) then depends on the history of the process, and flips
    between rounds by up to ~15% of a step. Fixed thresholds make every step reuse the heap, for
    both loops alike.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    big = 1 << 30
    return all(
        libc.mallopt(opt, big) == 1 for opt in (m_mmap_threshold, m_trim_threshold, m_top_pad)
    )


def tiny_model() -> nn.Module:
    """One linear layer over the flattened image: a step is little more than DDP's all-reduce and
    the loop."""
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))


def deep_model() -> nn.Module:
    """48 narrow blocks (Linear 64 -> 64, LayerNorm): 196 parameters, where a cost per parameter
    (a hook on each) shows."""
    blocks = [m for _ in range(48) for m in (nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU())]
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 64), *blocks, nn.Linear(64, 10))


MODELS = {"cnn": lambda: DigitsCNN(28), "tiny": tiny_model, "deep": deep_model}
MODEL_NAMES = {
    "cnn": "the DDP tutorials' CNN",
    "tiny": "one linear layer 784 -> 10",
    "deep": "48 blocks of Linear 64 -> 64 and LayerNorm",
}


def bench(
    steps: int, rounds: int, batch_size: int, default_malloc: bool = False, model: str = "cnn"
) -> dict:
    rt = ddpkit.init()
    world = rt.world_size
    # A rank that migrates between cores adds noise to both loops; give each rank cores of its own
    # if it can.
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    threads = torch.get_num_threads()
    pinned = len(cores) >= world * threads
    if pinned:
        os.sched_setaffinity(0, set(cores[rt.rank * threads : (rt.rank + 1) * threads]))
    steady = not default_malloc and steady_malloc()
    g = torch.Generator().manual_seed(0)
    n = steps * batch_size * world
    data = TensorDataset(
        torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    )

    torch.manual_seed(0)
    build = MODELS[model]
    hand_model = ddpkit.prepare_model(build())
    hand_opt = torch.optim.SGD(hand_model.parameters(), lr=1e-3)
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)

    torch.manual_seed(0)
    net = build()
    run_dir = tempfile.mkdtemp(prefix="ddpkit-bench-") if rt.is_main else ""
    config = TrainerConfig(
        run_dir=ddpkit.broadcast_object(run_dir),
        batch_size=batch_size,
        epochs=1,
        num_workers=0,
        snapshot=SnapshotConfig(every_epochs=0),
        # resume=True (the default), with nothing to resume: resume=False sets the previous fit's
        # records aside, and refuses a run_dir taken by the last fit
        logging=LoggingConfig(progress=False),
        seed=0,
    )
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=1e-3), data, config)

    # perf_counter at the end of every optimizer step of the loop being timed
    stamps: list[float] = []
    for opt in (hand_opt, trainer.optimizer):
        opt.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))

    def timed(fn) -> tuple[float, float]:
        """(median step, epoch time / steps) of one epoch of ``fn``."""
        stamps.clear()
        ddpkit.barrier()
        start = time.perf_counter()
        fn()
        ddpkit.barrier()
        epoch = (time.perf_counter() - start) / steps
        return statistics.median(b - a for a, b in zip(stamps, stamps[1:])), epoch

    def trainer_epoch() -> None:
        trainer.epoch = trainer.cursor = 0  # the same single epoch again
        trainer.stopped_by = None  # as a new Trainer has it: fit() ends with the reason it stopped
        trainer.fit()

    timed(lambda: hand_loop(hand_model, hand_opt, loader, sampler, 0))  # warm-up, excluded
    timed(trainer_epoch)
    hand, mine = [], []
    for r in range(rounds):
        order = (
            [("hand", hand), ("trainer", mine)]
            if r % 2 == 0
            else [("trainer", mine), ("hand", hand)]
        )
        for name, out in order:
            if name == "hand":
                out.append(
                    timed(lambda r=r: hand_loop(hand_model, hand_opt, loader, sampler, r + 1))
                )
            else:
                out.append(timed(trainer_epoch))
    stalls = []
    for _ in range(5):
        ddpkit.barrier()
        start = time.perf_counter()
        trainer.step += 1  # a new snapshot name each time
        trainer.save()
        ddpkit.barrier()  # the others wait for rank 0 at the next collective; measure that wait
        stalls.append(time.perf_counter() - start)
    return {
        "hand": hand,
        "trainer": mine,
        "stall": stalls,
        "pinned": pinned,
        "threads": threads,
        "steady_malloc": steady,
        "params": sum(p.numel() for p in net.parameters()),
    }


def median_interval(xs: list[float]) -> tuple[float, float]:
    """A distribution-free 95% confidence interval for the median of sorted ``xs`` (normal
    approximation to the binomial: the median lies between these order statistics with probability
    ~0.95)."""
    n = len(xs)
    half = 1.96 * math.sqrt(n) / 2
    return xs[max(0, math.floor(n / 2 - half))], xs[min(n - 1, math.ceil(n / 2 + half) - 1)]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="steps per timed epoch")
    p.add_argument("--rounds", type=int, default=120)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument(
        "--default-malloc", action="store_true", help="leave glibc malloc's thresholds adaptive"
    )
    p.add_argument(
        "--model",
        choices=sorted(MODELS),
        default="cnn",
        help="cnn: the DDP tutorials' CNN; tiny: one linear layer (~1-2 ms steps)",
    )
    a = p.parse_args()
    import torch._dynamo  # noqa: F401  (DDP's constructor imports it: once here rather than in every rank)

    res = ddpkit.spawn(
        functools.partial(bench, a.steps, a.rounds, a.batch_size, a.default_malloc, a.model),
        a.nproc,
    )[0]
    print(
        f"date {datetime.date.today()}  machine {platform.machine()} {platform.processor() or ''}, "
        f"{ddpkit.platforms._cpus.cpu_count()} cores  python {platform.python_version()}  torch "
        f"{torch.__version__}"
    )
    print(
        f"config: {a.nproc} ranks (gloo, CPU, {res['threads']} thread(s) each, "
        f"{'each pinned to its core' if res['pinned'] else 'not pinned'}, "
        f"{'fixed' if res['steady_malloc'] else 'adaptive'} malloc thresholds), "
        f"{MODEL_NAMES[a.model]} ({res['params']} parameters), batch {a.batch_size}/rank, "
        f"{a.steps} steps x {a.rounds} interleaved rounds, warm-up excluded"
    )
    for i, what in enumerate(("step", "epoch")):
        hand = [h[i] * 1000 for h in res["hand"]]
        mine = [t[i] * 1000 for t in res["trainer"]]
        pairs = sorted(t / h for t, h in zip(mine, hand))
        lo, hi = median_interval(pairs)
        diffs = sorted((t - h) * 1000 for t, h in zip(mine, hand))  # us
        dlo, dhi = median_interval(diffs)
        print(f"{what} time ({'median step per round' if i == 0 else 'epoch / steps'}):")
        print(
            f"  hand-written DDP loop {statistics.median(hand):7.3f} ms/step   ddpkit Trainer "
            f"{statistics.median(mine):7.3f} ms/step   (medians over rounds)"
        )
        print(
            f"  ratio trainer / hand  {statistics.median(pairs):.3f}, 95% interval "
            f"{lo:.3f}-{hi:.3f} (median of per-round pairs; all pairs "
            f"{pairs[0]:.3f}-{pairs[-1]:.3f})"
        )
        print(
            f"  Trainer's extra time  {statistics.median(diffs):+.0f} us/step, 95% interval "
            f"{dlo:+.0f} to {dhi:+.0f} us (median of per-round differences)"
        )
    print(
        f"snapshot stall: median {statistics.median(res['stall']) * 1000:.1f} ms "
        f"(gather RNG states + rank 0 writes {res['params'] * 4 / 1e6:.2f} MB "
        "of weights with optimizer state, fsync, rename, manifest)"
    )


if __name__ == "__main__":
    main()
