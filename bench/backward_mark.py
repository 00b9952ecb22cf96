"""What marking the end of a DDP backward costs a step, two ways, under 2-rank DDP over gloo.

The step timings (``ddpkit.tracking._speed``) mark the moment a step's last gradient is ready with
a callback of the autograd engine, queued from a hook inside the backward. Two ways to queue it:

- ``loss node``: a hook registered on the loss's node each step (what the timings do where DDP may
  leave a parameter without a gradient, and outside DDP);
- ``armed``: a hook registered once on one parameter's gradient accumulation, which queues the
  callback only in a backward it was armed for (what the timings do under DDP).

A linear layer 784 -> 10 on a batch of 64 per rank, one thread a rank, ranks pinned to cores where
there are enough. Blocks of steps of each way, and of none, alternate; per block, the thread CPU
time of a step. Reported: the median over blocks of each way's extra over the unmarked block beside
it. Thread CPU rather than wall: the extra is a few tens of microseconds on a step that waits for
the other rank.

    python bench/backward_mark.py
    python bench/backward_mark.py --blocks 120 --steps 300
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import time

import torch
from torch import nn

import ddpkit
from ddpkit._internals.compiler import at_backward_end

WAYS = ("none", "loss node", "armed")


def bench(blocks: int, steps: int) -> dict[str, list[float]]:
    rt = ddpkit.init()
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= rt.world_size:
        os.sched_setaffinity(0, {cores[rt.rank]})
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Linear(784, 10))
    x = torch.randn(64, 784)
    marked: list[float] = []

    def grads_ready() -> None:
        marked.append(time.perf_counter())

    def backward_started(_grad_outputs: object) -> None:
        at_backward_end(grads_ready)

    armed = [False]

    def accumulating(_grad_outputs: object) -> None:
        if armed[0]:
            armed[0] = False
            at_backward_end(grads_ready)

    weight = ddpkit.unwrap(model).weight
    node = torch.autograd.graph.get_gradient_edge(weight).node

    def step(way: str) -> None:
        loss = model(x).square().mean()
        if way == "loss node" and loss.grad_fn is not None:
            loss.grad_fn.register_prehook(backward_started)
        armed[0] = way == "armed"
        loss.backward()

    out: dict[str, list[float]] = {way: [] for way in WAYS}
    for block in range(blocks + 1):  # the first, warm-up, dropped
        for way in WAYS if block % 2 else WAYS[::-1]:
            hook = node.register_prehook(accumulating) if way == "armed" else None
            marked.clear()
            ddpkit.barrier()
            start = time.thread_time()
            for _ in range(steps):
                step(way)
            seconds = (time.thread_time() - start) / steps
            if hook is not None:
                hook.remove()
            assert len(marked) == (0 if way == "none" else steps), (way, len(marked))
            if block:
                out[way].append(seconds * 1e6)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--blocks", type=int, default=80)
    p.add_argument("--steps", type=int, default=300, help="steps per block")
    a = p.parse_args()
    res = ddpkit.spawn(functools.partial(bench, a.blocks, a.steps), 2)[0]
    print(
        f"date {datetime.datetime.now():%Y-%m-%d %H:%M}  machine {platform.machine()}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}  python "
        f"{platform.python_version()}  torch {torch.__version__}"
    )
    print(f"2 ranks (gloo, CPU), Linear 784 -> 10, batch 64/rank, {a.blocks} blocks of {a.steps}")
    print(f"  unmarked: {statistics.median(res['none']):.1f} us of thread CPU a step (median)")
    for way in WAYS[1:]:
        extra = [m - n for m, n in zip(res[way], res["none"])]
        print(f"  {way}: {statistics.median(extra):+.1f} us a step over unmarked (median)")


if __name__ == "__main__":
    main()
