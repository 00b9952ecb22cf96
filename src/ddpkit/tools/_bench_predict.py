"""``ddpkit bench``'s predictions from what it measured: the step at 2..N ranks here (the predictor
checked against the measured steps), at larger world sizes over an interconnect, and the assumptions
behind them."""

from __future__ import annotations

import functools
from dataclasses import asdict
from typing import Any

from ddpkit.tools import _allreduce as allreduce
from ddpkit.tools import _predict as predict
from ddpkit.tools._bench_config import BenchConfig
from ddpkit.tools._steptime import Knobs

MS = 1e3


def compute_seconds(scaling: dict[int, dict[str, Any]]) -> float:
    """One rank's step without its wait at the end of backward (backward with synchronisation minus
    backward under no_sync): the rank's compute, data loading and optimizer included."""
    one = scaling[1]["parts"]
    return one["step"] - max(0.0, one["backward"] - one.get("backward_no_sync", one["backward"]))


def predictions(
    cfg: BenchConfig,
    scaling: dict[int, dict[str, Any]],
    fits: dict[int, allreduce.AllReduceFit],
    one_rank_allreduce: dict[int, float],
    in_step: dict[int, float] | None = None,
) -> dict[str, Any]:
    one = scaling[1]["parts"]
    on_cpu = scaling[1]["device"] == "cpu"
    buckets = predict.bucket_sizes(scaling[1]["param_bytes"], Knobs().bucket_cap_mb)
    batch = scaling[1]["batch_size"]
    # DDP at one rank still all-reduces (over a group of one); that part is replaced by the n-rank
    # all-reduce. One rank's step splits into compute and what its backward waits for after the last
    # gradient (backward with synchronisation minus backward under no_sync). The wait holds the
    # all-reduce over a group of one (measured alone) and DDP's fixed cost of finishing a reduction
    # (waking the waiting thread, copying the buckets back), which every world size pays; the
    # all-reduce at n ranks replaces the one-rank all-reduce.
    compute = compute_seconds(scaling)
    exposed_one = one["step"] - compute
    fixed = max(0.0, exposed_one - sum(one_rank_allreduce.get(b, 0.0) for b in buckets))
    here = []
    for n, fit in fits.items():
        # This machine's jitter (from the 1-rank rounds): the ranks wait for the slowest at every
        # step.
        straggle = predict.straggler_seconds(scaling[1]["step_samples"], n)
        allreduce_s = fit.measured_seconds  # the sizes measured: the buckets are among them
        if on_cpu and in_step and n in in_step:
            # On the CPU the buckets' all-reduce is taken as a step meets it, after each rank's
            # compute (allreduce.measure_in_step): where ranks outnumber the cores, the wait there
            # for the others' compute is in it, so no rank's compute is scaled besides. Shared out
            # by bytes: on the CPU nothing of it is hidden behind backward, so only the sum counts.
            allreduce_s = functools.partial(_share, total_s=in_step[n], total_bytes=sum(buckets))
        p = predict.predict(
            n=n,
            one_rank_step_s=compute + straggle,
            backward_s=one["backward"],
            batch_size=batch,
            buckets=buckets,
            allreduce_s=allreduce_s,
            link=f"measured ({n} ranks)",
            overlap=not on_cpu,
            fixed_sync_s=fixed,
        )
        measured = scaling[n]["parts"]["step"]
        here.append(
            p.to_json()
            | {
                "measured_step_s": measured,
                "error": p.step_s / measured - 1,
                "straggler_s": straggle,
                "allreduce_in_step_s": in_step.get(n) if in_step else None,
            }
        )
    largest = fits[max(fits)]
    measured_link = predict.Interconnect(
        "measured",
        largest.bus_bandwidth,
        largest.hop_latency_s,
        f"this machine's all-reduce at {largest.world_size} ranks",
    )
    intra = measured_link if cfg.intra == "measured" else predict.PRESETS[cfg.intra]
    larger = {}
    for name, inter in [(cfg.interconnect, cfg.inter_link())] + [
        (k, v) for k, v in predict.PRESETS.items() if k != cfg.interconnect
    ]:
        rows = []
        for n in cfg.predict_sizes:
            link, nodes = predict.link_for(n, cfg.gpus_per_node, intra, inter)
            rows.append(
                predict.predict(
                    n=n,
                    one_rank_step_s=compute,
                    backward_s=one["backward"],
                    batch_size=batch,
                    buckets=buckets,
                    allreduce_s=functools.partial(predict.ring_seconds, n=n, link=link),
                    link=link.name,
                    nodes=nodes,
                    overlap=not on_cpu or link.name != "measured",
                    fixed_sync_s=fixed,
                ).to_json()
            )
        larger[name] = {"link": asdict(inter), "rows": rows}
    return {
        "this_machine": here,
        "larger": larger,
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


def _share(nbytes: float, total_s: float, total_bytes: int) -> float:
    return total_s * nbytes / total_bytes


def assumptions(
    cfg: BenchConfig, scaling: dict[int, dict[str, Any]], pred: dict[str, Any]
) -> list[str]:
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
        f"(first up to 1 MiB, then bucket_cap_mb={Knobs().bucket_cap_mb:g}); float32",
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
