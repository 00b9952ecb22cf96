"""Step time at another world size, from one rank's step and the all-reduce's cost: the ring model
with buckets.

A DDP step at ``n`` ranks is one rank's step (each rank has the per-rank batch: the global batch
grows with ``n``), plus the part of the gradient all-reduce that backward does not hide:

- DDP packs gradients into buckets in reverse parameter order (the first bucket holds up to 1 MiB,
  the others up to ``bucket_cap_mb``) and all-reduces a bucket as soon as all of its gradients
  exist;
- a ring all-reduce of ``S`` bytes at ``n`` ranks takes ``2 (n - 1) alpha_hop + 2 (n - 1)
  / n * S / busbw``: ``2 (n - 1)`` steps, each sending ``S / n`` bytes over every link;
- buckets are all-reduced one after another; bucket ``k`` is ready when backward has produced the
  gradients before it, taken as a share of backward proportional to their bytes; what is still
  running when backward ends is exposed (adds to the step).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

from ddpkit._errors import ConfigError

MIB = 1 << 20
FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES


@dataclass(frozen=True)
class Interconnect:
    """A link for the ring model: the bus bandwidth an all-reduce reaches, and the latency of one
    ring step."""

    name: str
    busbw_bytes_per_s: float
    hop_latency_s: float
    note: str = ""


# Typical all-reduce bus bandwidths as nccl-tests reports them, not peak link rates; change them
# with --bandwidth.
PRESETS = {
    "nvlink": Interconnect(
        "nvlink", 150e9, 3e-6, "NVLink within one node (8 GPUs): ~150 GB/s busbw (V100/A100 era)"
    ),
    "infiniband": Interconnect(
        "infiniband", 23e9, 8e-6, "InfiniBand HDR, one 200 Gb/s NIC per GPU: ~23 GB/s busbw"
    ),
    "ethernet": Interconnect("ethernet", 2.8e9, 40e-6, "25 Gb/s Ethernet, TCP: ~2.8 GB/s busbw"),
}


def bucket_sizes(param_bytes: list[int], bucket_cap_mb: float = 25.0) -> list[int]:
    """DDP's buckets, in the order they fill (reverse parameter order): the first up to 1 MiB, the
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
    if n == 1:
        return 0.0
    return 2 * (n - 1) * link.hop_latency_s + 2 * (n - 1) / n * nbytes / link.busbw_bytes_per_s


def exposed_seconds(
    buckets: list[int],
    backward_s: float,
    allreduce_s: Callable[[float], float],
    overlap: bool = True,
) -> float:
    """Communication that outlasts backward. ``allreduce_s(nbytes)`` is one all-reduce's time.

    Without ``overlap`` (ranks sharing CPU cores with their communication) every all-reduce is
    exposed.
    """
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
    """How much later the slowest of ``n`` ranks finishes a step than a typical rank, from one
    rank's measured step times: ranks wait for each other at every all-reduce, so a step of ``n``
    ranks lasts as long as the slowest rank's. With each rank's delays drawn independently from the
    measured ones, this is the median of the largest of ``n`` draws, less the median step. Zero on a
    machine without jitter."""
    if n == 1 or len(step_samples) < 2:
        return 0.0
    g = random.Random(seed)
    slowest = statistics.median(max(g.choices(step_samples, k=n)) for _ in range(draws))
    return max(0.0, slowest - statistics.median(step_samples))


@dataclass(frozen=True)
class Prediction:
    world_size: int
    nodes: int
    link: str
    step_s: float
    compute_s: float
    """One rank's step without communication, scaled by the share of a core each rank gets."""
    exposed_comm_s: float
    """The all-reduce that backward does not hide, with DDP's fixed cost of finishing a
    reduction."""
    samples_per_s: float
    efficiency: float
    """Throughput over ``n`` times the one-rank throughput."""

    def to_json(self) -> dict:
        return asdict(self)


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
    compute_scale: float = 1.0,
    overlap: bool = True,
    fixed_sync_s: float = 0.0,
) -> Prediction:
    """Step time and efficiency at ``n`` ranks; see the module's docstring for the model."""
    if n < 1:
        raise ConfigError(f"world size {n}: must be >= 1")
    exposed = fixed_sync_s
    if n > 1:
        exposed += exposed_seconds(buckets, backward_s * compute_scale, allreduce_s, overlap)
    compute = one_rank_step_s * compute_scale
    step = compute + exposed
    return Prediction(
        world_size=n,
        nodes=nodes,
        link=link,
        step_s=step,
        compute_s=compute,
        exposed_comm_s=exposed,
        samples_per_s=n * batch_size / step,
        efficiency=(one_rank_step_s + fixed_sync_s) / step,
    )


def link_for(
    n: int, gpus_per_node: int, intra: Interconnect, inter: Interconnect
) -> tuple[Interconnect, int]:
    """The ring's link at ``n`` ranks: within one node ``intra``; across nodes the ring runs through
    both kinds of link and goes at the pace of the slower (lower bandwidth, higher latency)."""
    nodes = -(-n // gpus_per_node)
    if nodes == 1:
        return intra, 1
    ring = Interconnect(
        f"{intra.name}+{inter.name}",
        min(intra.busbw_bytes_per_s, inter.busbw_bytes_per_s),
        max(intra.hop_latency_s, inter.hop_latency_s),
    )
    return ring, nodes
