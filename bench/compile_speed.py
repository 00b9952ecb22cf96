"""Step time with and without ``torch.compile``, as ``TrainerConfig(compile=True)`` runs it: the
DDP-wrapped model compiled (Dynamo's DDP optimizer on), on N ranks (gloo on the CPU, nccl on GPUs).

The language-model example's small GPT (``ddpkit.demo._models.TinyGPT``) on random tokens, AdamW;
one step is forward, backward (the all-reduce overlapping it) and the optimizer step. Eager and
compiled share the model and alternate round by round in the same processes, so other load on the
machine falls on both alike; each round gives the ratio of the two medians (compiled / eager: below
1 is faster), and the median of those paired ratios is the figure. The time of the first compiled
step (compilation) is reported apart.

    python bench/compile_speed.py                         # 2 ranks, the example's defaults
    python bench/compile_speed.py --nproc 1 --width 128 --layers 6
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import ddpkit
from ddpkit.demo._datasets import CHARS
from ddpkit.demo._models import TinyGPT
from ddpkit.strategies._prepare import prepare_model
from ddpkit.training._trainer import compile_for_training


def _steps(model, optimizer, x, y, steps: int, cuda: bool) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def job(a: argparse.Namespace) -> dict:
    rt = ddpkit.init()
    torch.manual_seed(0)
    model = prepare_model(TinyGPT(len(CHARS), a.block_size, a.width, a.layers, a.heads))
    compiled = compile_for_training(model, rt.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(rt.rank)
    x, y = (
        torch.randint(0, len(CHARS), (a.batch, a.block_size), generator=g).to(rt.device)
        for _ in range(2)
    )
    cuda = rt.device.type == "cuda"
    t0 = time.perf_counter()
    _steps(compiled, optimizer, x, y, 1, cuda)
    compile_s = time.perf_counter() - t0
    _steps(model, optimizer, x, y, a.warmup, cuda)
    _steps(compiled, optimizer, x, y, a.warmup, cuda)
    eager, comp = [], []
    for _ in range(a.rounds):
        eager.append(statistics.median(_steps(model, optimizer, x, y, a.steps, cuda)))
        comp.append(statistics.median(_steps(compiled, optimizer, x, y, a.steps, cuda)))
    params = sum(p.numel() for p in model.parameters())
    return {
        "eager": eager,
        "compiled": comp,
        "compile_s": compile_s,
        "params": params,
        "device": str(rt.device),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="steps per round and mode")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    r = ddpkit.spawn(functools.partial(job, a), a.nproc)[0]
    ratios = [c / e for c, e in zip(r["compiled"], r["eager"])]
    print(
        f"# bench/compile_speed.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
        "UTC"
    )
    print(
        f"# {platform.node()} {platform.machine()}, torch {torch.__version__}, {r['device']}, "
        f"{a.nproc} rank(s), {r['threads']} thread(s) per rank; TinyGPT {r['params'] / 1e3:.0f} K "
        f"parameters (width {a.width}, {a.layers} layers, {a.block_size} tokens), batch {a.batch} "
        f"per rank, AdamW; {a.rounds} rounds x {a.steps} steps per mode after {a.warmup} warm-up; "
        "rank 0's medians"
    )
    print(f"first compiled step (compilation): {r['compile_s']:.1f} s")
    print(f"{'round':>5s} {'eager ms':>9s} {'compiled ms':>12s} {'ratio':>6s}")
    for i, (e, c, q) in enumerate(zip(r["eager"], r["compiled"], ratios)):
        print(f"{i:5d} {e * 1e3:9.2f} {c * 1e3:12.2f} {q:6.3f}")
    print(
        f"compiled / eager step time: {statistics.median(ratios):.3f} (median of {len(ratios)} "
        "paired rounds)"
    )


if __name__ == "__main__":
    main()
