"""Memory per rank of parameters, gradients and optimizer state under ddp, zero and fsdp; step time
vs ddp.

A stack of residual MLP blocks (``--blocks`` x 2 x ``--width`` x 4 ``--width``: ~59 M parameters by
default), Adam, fp32, on ``--nproc`` ranks: one per GPU over nccl where there are GPUs, else CPU
processes over gloo (``--device cpu`` forces those). Every strategy runs in the same invocation, in
interleaved rounds (ddp, zero, fsdp, ddp, ...), each in a fresh job, so noise from other work on the
machine falls on all.

Two memory measures, per rank:
- state: the bytes of parameters, gradients and optimizer state this rank holds, counted from the
  tensors (each storage once) right after backward (gradients alive) and after the step (optimizer
  state alive). Target: zero keeps ~1/N of the optimizer state, fsdp ~1/N of parameters, gradients
  and optimizer state.
- peak RSS: the process's peak resident set over the measured steps (VmHWM, reset before them), less
  the resident set before the model was built: everything the strategy costs, activations and the
  block fsdp gathers for compute included.
- on a GPU, peak CUDA: ``torch.cuda.max_memory_allocated`` over the measured steps (its peak reset
  before them), less what was allocated before the model was built: the same account in the GPU's
  memory, where the state lives (the resident set then holds only the host's share).

Step time: median over the measured steps of each strategy, as a ratio to ddp's in the same round;
reported: the median ratio over rounds.

    # 2 ranks, 59 M parameters, 2 rounds of 3 steps
    python bench/memory.py
    # a quick look
    python bench/memory.py --width 512 --blocks 4 --rounds 1
    # CPU ranks over gloo on a GPU machine
    python bench/memory.py --device cpu
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import platform
import statistics
import time

import torch
from torch import nn

import ddpkit
from ddpkit.demo._models import Block
from ddpkit.strategies import build_strategy, strategy_config
from ddpkit.strategies._fsdp import _local

STRATEGIES = ("ddp", "zero", "fsdp")


def _status(field: str) -> int:
    """A VmRSS / VmHWM line of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    # Linux: writing 5 to clear_refs resets the peak resident set size (VmHWM) to the current one.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = _local(t)
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _state_bytes(strategy) -> dict[str, int]:
    params = list(strategy.model.parameters())
    optimizer = strategy.optimizer
    local_optimizer = getattr(optimizer, "optim", optimizer)  # ZeRO: this rank's own optimizer
    state = [v for s in local_optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    return {
        "params": _bytes(params),
        "grads": _bytes(p.grad for p in params if p.grad is not None),
        "optimizer": _bytes(state),
    }


def measure(name: str, width: int, blocks: int, batch: int, steps: int) -> dict:
    rt = ddpkit.get_runtime()
    cuda = rt.device.type == "cuda"
    gc.collect()
    base_rss = _status("VmRSS")
    base_cuda = torch.cuda.memory_allocated(rt.device) if cuda else 0
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(width) for _ in range(blocks)])
    options = {"shard_blocks": ["Block"]} if name == "fsdp" else {}
    strategy = build_strategy(
        strategy_config(name, options),
        model,
        torch.optim.Adam(model.parameters(), lr=1e-4),
        runtime=rt,
    )
    del model
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rt.rank)).to(rt.device)
    times, after_backward, after_step = [], {}, {}
    for i in range(steps + 1):  # the first step (optimizer state created) is not timed
        if i == 1:
            gc.collect()
            _reset_peak()
            if cuda:
                torch.cuda.reset_peak_memory_stats(rt.device)
        t0 = time.perf_counter()
        strategy.model(x).square().mean().backward()
        strategy.check_gradients(1.0)
        after_backward = _state_bytes(strategy)
        strategy.optimizer.step()
        after_step = _state_bytes(strategy)
        strategy.optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(rt.device)  # the step's time is the device's, not its launch's
        if i:
            times.append(time.perf_counter() - t0)
    peak = _status("VmHWM") - base_rss
    peak_cuda = torch.cuda.max_memory_allocated(rt.device) - base_cuda if cuda else None
    return {
        "params": after_step["params"],
        "grads": after_backward["grads"],
        "optimizer": after_step["optimizer"],
        "peak_rss": peak,
        "peak_cuda": peak_cuda,
        "step_s": statistics.median(times),
        "device": str(rt.device),
        "backend": rt.backend,
    }


def job(name: str, width: int, blocks: int, batch: int, steps: int, device: str | None) -> dict:
    # One strategy per job: a fresh process, so that its peak resident set is its own (freed heap of
    # an earlier strategy would hide part of the next one's).
    ddpkit.init(device=device)
    return measure(name, width, blocks, batch, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--nproc", type=int, default=None, help="ranks (default: the GPUs, or 2 CPU processes)"
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu"),
        default="auto",
        help="auto: one GPU per rank where there are GPUs; cpu: CPU processes over gloo",
    )
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=7)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    # NVML: CUDA stays uninitialised here
    gpus = torch.cuda.device_count() if a.device == "auto" else 0
    nproc = a.nproc or gpus or 2
    if gpus and nproc > gpus:
        raise SystemExit(
            f"--nproc {nproc}: {gpus} GPU(s) here, one per rank (nccl refuses two ranks on one "
            "GPU); lower --nproc, or pass --device cpu"
        )
    device = "cpu" if a.device == "cpu" else None
    results: list[list[dict]] = [[] for _ in range(nproc)]
    for r in range(a.rounds):
        for name in STRATEGIES:
            ranks = ddpkit.spawn(
                functools.partial(job, name, a.width, a.blocks, a.batch, a.steps, device),
                nproc,
                start_method="spawn",
                threads_per_process=1,
            )
            for rank, row in enumerate(ranks):
                results[rank].append({"round": r, "strategy": name, **row})
    n_params = a.blocks * 2 * (a.width * 4 * a.width) + a.blocks * 5 * a.width
    mib = 2**20
    first = results[0][0]
    cuda = first["peak_cuda"] is not None
    where = (
        f"{first['backend'] or 'no process group'}, {torch.cuda.get_device_name(0)}"
        if cuda
        else f"{first['backend'] or 'no process group'}, CPU, 1 thread each"
    )
    print(f"# bench/memory.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(
        f"# {platform.node()} {platform.machine()}, torch {torch.__version__}, {nproc} rank(s) "
        f"({where}), {n_params / 1e6:.1f} M parameters (fp32, {n_params * 4 / mib:.0f} MiB), Adam, "
        f"batch {a.batch}/rank, {a.rounds} rounds x {a.steps} steps (+1 untimed)"
    )
    print(
        f"{'strategy':9s} {'rank':>4s} {'params MiB':>11s} {'grads MiB':>10s} {'optim MiB':>10s} "
        f"{'sum MiB':>8s} {'vs ddp':>7s} {'peak RSS MiB':>13s}"
        + (f" {'peak CUDA MiB':>14s}" if cuda else "")
        + f" {'step s':>7s} {'step/ddp':>9s}"
    )
    last = {
        (r["strategy"], rank): r
        for rank, rows in enumerate(results)
        for r in rows
        if r["round"] == a.rounds - 1
    }
    for name in STRATEGIES:
        for rank in range(nproc):
            row = last[(name, rank)]
            total = row["params"] + row["grads"] + row["optimizer"]
            ddp = last[("ddp", rank)]
            ddp_total = ddp["params"] + ddp["grads"] + ddp["optimizer"]
            ratios = [
                next(r for r in results[rank] if r["round"] == k and r["strategy"] == name)[
                    "step_s"
                ]
                / next(r for r in results[rank] if r["round"] == k and r["strategy"] == "ddp")[
                    "step_s"
                ]
                for k in range(a.rounds)
            ]
            print(
                f"{name:9s} {rank:4d} {row['params'] / mib:11.1f} {row['grads'] / mib:10.1f} "
                f"{row['optimizer'] / mib:10.1f} {total / mib:8.1f} {total / ddp_total:7.2f} "
                f"{row['peak_rss'] / mib:13.1f}"
                + (f" {row['peak_cuda'] / mib:14.1f}" if cuda else "")
                + f" {row['step_s']:7.3f} {statistics.median(ratios):9.2f}"
            )


if __name__ == "__main__":
    main()
