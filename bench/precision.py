"""Step time by precision: fp32, bf16 (autocast) and fp16 (autocast with a GradScaler), as the
Trainer's ``precision`` runs them, on one GPU (the CPU where there is none).

A stack of residual MLP blocks (``--blocks`` x 2 x ``--width`` x 4 ``--width``: ~268 M parameters on
a GPU by default), Adam, a batch of ``--batch`` rows. One step is forward under autocast, backward
(of the scaled loss under fp16), unscale, optimizer step and zero_grad, ended by a device
synchronisation. Precisions alternate round by round (fp32, tf32, bf16, fp16, fp32, ...) so that
other load falls on all; each round's median step counts, and of the rounds the fastest. ``tf32`` is
fp32 with TensorFloat-32 matrix products allowed (``torch.backends.cuda.matmul.allow_tf32``), which
torch leaves off by default and the Trainer does not change.

    python bench/precision.py                    # one GPU: width 2048, 8 blocks, batch 1024
    python bench/precision.py --width 512 --blocks 2 --batch 128 --device cpu
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from contextlib import nullcontext

import torch
from torch import nn

from ddpkit.demo._models import Block

PRECISIONS = ("fp32", "tf32", "bf16", "fp16")


def step_times(
    precision: str, model: nn.Module, x: torch.Tensor, steps: int, warmup: int
) -> list[float]:
    device = x.device
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext():
            loss = model(x).float().square().mean()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    torch.backends.cuda.matmul.allow_tf32 = False
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--width", type=int, default=None, help="default: 2048 on a GPU, 256 on the CPU")
    p.add_argument("--blocks", type=int, default=None, help="default: 8 on a GPU, 2 on the CPU")
    p.add_argument("--batch", type=int, default=None, help="default: 1024 on a GPU, 64 on the CPU")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    cuda = a.device == "auto" and torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    width, blocks, batch = (
        a.width or (2048 if cuda else 256),
        a.blocks or (8 if cuda else 2),
        a.batch or (1024 if cuda else 64),
    )
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(width) for _ in range(blocks)]).to(device)
    x = torch.randn(batch, width, device=device)
    rounds: dict[str, list[float]] = {name: [] for name in PRECISIONS}
    for _ in range(a.rounds):
        for name in PRECISIONS:
            if name == "tf32" and not cuda:
                continue
            times = step_times(name, model, x, a.steps, a.warmup)
            rounds[name].append(statistics.median(times))
    n_params = sum(q.numel() for q in model.parameters())
    where = (
        torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    )
    print(
        f"# bench/precision.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    )
    print(
        f"# {platform.node()} {platform.machine()}, torch {torch.__version__}, {where}; "
        f"{n_params / 1e6:.0f} M parameters ({blocks} blocks of width {width}), batch {batch}, "
        f"Adam; {a.rounds} rounds x {a.steps} steps after {a.warmup} warm-up; per round the median "
        "step, of the rounds the fastest"
    )
    base = min(rounds["fp32"])
    print(f"{'precision':10s} {'step ms':>9s} {'vs fp32':>8s} {'rounds ms':>24s}")
    for name in PRECISIONS:
        if not rounds[name]:
            continue
        best = min(rounds[name])
        print(
            f"{name:10s} {best * 1e3:9.3f} {best / base:8.2f} "
            f"{' '.join(f'{r * 1e3:.2f}' for r in rounds[name]):>24s}"
        )


if __name__ == "__main__":
    main()
