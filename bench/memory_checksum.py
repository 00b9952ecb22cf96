"""What the memory snapshot's tensor checksum costs against the copy it checks.

A save into a memory slot copies the state into the slot's data region, then takes its checksum
(:mod:`ddpkit.snapshot._slots`); both hold the training loop. This times, on one state
(``--mb`` MB of float32 tensors, 8 of them, as a model and its Adam moments would be), in
interleaved rounds whose order rotates so that noise from other work on the machine falls on all:

- copy: the state into the region, as a save does it (``copy_tensors``, one fused call), on torch's
  threads as torchrun's workers have them (``OMP_NUM_THREADS=1``; ``--torch-threads``);
- block sums: the checksum of slot format 2, the CRC-32 of the wrapping int64 sums of 4 KiB blocks
  (numpy), kept here as the reference: it let changes that cancel within a block through;
- CRC-32C: the checksum of format 3, a CRC-32C per MiB
  (:func:`ddpkit.snapshot._slots.block_crcs`, the ``crc32c`` package: SSE 4.2 / ARMv8 CRC
  instructions where the CPU has them), on one thread, as a save takes it;
- CRC-32C on 2 threads: the same blocks split in two halves (the CRC releases the GIL), to show the
  pieces run in parallel; not what a save does (the loop's other threads, data loading, want the
  cores).

Reported: per round each time over the copy's in the same round (and CRC-32C over the block sums),
the median over rounds, with the rounds' interquartile range; the first round (pages faulted in) is
left out. The target: the CRC-32C costs at most what the block sums did.

    python bench/memory_checksum.py                 # 100 MB, 31 rounds
    python bench/memory_checksum.py --mb 400 --rounds 15

Measured on the shared 2-core machine (AMD EPYC with SSE 4.2; Python 3.11.7, torch 2.13.0 CPU, numpy
2.4.6, crc32c 2.9.post0, hardware CRC), 2026-11-25, other work running (load average 8-9),
``python bench/memory_checksum.py --rounds 41``:

| measure | median, ms | / copy, median (IQR) | / block sums, median (IQR) |
|---|---|---|---|
| copy | 31.0 | 1.00 | 1.29 (1.14-1.74) |
| block sums (format 2) | 23.0 | 0.78 (0.57-0.88) | 1.00 |
| CRC-32C (format 3) | 17.3 | 0.61 (0.53-0.65) | 0.80 (0.69-0.95) |
| CRC-32C, 2 threads | 21.9 | 0.69 (0.58-0.80) | 0.95 (0.79-1.24) |

Two more runs of the default 31 rounds gave CRC-32C / block sums 0.86 (0.69-1.05) and 0.86
(0.64-1.10); ``--mb 10 --rounds 21`` 0.95 (0.87-1.38), ``--mb 400 --rounds 21`` 1.01 (0.91-1.11). So
the check costs no more than the block sums did, about 0.6 of the copy. Two threads do not help on 2
busy cores.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ddpkit.snapshot._slots import BLOCK, block_crcs, copy_tensors


def block_sums(region: torch.Tensor) -> int:
    """Slot format 2's checksum: the CRC-32 of the wrapping int64 sums of the region's 4 KiB
    blocks."""
    words = region.numpy().view(np.int64)
    full = (words.size * 8 // 4096) * 512
    sums = words[:full].reshape(-1, 512).sum(1, dtype=np.int64)
    tail = words[full:].sum(dtype=np.int64, keepdims=True)
    return zlib.crc32(tail, zlib.crc32(sums))


def threaded_crcs(pool: ThreadPoolExecutor, region: torch.Tensor) -> bytes:
    """:func:`block_crcs` of the region's two halves (cut at a block boundary) on two threads,
    joined."""
    half = (region.numel() // 2 // BLOCK) * BLOCK
    first, second = pool.map(block_crcs, (region[:half], region[half:]))
    return first + second


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4)
    return q1, q2, q3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=100, help="the state's size in MB (10**6 bytes)")
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="torch's threads for the copy (torchrun's workers: 1)",
    )
    args = parser.parse_args()
    import crc32c

    torch.set_num_threads(args.torch_threads)

    n = args.mb * 10**6 // 4 // 8 * 8
    sources = list(torch.randn(n).chunk(8))
    region = torch.empty(n * 4, dtype=torch.uint8)
    dests, at = [], 0
    for s in sources:
        dests.append(region[at : at + s.numel() * 4].view(torch.float32))
        at += s.numel() * 4
    pool = ThreadPoolExecutor(2)
    copy_tensors(dests, sources)
    assert threaded_crcs(pool, region) == block_crcs(region)  # the pieces are the whole's table

    timed: dict[str, Callable[[], object]] = {
        "copy": lambda: copy_tensors(dests, sources),
        "block sums": lambda: block_sums(region),
        "CRC-32C": lambda: block_crcs(region),
        "CRC-32C, 2 threads": lambda: threaded_crcs(pool, region),
    }
    names = list(timed)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds + 1):
        order = names[r % len(names) :] + names[: r % len(names)]
        got = {}
        for name in order:
            start = time.perf_counter()
            timed[name]()
            got[name] = time.perf_counter() - start
        if r:  # the first round faults the pages in
            for name in names:
                times[name].append(got[name])
    pool.shutdown()

    print(
        f"date {datetime.date.today()}  machine {platform.machine()} {platform.processor() or ''}  "
        f"python {platform.python_version()}  torch {torch.__version__}  numpy {np.__version__}  "
        f"crc32c {crc32c.__version__} (hardware: {crc32c.hardware_based})  torch threads "
        f"{torch.get_num_threads()}  state {n * 4 / 1e6:.0f} MB in 8 tensors  rounds {args.rounds}"
    )
    print("| measure | median, ms | / copy, median (IQR) | / block sums, median (IQR) |")
    print("|---|---|---|---|")
    for name in names:
        over_copy = [a / b for a, b in zip(times[name], times["copy"])]
        over_sums = [a / b for a, b in zip(times[name], times["block sums"])]
        q1, q2, q3 = quartiles(over_copy)
        s1, s2, s3 = quartiles(over_sums)
        print(
            f"| {name} | {statistics.median(times[name]) * 1e3:.1f} | {q2:.2f} ({q1:.2f}-{q3:.2f}) "
            f"| {s2:.2f} ({s1:.2f}-{s3:.2f}) |"
        )


if __name__ == "__main__":
    main()
