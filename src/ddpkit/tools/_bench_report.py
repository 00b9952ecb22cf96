"""The table ``ddpkit bench`` prints: what was measured, the all-reduce fit, the predictions, the
knobs."""

from __future__ import annotations

from typing import Any

MS = 1e3


def report(result: dict[str, Any]) -> list[str]:
    """The table ``ddpkit bench`` prints, from its result (as written to bench.json)."""
    sc, pred, cond = result["scaling"], result["predictions"], result["conditions"]
    cfg = cond["config"]
    batch = sc[1]["batch_size"]
    lines = [
        f"ddpkit bench: {result['workload']}, batch {batch} per rank; {cond['device']} "
        f"({cond['backend']}), {cond['cores']} cores, 1 thread per rank, torch {cond['torch']}, "
        f"{cond['date']}",
        f"load average at the end {cond['load_average_1_5_15']} (other work on the machine slows "
        "and scatters these numbers); ranks pinned to their own core: "
        + ", ".join(f"{n}: {'yes' if p else 'no'}" for n, p in cond["pinned_ranks"].items()),
        f"{cfg['rounds']} round(s) per world size, {cfg['steps']} timed steps each after "
        f"{cfg['warmup']} warm-up; per round the median step, of the rounds the fastest (the least "
        "disturbed by other work).",
        "exposed all-reduce = backward - backward under no_sync(); all-reduce span = DDP comm "
        "hook, first bucket launched to last bucket done",
        "",
        "Measured on this machine (ms per step)",
        f"{'ranks':>5} {'data':>7} {'forward':>8} {'backward':>9} {'exposed AR':>10} "
        f"{'AR span':>8} {'optimizer':>9} {'step':>8} {'samples/s':>10} {'speed-up':>8} "
        f"{'efficiency':>10}",
    ]
    t1 = sc[1]["parts"]["step"]
    for n, s in sc.items():
        p = s["parts"]
        exposed = max(0.0, p["backward"] - p.get("backward_no_sync", p["backward"]))
        lines.append(
            f"{n:>5} {p['data'] * MS:>7.3f} {p['forward'] * MS:>8.3f} {p['backward'] * MS:>9.3f} "
            f"{exposed * MS:>10.3f} {p['allreduce_span'] * MS:>8.3f} {p['optimizer'] * MS:>9.3f} "
            f"{p['step'] * MS:>8.3f} {n * batch / p['step']:>10.0f} {n * t1 / p['step']:>8.2f} "
            f"{t1 / p['step']:>10.0%}"
        )
    lines += [
        "",
        "All-reduce alone (float32, back-to-back, slowest rank; nccl-tests' busbw = algbw x "
        "2(n-1)/n)",
    ]
    for n, fit in result["allreduce"].items():
        pts = fit["points"]
        big = pts[-1]
        lines.append(
            f"  {n} ranks: alpha {fit['alpha_s'] * 1e6:.1f} us, beta "
            f"{fit['beta_bytes_per_s'] / 1e9:.3f} GB/s (busbw "
            f"{fit['bus_bandwidth_bytes_per_s'] / 1e9:.3f} GB/s); measured "
            + ", ".join(
                f"{_size(p['bytes'])} {p['seconds'] * 1e6:.0f} us"
                for p in pts[:: max(1, len(pts) // 6)]
            )
            + f"; {_size(big['bytes'])}: busbw {big['busbw_bytes_per_s'] / 1e9:.3f} GB/s"
        )
    lines += [
        "",
        "Predicted from the 1-rank run and the all-reduce measured on its own, against measured "
        "(this machine)",
        f"{'ranks':>5} {'predicted ms':>12} {'measured ms':>11} {'error':>7}  "
        f"{'straggler ms':>12}  exposed AR ms",
    ]
    for row in pred["this_machine"]:
        lines.append(
            f"{row['world_size']:>5} {row['step_s'] * MS:>12.3f} "
            f"{row['measured_step_s'] * MS:>11.3f} {row['error']:>+7.1%}  "
            f"{row['straggler_s'] * MS:>12.3f}  {row['exposed_comm_s'] * MS:>13.3f}"
        )
    chosen = pred["larger"][pred["chosen"]]
    lines += [
        "",
        f"Predicted at larger world sizes (within a node: {pred['intra_link']['name']}; between "
        f"nodes: {chosen['link']['name']}; {cfg['gpus_per_node']} ranks per node)",
        f"{'ranks':>5} {'nodes':>5} {'step ms':>8} {'exposed AR ms':>13} {'samples/s':>10} "
        f"{'efficiency':>10}",
    ]
    for row in chosen["rows"]:
        lines.append(
            f"{row['world_size']:>5} {row['nodes']:>5} {row['step_s'] * MS:>8.3f} "
            f"{row['exposed_comm_s'] * MS:>13.3f} {row['samples_per_s']:>10.0f} "
            f"{row['efficiency']:>10.0%}"
        )
    lines += ["assumptions:"] + [f"  - {a}" for a in result["assumptions"]]
    knobs = result.get("knobs")
    if knobs:
        lines += [
            "",
            f"DDP and loader knobs at {knobs['world_size']} ranks (fastest round; the defaults' "
            f"spread between rounds: +-{knobs['noise_s'] * MS:.3f} ms)",
        ]
        base = knobs["rows"][0]["step_s"]
        for row in knobs["rows"]:
            lines.append(
                f"  {row['knobs']:<42} {row['step_s'] * MS:8.3f} ms  "
                f"{row['step_s'] / base - 1:+7.1%}"
            )
        lines.append(
            f"  best: {knobs['best']} ({knobs['best_step_s'] * MS:.3f} ms); "
            + (
                "pin_memory only matters for copies to a GPU: not tried on the CPU"
                if cond["device"] == "cpu"
                else ""
            )
        )
    dp = result["data_parallel"]
    lines += [""]
    if "skipped" in dp:
        lines.append(f"DataParallel / one GPU: skipped: {dp['skipped']}")
    else:
        single = dp["single_gpu"]
        lines.append(
            f"one GPU: {single['step'] * MS:.3f} ms/step, {single['samples'] / single['step']:.0f} "
            "samples/s"
        )
        d = dp["data_parallel"]
        lines.append(
            f"DataParallel over {d['gpus']} GPU(s): {d['step'] * MS:.3f} ms/step, "
            f"{d['samples'] / d['step']:.0f} samples/s"
            + (
                " (one GPU: nothing to split; the cost of its scatter and gather)"
                if d["gpus"] == 1
                else ""
            )
        )
        if d["gpus"] in sc:
            s = sc[d["gpus"]]["parts"]["step"]
            lines.append(
                f"DDP over {d['gpus']} GPUs: {s * MS:.3f} ms/step, {d['gpus'] * batch / s:.0f} "
                "samples/s"
            )
    return lines


def _size(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"
