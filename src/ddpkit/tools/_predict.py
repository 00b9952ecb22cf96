"""``ddpkit bench``'s models: the all-reduce's alpha-beta fit, the ring model with DDP's buckets,
and the predictions made from what the bench measured (docs/bench-and-check.md)."""

from __future__ import annotations

import functools
import math
import operator
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import torch

MS = 1e3
MIB = 1 << 20
FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES
BUCKET_CAP_MB = 25.0  # DDP's default bucket_cap_mb


def busbw_factor(n: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth at ``n`` ranks."""
    return 2 * (n - 1) / n


@dataclass(frozen=True)
class AllReduceFit:
    """``t(S) = alpha + S / beta`` at ``world_size`` ranks, fitted to measured points."""

    world_size: int
    alpha_s: float
    beta_bytes_per_s: float
    points: tuple[tuple[int, float], ...]
    """(bytes, seconds per all-reduce), the medians measured."""

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_bytes_per_s

    def measured_seconds(self, nbytes: float) -> float:
        """The measured time at ``nbytes``, between the two nearest sizes measured (linear in
        log-log); the fit outside them."""
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
        return self.beta_bytes_per_s * busbw_factor(self.world_size)

    @property
    def hop_latency_s(self) -> float:
        """alpha spread over the ``2 (n - 1)`` steps of a ring."""
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


def fit_alpha_beta(world_size: int, points: list[tuple[int, float]]) -> AllReduceFit:
    """Least squares on the relative error, so that 4 bytes and 16 MiB count alike: with weights
    ``1/t`` the model is linear in ``(alpha, 1/beta)``."""
    rows = torch.tensor([[1.0 / t, b / t] for b, t in points], dtype=torch.float64)
    ones = torch.ones(len(points), 1, dtype=torch.float64)
    sol = torch.linalg.lstsq(rows, ones).solution.flatten()
    # noise can make a coefficient slightly negative; a physical fit has both >= 0
    alpha, inv_beta = max(float(sol[0]), 0.0), float(sol[1])
    return AllReduceFit(world_size, alpha, 1.0 / max(inv_beta, 1e-30), tuple(points))


@dataclass(frozen=True)
class Interconnect:
    """A link: the bus bandwidth an all-reduce reaches, and the latency of one ring step."""

    name: str
    busbw_bytes_per_s: float
    hop_latency_s: float
    note: str = ""


# Typical all-reduce bus bandwidths as nccl-tests reports them, not peak link rates.
PRESETS = {
    "nvlink": Interconnect(
        "nvlink", 150e9, 3e-6, "NVLink within one node (8 GPUs): ~150 GB/s busbw (V100/A100 era)"
    ),
    "infiniband": Interconnect(
        "infiniband", 23e9, 8e-6, "InfiniBand HDR, one 200 Gb/s NIC per GPU: ~23 GB/s busbw"
    ),
    "ethernet": Interconnect("ethernet", 2.8e9, 40e-6, "25 Gb/s Ethernet, TCP: ~2.8 GB/s busbw"),
}


def bucket_sizes(param_bytes: list[int], bucket_cap_mb: float = BUCKET_CAP_MB) -> list[int]:
    """DDP's buckets in the order they fill (reverse parameter order): the first up to 1 MiB, the
    others up to ``bucket_cap_mb``; a parameter larger than the cap gets a bucket of its own."""
    caps = [FIRST_BUCKET_BYTES, int(bucket_cap_mb * MIB)]
    buckets: list[int] = []
    current = 0
    for nbytes in reversed(param_bytes):
        cap = caps[0] if not buckets else caps[1]
        if current and current + nbytes > cap:
            buckets.append(current)
            current = 0
        current += nbytes
    if current:
        buckets.append(current)
    return buckets


def ring_seconds(nbytes: float, n: int, link: Interconnect) -> float:
    return 2 * (n - 1) * link.hop_latency_s + 2 * (n - 1) / n * nbytes / link.busbw_bytes_per_s


def exposed_seconds(
    buckets: list[int],
    backward_s: float,
    allreduce_s: Callable[[float], float],
    overlap: bool = True,
) -> float:
    """Communication that outlasts backward: each bucket all-reduced once backward has produced it
    (backward uniform over gradient bytes) and the previous one is done. Without ``overlap`` every
    all-reduce is exposed."""
    if not overlap:
        return sum(allreduce_s(b) for b in buckets)
    total = sum(buckets)
    ready, done = 0.0, 0.0
    for b in buckets:
        ready += b
        start = max(done, backward_s * ready / total)
        done = start + allreduce_s(b)
    return max(0.0, done - backward_s)


def straggler_seconds(step_samples: list[float], n: int, draws: int = 2000, seed: int = 0) -> float:
    """How much later the slowest of ``n`` ranks ends a step than a typical rank: the median of the
    largest of ``n`` independent draws from one rank's step times, less the median step."""
    if n == 1 or len(step_samples) < 2:
        return 0.0
    g = random.Random(seed)
    slowest = statistics.median(max(g.choices(step_samples, k=n)) for _ in range(draws))
    return max(0.0, slowest - statistics.median(step_samples))


def predict(
    *,
    n: int,
    one_rank_step_s: float,
    backward_s: float,
    batch_size: int,
    buckets: list[int],
    allreduce_s: Callable[[float], float],
    link: str,
    nodes: int = 1,
    overlap: bool = True,
    fixed_sync_s: float = 0.0,
) -> dict[str, Any]:
    """Step time and efficiency at ``n`` ranks: one rank's step plus the exposed all-reduce (what
    backward does not hide, with DDP's fixed cost of finishing a reduction); efficiency is the
    throughput over ``n`` times the one-rank throughput."""
    # at one rank every all-reduce takes no time (the ring's), and nothing is exposed
    exposed = fixed_sync_s + exposed_seconds(buckets, backward_s, allreduce_s, overlap)
    step = one_rank_step_s + exposed
    return {
        "world_size": n,
        "nodes": nodes,
        "link": link,
        "step_s": step,
        "compute_s": one_rank_step_s,
        "exposed_comm_s": exposed,
        "samples_per_s": n * batch_size / step,
        "efficiency": (one_rank_step_s + fixed_sync_s) / step,
    }


def link_for(
    n: int, gpus_per_node: int, intra: Interconnect, inter: Interconnect
) -> tuple[Interconnect, int]:
    """The ring's link at ``n`` ranks: ``intra`` within a node; across nodes the slower of both."""
    nodes = -(-n // gpus_per_node)
    if nodes == 1:
        return intra, 1
    ring = Interconnect(
        f"{intra.name}+{inter.name}",
        min(intra.busbw_bytes_per_s, inter.busbw_bytes_per_s),
        max(intra.hop_latency_s, inter.hop_latency_s),
    )
    return ring, nodes


class Asked(Protocol):
    """What the predictions read of ``ddpkit bench``'s options (its ``BenchConfig``)."""

    predict_sizes: tuple[int, ...]
    gpus_per_node: int
    intra: str
    """``"measured"`` or a name of :data:`PRESETS`: the link within a node."""
    interconnect: str
    """A name of :data:`PRESETS`: the link between nodes."""

    def inter_link(self) -> Interconnect:
        """The link between nodes, with the bandwidth and latency given in its place."""


def compute_seconds(scaling: dict[int, dict[str, Any]]) -> float:
    """One rank's step less the wait at its backward's end (backward less no_sync backward)."""
    one = scaling[1]["parts"]
    return one["step"] - max(0.0, one["backward"] - one.get("backward_no_sync", one["backward"]))


def predictions(
    cfg: Asked,
    scaling: dict[int, dict[str, Any]],
    fits: dict[int, AllReduceFit],
    one_rank_allreduce: dict[int, float],
    in_step: dict[int, float] | None = None,
) -> dict[str, Any]:
    """The step at 2..N ranks here (next to the measured one) and at ``cfg.predict_sizes`` over
    each interconnect. One rank's wait after its backward, less its all-reduce over a group of one,
    is DDP's fixed cost of a reduction, paid at every world size."""
    buckets = bucket_sizes(scaling[1]["param_bytes"])
    compute = compute_seconds(scaling)
    exposed_one = scaling[1]["parts"]["step"] - compute
    fixed = max(0.0, exposed_one - sum(one_rank_allreduce.get(b, 0.0) for b in buckets))
    model = functools.partial(
        predict,
        backward_s=scaling[1]["parts"]["backward"],
        batch_size=scaling[1]["batch_size"],
        buckets=buckets,
        fixed_sync_s=fixed,
    )
    largest = fits[max(fits)]
    measured_link = Interconnect(
        "measured",
        largest.bus_bandwidth,
        largest.hop_latency_s,
        f"this machine's all-reduce at {largest.world_size} ranks",
    )
    intra = measured_link if cfg.intra == "measured" else PRESETS[cfg.intra]
    return {
        "this_machine": _here(scaling, fits, in_step or {}, compute, model, sum(buckets)),
        "larger": _larger(cfg, intra, compute, model, on_cpu=scaling[1]["device"] == "cpu"),
        "intra_link": asdict(intra),
        "buckets_bytes": buckets,
        "chosen": cfg.interconnect,
        "one_rank": {
            "compute_s": compute,
            "exposed_s": exposed_one,
            "fixed_sync_s": fixed,
            "allreduce_s": one_rank_allreduce,
        },
    }


def _here(
    scaling: dict[int, dict[str, Any]],
    fits: dict[int, AllReduceFit],
    in_step: dict[int, float],
    compute: float,
    model: Callable[..., dict[str, Any]],
    total_bytes: int,
) -> list[dict[str, Any]]:
    on_cpu = scaling[1]["device"] == "cpu"
    rows = []
    for n, fit in fits.items():
        # ranks wait for the slowest at every step: this machine's jitter
        straggle = straggler_seconds(scaling[1]["step_samples"], n)
        allreduce_s: Callable[[float], float] = fit.measured_seconds
        if on_cpu and n in in_step:
            # the buckets' all-reduce as a step meets it, shared out by bytes: on the CPU none of
            # it is hidden behind backward
            allreduce_s = functools.partial(operator.mul, in_step[n] / total_bytes)  # s/byte
        p = model(
            n=n,
            one_rank_step_s=compute + straggle,
            allreduce_s=allreduce_s,
            link=f"measured ({n} ranks)",
            overlap=not on_cpu,
        )
        measured = scaling[n]["parts"]["step"]
        p["measured_step_s"] = measured
        p["error"] = p["step_s"] / measured - 1
        p["straggler_s"] = straggle
        p["allreduce_in_step_s"] = in_step.get(n)
        rows.append(p)
    return rows


def _larger(
    cfg: Asked,
    intra: Interconnect,
    compute: float,
    model: Callable[..., dict[str, Any]],
    on_cpu: bool,
) -> dict[str, Any]:
    larger = {}
    links = [(cfg.interconnect, cfg.inter_link())]
    links += [(k, v) for k, v in PRESETS.items() if k != cfg.interconnect]
    for name, inter in links:
        rows = []
        for n in cfg.predict_sizes:
            link, nodes = link_for(n, cfg.gpus_per_node, intra, inter)
            rows.append(
                model(
                    n=n,
                    one_rank_step_s=compute,
                    allreduce_s=functools.partial(ring_seconds, n=n, link=link),
                    link=link.name,
                    nodes=nodes,
                    overlap=not on_cpu or link.name != "measured",
                )
            )
        larger[name] = {"link": asdict(inter), "rows": rows}
    return larger


def assumptions(cfg: Asked, scaling: dict[int, dict[str, Any]], pred: dict[str, Any]) -> list[str]:
    on_cpu = scaling[1]["device"] == "cpu"
    inter = cfg.inter_link()
    buckets = pred["buckets_bytes"]
    intra = pred["intra_link"]
    return [
        "weak scaling: every rank keeps the per-rank batch, so the global batch grows with the "
        "world size",
        "a rank's compute (data, forward, backward, optimizer) is the 1-rank step measured here, "
        "less the wait at the end of its backward; of that wait, all but the all-reduce over a "
        "group of one (measured alone) is DDP's fixed cost of finishing a reduction "
        f"({pred['one_rank']['fixed_sync_s'] * MS:.3f} ms here), added at every world size",
        f"gradients: {sum(buckets) / 1e6:.3f} MB in {len(buckets)} DDP bucket(s) "
        f"(first up to 1 MiB, then bucket_cap_mb={BUCKET_CAP_MB:g}); float32",
        (
            "on this machine (CPU), the buckets' all-reduce as a step meets it: timed after the "
            "1-rank compute on every rank, so that ranks beyond the cores wait there for the "
            "others' compute, as in a step"
            if on_cpu
            else "on this machine, a bucket's all-reduce takes the time measured alone at its "
            "size, back to back"
        )
        + "; at larger world sizes the ring model:",
        "ring all-reduce of S bytes at n ranks: 2(n-1) x hop latency + 2(n-1)/n x S / busbw",
        "overlap: a bucket's all-reduce starts when backward has produced it (backward taken as "
        "uniform over gradient bytes) and the previous bucket is done; only what outlasts backward "
        "adds to the step"
        + (
            "; on this machine (CPU) communication shares the cores with compute, so none of it is "
            "hidden in the predictions for this machine"
            if on_cpu
            else ""
        ),
        f"within a node (up to {cfg.gpus_per_node} ranks): {intra['name']}, busbw "
        f"{intra['busbw_bytes_per_s'] / 1e9:.3g} GB/s, {intra['hop_latency_s'] * 1e6:.3g} us per "
        "ring step" + (f" ({intra['note']})" if intra.get("note") else ""),
        f"between nodes: {inter.name}, busbw {inter.busbw_bytes_per_s / 1e9:.3g} GB/s, "
        f"{inter.hop_latency_s * 1e6:.3g} us per ring step ({inter.note}); across nodes the ring "
        "runs at the slower of the two links",
        "stragglers: ranks wait for the slowest at every all-reduce; on this machine, the slowest "
        "of n draws from the 1-rank run's step times (independent delays per rank); not carried to "
        "larger world sizes, whose machines have their own jitter",
        "not modelled: hierarchical/tree all-reduce, data loading that does not keep up, "
        "compression hooks",
    ]
