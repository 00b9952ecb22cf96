"""What the stall watch's marks cost a step: a tiny model's training step with and without them, in
one process.

The marks are those a step of the Trainer makes (a step begun, data, forward/backward, the
optimizer, user code, one collective entered and left) plus a loader's two, into a mapped page of
``/dev/shm`` as under ``ddpkit run``. A step of a two-layer MLP of width 64 on a batch of 16 (about
0.1-0.3 ms on a CPU: a step far cheaper than any real one, so the ratio is an upper bound). Marked
and unmarked rounds alternate, so other load on the machine falls on both alike; each round gives
the ratio of the two medians, and the median of those paired ratios is the figure. Also: one mark
alone, in nanoseconds.

    python bench/progress_marks.py
    python bench/progress_marks.py --rounds 30 --steps 400
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import tempfile
import time
import timeit

import torch

from ddpkit.distributed import _progress as progress
from ddpkit.distributed._channels import JOB_DIR_ENV, PROGRESS
from ddpkit.distributed._progress import Phase


def marks() -> None:
    progress.begin_step(1)
    progress.mark(Phase.DATA)
    progress.batch_taken()
    progress.mark(Phase.FORWARD_BACKWARD)
    progress.mark(Phase.OPTIMIZER)
    with progress.collective("all_reduce"):
        pass
    progress.mark(Phase.USER)


def steps(model, opt, x, y, n: int, marked: bool) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        if marked:
            marks()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    folder = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.mkdir(os.path.join(folder, PROGRESS))  # a job folder, as ddpkit run's agent makes one
    os.environ[JOB_DIR_ENV], os.environ["RANK"] = folder, "0"
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 64), torch.randn(16, 1)
    steps(model, opt, x, y, 50, True)  # warm-up, and the record's file opened
    ratios, plain_ms = [], []
    for _ in range(args.rounds):
        plain = statistics.median(steps(model, opt, x, y, args.steps, False))
        marked = statistics.median(steps(model, opt, x, y, args.steps, True))
        ratios.append(marked / plain)
        plain_ms.append(plain * 1e3)
    one = min(timeit.repeat(lambda: progress.mark(Phase.DATA), number=100_000, repeat=5)) / 100_000
    # this machine's pace, now
    empty = min(timeit.repeat(lambda: None, number=100_000, repeat=5)) / 100_000
    eight = min(timeit.repeat(marks, number=20_000, repeat=5)) / 20_000
    print(
        f"date {datetime.date.today()}  python {platform.python_version()}  torch "
        f"{torch.__version__}"
    )
    print(f"machine {platform.machine()} {os.cpu_count()} cores (shared, noisy)  one thread")
    print(f"step without marks: median {statistics.median(plain_ms):.3f} ms")
    print(
        f"one mark: {one * 1e9:.0f} ns; a step's eight marks: {eight * 1e9:.0f} ns; an empty call: "
        f"{empty * 1e9:.0f} ns"
    )
    print(
        f"marked / unmarked step time: median of {args.rounds} paired rounds "
        f"{statistics.median(ratios):.4f} (min {min(ratios):.4f}, max {max(ratios):.4f})"
    )
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
