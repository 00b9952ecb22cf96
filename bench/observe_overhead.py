"""What the step timings cost: the Trainer with ``LoggingConfig(step_timings=True)`` against the
same Trainer with them off, in the same job.

Each rank builds one Trainer and switches its step timings on and off between rounds (what they add:
a hook that queues a callback of the autograd engine in the synchronising backward, under DDP
registered once on one parameter's gradient accumulation and armed each step, two forward pre-hooks
where DDP broadcasts buffers, the loader's ``next()`` timed, a few clock reads per step, and at each
log window 8 more numbers per rank in the loss's all-gather, the ``ranks`` record, rates and MFU);
rounds of one epoch each alternate (on, off, off, on, ...) so that noise from other work on the
machine falls on both. Measures, on rank 0, as bench/trainer_overhead.py: the median step per round
(between consecutive optimizer steps) and epoch time / steps (with the log windows' work in it); and
the process's CPU time over the epoch / steps, which other processes' load on a shared machine moves
far less than wall time, and the CPU time of its main thread (where the timings' work runs, without
gloo's threads). Reported: the median of the per-round ratios on / off, with a distribution-free 95%
interval, and the difference in microseconds a step. Targets: <= 1.005 on the CNN's step, <= 1.02 on
the tiny model's.

    # the digits CNN (ddpkit.demo), 2 ranks, batch 64 per rank
    python bench/observe_overhead.py
    # one linear layer: ~1 ms steps, where a per-step cost shows
    python bench/observe_overhead.py --model tiny
    # 196 parameters in narrow layers, where a per-parameter cost shows
    python bench/observe_overhead.py --model deep
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import statistics
import tempfile
import time

import torch
from torch.utils.data import TensorDataset
from trainer_overhead import MODEL_NAMES, MODELS, median_interval, steady_malloc

import ddpkit
import ddpkit.platforms._cpus
from ddpkit.tracking._speed import Speed
from ddpkit.training._config import LoggingConfig, SnapshotConfig
from ddpkit.training._step import StepObserver
from ddpkit.training._trainer import Trainer, TrainerConfig


def bench(steps: int, rounds: int, batch_size: int, model: str, every: int) -> dict:
    rt = ddpkit.init()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    threads = torch.get_num_threads()
    if len(cores) >= rt.world_size * threads:
        os.sched_setaffinity(0, set(cores[rt.rank * threads : (rt.rank + 1) * threads]))
    steady = steady_malloc()
    g = torch.Generator().manual_seed(0)
    n = steps * batch_size * rt.world_size
    data = TensorDataset(
        torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    )
    stamps: list[float] = []

    torch.manual_seed(0)
    net = MODELS[model]()
    run_dir = tempfile.mkdtemp(prefix="ddpkit-bench-") if rt.is_main else ""
    config = TrainerConfig(
        run_dir=ddpkit.broadcast_object(run_dir),
        batch_size=batch_size,
        num_workers=0,
        snapshot=SnapshotConfig(every_epochs=0),
        # each fit() goes on in the same folder (no snapshots: it trains the epoch again)
        resume=True,
        logging=LoggingConfig(progress=False, every_steps=every, step_timings=True),
    )
    # One Trainer, its timings switched on and off between rounds: two instances of the same model
    # differ by a few percent in step time by where their tensors landed, which would hide a 1%
    # effect (as in bench/loader_overhead.py).
    t = Trainer(net, torch.optim.SGD(net.parameters(), lr=1e-3), data, config)
    t.optimizer.register_step_post_hook(lambda *_: stamps.append(time.perf_counter()))

    def timings(enabled: bool) -> None:
        """The Trainer with its step timings on or off, as ``LoggingConfig(step_timings=...)``
        builds them: a fresh ``Speed`` (an enabled one registers its hooks; the one it replaces
        removes its own)."""
        t.speed.close()
        speed = Speed(
            t.model, rt.device, enabled=enabled, precision=config.precision,
            world_size=rt.world_size,
        )  # fmt: skip
        t.train_step.observe = StepObserver(speed, t.train_step.window)

    def timed(enabled: bool) -> tuple[float, float, float, float]:
        timings(enabled)
        stamps.clear()
        t.epoch = t.cursor = 0  # the same single epoch again
        t.stopped_by = None
        ddpkit.barrier()
        start, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
        t.fit()
        thread = (time.thread_time() - thread) / steps
        cpu = (time.process_time() - cpu) / steps
        ddpkit.barrier()
        epoch = (time.perf_counter() - start) / steps
        step = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
        return step, epoch, cpu, thread

    timed(True), timed(False)  # warm-up, excluded
    results: dict[str, list[tuple[float, float, float, float]]] = {"on": [], "off": []}
    for r in range(rounds):
        order = [("on", True), ("off", False)] if r % 2 == 0 else [("off", False), ("on", True)]
        for name, enabled in order:
            results[name].append(timed(enabled))
    return results | {
        "threads": threads,
        "steady": steady,
        "params": sum(p.numel() for p in t.model.parameters()),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="steps per timed epoch")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--every", type=int, default=20, help="LoggingConfig.every_steps")
    p.add_argument("--model", choices=sorted(MODELS), default="cnn")
    a = p.parse_args()
    import torch._dynamo  # noqa: F401  (DDP's constructor imports it: once here rather than in every rank)

    run = functools.partial(bench, a.steps, a.rounds, a.batch_size, a.model, a.every)
    res = ddpkit.spawn(run, a.nproc)[0]
    print(
        f"date {datetime.date.today()}  machine {platform.machine()}, "
        f"{ddpkit.platforms._cpus.cpu_count()} cores  python {platform.python_version()}  torch "
        f"{torch.__version__}"
    )
    print(
        f"config: {a.nproc} ranks (gloo, CPU, {res['threads']} thread(s) each), "
        f"{MODEL_NAMES[a.model]} ({res['params']} parameters), batch {a.batch_size}/rank, "
        f"{a.steps} steps x {a.rounds} interleaved rounds, a log window every {a.every} steps, "
        f"{'fixed' if res['steady'] else 'adaptive'} malloc thresholds, warm-up excluded"
    )
    measures = (
        "step (median step per round)",
        "epoch / steps",
        "rank 0's CPU time (all its threads) / steps",
        "rank 0's main thread's CPU time / steps",
    )
    for i, what in enumerate(measures):
        on = [x[i] * 1000 for x in res["on"]]
        off = [x[i] * 1000 for x in res["off"]]
        ratios = sorted(x / y for x, y in zip(on, off))
        lo, hi = median_interval(ratios)
        diffs = sorted((x - y) * 1000 for x, y in zip(on, off))
        dlo, dhi = median_interval(diffs)
        print(
            f"{what}: timings on {statistics.median(on):.3f} ms, off {statistics.median(off):.3f} "
            "ms"
        )
        print(
            f"  ratio on / off {statistics.median(ratios):.4f}, 95% interval {lo:.4f}-{hi:.4f}; "
            f"extra {statistics.median(diffs):+.0f} us/step, 95% interval {dlo:+.0f} to {dhi:+.0f} "
            "us"
        )


if __name__ == "__main__":
    main()
