"""How long a snapshot stops training: asynchronous (copy to host memory, write in the background)
against synchronous (write, fsync, checksum, marker), for a ~100 M parameter model with Adam state.

What is timed is what ``Trainer.save()`` does: the strategy's state dict, then
:meth:`ddpkit.snapshot._disk.DiskStore.save`; the stall is the time until it returns
(rank 0's; every rank waits about as long, as the save is collective). Synchronous and asynchronous
saves alternate (sync, async, sync, ...) in one job, each kind into its own folder (keeping the
newest), after one untimed save of each kind (it allocates the host copy that later asynchronous
saves reuse); after an asynchronous save the bench waits for the write to finish before the next
save (its time is reported as "background write"). Target: the asynchronous stall is at most 10% of
the synchronous one (median over repeats).

Ranks: one per GPU over nccl where there are GPUs (the stall then includes copying the state from
the GPU to host memory), else CPU processes over gloo; ``--device cpu`` forces those.

    python bench/snapshot_stall.py                     # 2 ranks, ddp, 101 M parameters, 3 repeats
    python bench/snapshot_stall.py --strategy fsdp --repeats 5
    python bench/snapshot_stall.py --device cpu        # CPU ranks over gloo on a GPU machine
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ddpkit
from ddpkit.demo._models import Block
from ddpkit.snapshot._disk import DiskStore
from ddpkit.strategies import build_strategy, strategy_config


def job(
    strategy_name: str, width: int, blocks: int, repeats: int, folder: str, device: str | None
) -> dict:
    rt = ddpkit.init(device=device)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(width) for _ in range(blocks)])
    options = {"shard_blocks": ["Block"]} if strategy_name == "fsdp" else {}
    strategy = build_strategy(
        strategy_config(strategy_name, options),
        model,
        torch.optim.Adam(model.parameters()),
        runtime=rt,
    )
    del model
    # Adam's state exists
    strategy.model(torch.randn(4, width, device=rt.device)).square().mean().backward()
    strategy.optimizer.step()
    strategy.optimizer.zero_grad(set_to_none=True)
    extra = {"trainer": {"step": 1}, "rng": torch.get_rng_state()}
    times: dict[str, list[float]] = {"sync": [], "async": [], "background": []}
    step = 0
    checkpointers = {
        mode: DiskStore(
            Path(folder) / mode, group=rt.group, keep_last=1, async_write=mode == "async"
        )
        for mode in ("sync", "async")
    }
    for i in range(repeats + 1):
        for mode, ckpt in checkpointers.items():
            step += 1
            t0 = time.perf_counter()
            ckpt.save(step, strategy.state_dict(), extra)
            stall = time.perf_counter() - t0
            ckpt.wait()
            if i:  # the first round warms up (allocations, process-group creation, file system)
                times[mode].append(stall)
                if mode == "async":
                    times["background"].append(ckpt.last_write_seconds or float("nan"))
    return times | {
        "where": [
            f"{rt.backend or 'no process group'}, "
            + (
                torch.cuda.get_device_name(rt.device)
                if rt.device.type == "cuda"
                else "CPU, 1 thread each"
            )
        ]
    }


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
    p.add_argument("--strategy", default="ddp", choices=("ddp", "zero", "fsdp"))
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
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
    with tempfile.TemporaryDirectory(dir=a.dir) as folder:
        ranks = ddpkit.spawn(
            functools.partial(job, a.strategy, a.width, a.blocks, a.repeats, folder, device),
            nproc,
            start_method="spawn",
            threads_per_process=1,
        )
    n_params = a.blocks * (8 * a.width * a.width + 5 * a.width)
    r0 = ranks[0]
    sync, stall, bg = (statistics.median(r0[k]) for k in ("sync", "async", "background"))
    print(
        f"# bench/snapshot_stall.py  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} "
        "UTC"
    )
    print(
        f"# {platform.node()} {platform.machine()}, torch {torch.__version__}, {nproc} rank(s) "
        f"({r0['where'][0]}), strategy {a.strategy}, {n_params / 1e6:.0f} M parameters + Adam "
        f"state ({3 * 4 * n_params / 2**30:.2f} GiB in all), {a.repeats} repeats after 1 warm-up, "
        "rank 0"
    )
    print(
        f"synchronous save          median {sync:7.3f} s   "
        f"{' '.join(f'{t:.3f}' for t in r0['sync'])}"
    )
    print(
        f"asynchronous save (stall) median {stall:7.3f} s   "
        f"{' '.join(f'{t:.3f}' for t in r0['async'])}"
    )
    print(
        f"  its background write    median {bg:7.3f} s   "
        f"{' '.join(f'{t:.3f}' for t in r0['background'])}"
    )
    print(f"stall / synchronous save: {stall / sync:.3f} (target <= 0.10)")


if __name__ == "__main__":
    main()
