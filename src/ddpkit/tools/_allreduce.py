"""The backend's all-reduce on its own: time against message size, an alpha-beta fit, and bus
bandwidth.

Bandwidths are reported as nccl-tests define them (its doc/PERFORMANCE.md): for a message of ``S``
bytes that takes ``t`` seconds, the algorithm bandwidth is ``algbw = S / t``, and the bus bandwidth
is ``busbw = algbw * 2 (n - 1) / n`` at ``n`` ranks. A ring all-reduce sends every byte
``2 (n - 1) / n`` times over each link, so busbw is the speed of the links themselves, comparable
across rank counts and with the hardware's peak.

The fit is the alpha-beta (Hockney) model ``t(S) = alpha + S / beta``: alpha the fixed cost of one
all-reduce (latency, launch), beta its asymptotic algorithm bandwidth.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ddpkit.distributed._collectives import all_reduce, barrier, comm_device

DEFAULT_SIZES = tuple(4**k for k in range(1, 13))  # 4 B .. 16 MiB


@dataclass(frozen=True)
class AllReduceFit:
    """``t(S) = alpha + S / beta`` at ``world_size`` ranks, fitted to measured points."""

    world_size: int
    alpha_s: float
    """Fixed cost of one all-reduce, seconds."""
    beta_bytes_per_s: float
    """Asymptotic algorithm bandwidth (bytes / second)."""
    points: tuple[tuple[int, float], ...]
    """(bytes, seconds per all-reduce), the medians measured."""

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_bytes_per_s

    def measured_seconds(self, nbytes: float) -> float:
        """The measured time at ``nbytes``, between the two nearest sizes measured (linear in
        log-log); the fit outside them. On a CPU with more ranks than cores, one all-reduce costs
        about the same from 64 B to 1 MiB, waiting for the scheduler to run each rank in turn; the
        fit's straight line, pulled by the 16 MiB points, puts a 64 KiB message at a quarter of its
        measured time there."""
        points = sorted(self.points)
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            if b0 <= nbytes <= b1:
                if nbytes in (b0, b1):
                    return t0 if nbytes == b0 else t1
                w = math.log(nbytes / b0) / math.log(b1 / b0)
                return math.exp((1 - w) * math.log(t0) + w * math.log(t1))
        return self.seconds(nbytes)

    @property
    def bus_bandwidth(self) -> float:
        """Asymptotic bus bandwidth (bytes / second), nccl-tests' busbw."""
        n = self.world_size
        return self.beta_bytes_per_s * 2 * (n - 1) / n

    @property
    def hop_latency_s(self) -> float:
        """alpha spread over the ``2 (n - 1)`` steps of a ring: the latency of one step."""
        return self.alpha_s / (2 * (self.world_size - 1))

    def to_json(self) -> dict:
        d = asdict(self)
        d["bus_bandwidth_bytes_per_s"] = self.bus_bandwidth
        d["points"] = [
            {
                "bytes": b,
                "seconds": t,
                "algbw_bytes_per_s": b / t,
                "busbw_bytes_per_s": b / t * busbw_factor(self.world_size),
            }
            for b, t in self.points
        ]
        return d


def busbw_factor(n: int) -> float:
    return 2 * (n - 1) / n


def fit_alpha_beta(world_size: int, points: list[tuple[int, float]]) -> AllReduceFit:
    """Least squares on the relative error (``sum ((model - t) / t)^2``), so that 4 bytes and 16 MiB
    count alike.

    With weights ``1/t``, the model is linear in ``(alpha, 1/beta)``; solved in closed form.
    """
    rows = torch.tensor([[1.0 / t, b / t] for b, t in points], dtype=torch.float64)
    ones = torch.ones(len(points), 1, dtype=torch.float64)
    sol = torch.linalg.lstsq(rows, ones).solution.flatten()
    alpha, inv_beta = float(sol[0]), float(sol[1])
    # Noise can make one coefficient slightly negative; a physical fit has both >= 0.
    if inv_beta <= 0:
        inv_beta = 1e-30
    if alpha < 0:
        alpha = 0.0
    return AllReduceFit(world_size, alpha, 1.0 / inv_beta, tuple(points))


def measure(
    sizes: tuple[int, ...] = DEFAULT_SIZES, min_seconds: float = 0.02, repeats: int = 5
) -> list[tuple[int, float]]:
    """Seconds per float32 all-reduce of each size in bytes, on every rank of the job (collective).

    Per size: a warm-up, then ``repeats`` timings of back-to-back all-reduces (as nccl-tests times
    them), each long enough to last ``min_seconds``; the slowest rank's time counts, and the fastest
    repeat is kept (work from other programs on the machine only ever adds time).
    """
    device = comm_device()
    out = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        _sync(device)
        # The same iteration count on every rank, else ranks would enter different numbers of
        # collectives.
        t0 = time.perf_counter()
        dist.all_reduce(x)
        _sync(device)
        once = all_reduce(time.perf_counter() - t0, op="max")
        iters = max(3, min(1000, math.ceil(min_seconds / max(once, 1e-7))))
        times = []
        for _ in range(repeats):
            barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            _sync(device)
            times.append(all_reduce((time.perf_counter() - t0) / iters, op="max"))
        # other work only adds time: the least disturbed timing
        out.append((x.numel() * 4, min(times)))
    return out


def measure_in_step(
    buckets: list[int], compute_s: float, steps: int = 60, warmup: int = 10
) -> float:
    """Seconds a step spends in the all-reduces of ``buckets`` (bytes, in the order DDP launches
    them) when each step first computes for ``compute_s`` on every rank, as a DDP step on the CPU
    does: the slowest rank's median (collective: run on every rank).

    Back-to-back all-reduces on CPU processes are timed with the cores otherwise idle, and where a
    rank's threads land then decides much of the time: 0.5 to 1.9 ms for 58 KB at 2 ranks here, by
    placement alone, where the same all-reduce after a stretch of compute takes 0.4 to 0.5 ms every
    time. And with more ranks than cores, a rank that reaches the all-reduce waits there for the
    others' compute, which takes turns on the cores: this measures that wait too."""
    x = torch.randn(128, 128)
    tensors = [torch.ones(max(1, b // 4), dtype=torch.float32) for b in buckets]
    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        while time.perf_counter() - t < compute_s:
            x @ x  # ~50 us a product here: the stretch ends within one of compute_s
        t0 = time.perf_counter()
        for tensor in tensors:
            dist.all_reduce(tensor)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return all_reduce(statistics.median(times), op="max")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
