"""What ddpkit's control plane costs as the world grows: one job per world size and model, CPU
processes over gloo with tiny compute, every rank timed; each cost fitted as a * n^b.

The job (``tests/jobs/scripts/scale_job.py``) runs under ``ddpkit run --max-restarts 1`` with
snapshots in memory, and times on every rank: the launch (kernel start, script, imports, process
group, Trainer built, first step), a copy in memory, a restart after a SIGKILL of the last rank
(detected, torn down, rendezvous, spawned, ... first step: ``bench/goodput.py``'s stages), a disk
snapshot saved synchronously (values gathered, planned, written, indexed, marked) and asynchronously
(the stall), found and loaded (found and verified, planned, read), an exact evaluation, and
``split_world(2)`` (a search's groups of 2). ``--variants whole,in-place`` runs each job again under
``--recover in-place``: the recovery's phases (detect, leave, decide, regroup, restore; the
``recover`` record of ``metrics.jsonl``) and its kill to first step, beside the whole restart's.

The machine has fewer cores than the larger worlds have ranks. A stage's wall clock then counts the
waits for a core: with every rank busy, n ranks on c cores take n/c times one rank's work, an
exponent of 1 where each rank's work is the same at every size. A rank's CPU time (every thread of
its process) is the work it would do on a core of its own, and what is fitted: the largest over the
ranks (often rank 0, which plans and writes the index), with rank 0's and the other ranks' median
beside it. Neither sees the network: gloo over loopback, not nccl over InfiniBand (see
docs/scale.md).

    python bench/scale.py                              # 2..64 ranks x 10, 1,000, 10,000 tensors
    python bench/scale.py --quick                      # 2 and 4 ranks, 10 and 1,000 tensors
    python bench/scale.py --sizes 2,4,8 --tensors 1000 --dir /tmp/scale
    python bench/scale.py --report --dir /tmp/scale    # the tables again, from the runs in --dir
    python bench/scale.py --sizes 2,8,32 --tensors 10 --repeats 2 --variants whole,in-place
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "scripts" / "scale_job.py"

_spec = importlib.util.spec_from_file_location("goodput", Path(__file__).with_name("goodput.py"))
goodput = importlib.util.module_from_spec(_spec)
# the launcher's instrumentation and the recovery's stages, shared
_spec.loader.exec_module(goodput)

LAUNCH_STAGES = ["rendezvous", "proc_start", "script", "imports", "init", "built", "first_step"]
# the agent's, not each rank's
AGENT_STAGES = {"rendezvous", "proc_start", "detected", "torn_down", "spawned", "detect", "decide"}
IN_PLACE = "-in-place"  # the folder of a job run with --recover in-place
# Two-sided 95% quantiles of Student's t by degrees of freedom (a fit of k sizes has k - 2).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}


# -- one job ---------------------------------------------------------------------------------------


def run(n: int, tensors: int, a: argparse.Namespace, root: Path, in_place: bool = False) -> dict:
    folder = root / f"n{n}-t{tensors}{IN_PLACE if in_place else ''}"
    folder.mkdir(parents=True, exist_ok=True)
    timeline = folder / "timeline.jsonl"
    timeline.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "DDPKIT_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(Path(goodput.__file__)), "launch", str(timeline), "ddpkit"]
    cmd += [
        "--nproc",
        str(n),
        "--oversubscribe",
        "--max-restarts",
        "1",
        "--log-dir",
        str(folder / "logs"),
    ]
    cmd += ["--recover", "in-place"] if in_place else []
    cmd += [str(JOB), str(folder / "run"), "--timeline", str(timeline), "--tensors", str(tensors)]
    cmd += ["--steps", str(a.steps), "--repeats", str(a.repeats)]
    t0 = time.time()
    with open(folder / "output.txt", "w") as output:
        try:
            code = subprocess.run(
                cmd, env=env, cwd=folder, stdout=output, stderr=subprocess.STDOUT, timeout=a.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = f"timed out after {a.timeout} s"
    result = {"n": n, "tensors": tensors, "launched": t0, "seconds": time.time() - t0, "exit": code}
    (folder / "result.json").write_text(json.dumps(result))
    return result


# -- what a job's timeline says --------------------------------------------------------------------


def measure(folder: Path) -> dict[str, dict[str, float]]:
    """{cost: {"wall": s, "cpu": s, "cpu0": s, "cpu_others": s}} of one job (cpu* absent where only
    the wall clock is known): each the largest over the ranks, rank 0's, and the median of the
    others'."""
    result = json.loads((folder / "result.json").read_text())
    events = [
        json.loads(line) for line in (folder / "timeline.jsonl").read_text().splitlines() if line
    ]
    out: dict[str, dict[str, float]] = {}

    # The launch: each stage's latest rank, since the launch, on the first attempt.
    first = [e for e in events if e.get("attempt", 0) == 0]
    previous = result["launched"]
    for stage in LAUNCH_STAGES:
        times = [e["t"] for e in first if e["event"] == stage]
        if not times:
            break
        # the agent's first, or the last rank's
        t = min(times) if stage == "rendezvous" else max(times)
        out[f"launch: {stage}"] = {"wall": t - previous}
        previous = t
    out["launch to first step"] = {"wall": previous - result["launched"]}

    # The restart: goodput's stages, kill to first step. In place: the recovery's own phases.
    recovery = next(
        (r for r in goodput.analyse(folder / "timeline.jsonl")["recoveries"] if r["whole"]), None
    )
    phase = "recovery in place" if folder.name.endswith(IN_PLACE) else "restart"
    record = next((r for r in _records(folder) if r.get("event") == "recover"), None)
    if recovery is not None and record is not None:
        kill = recovery["t"]
        seen = record["seen"]  # when the agent saw the failure
        seconds = record["seconds"]  # rank 0's, from the failure seen to the state loaded
        parts = ("leave", "decide", "regroup", "restore")
        out[f"{phase}: detect"] = {"wall": seen - kill}
        for name in parts:
            out[f"{phase}: {name}"] = {"wall": seconds[name]}
        # the script run again up to its resume, and the first step after it
        out[f"{phase}: rebuild"] = {"wall": seconds["total"] - sum(seconds[p] for p in parts)}
        out[f"{phase}: first_step"] = {
            "wall": recovery["seconds"] - (seen - kill) - seconds["total"]
        }
        out[f"{phase} to first step"] = {"wall": recovery["seconds"]}
    elif recovery is not None and phase == "restart":
        before = 0.0
        for stage in goodput.STAGES:
            at = recovery["stages"].get(stage)
            if at is not None:
                out[f"restart: {stage}"] = {"wall": at - before}
                before = at
        out["restart to first step"] = {"wall": recovery["seconds"]}

    # Operations timed inside the ranks: each rank's median over the repeats after the first (which
    # pays for first-time imports and allocations), then over the ranks.
    per_rank: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for e in events:
        if e["event"] == "timed" and e["repeat"] > 0:
            for stage, (wall, cpu) in e["stages"].items():
                # "end": the call's return, or the whole call
                if stage != "end" or len(e["stages"]) == 1:
                    per_rank.setdefault(f"{e['what']}: {stage}", {}).setdefault(
                        e["rank"], []
                    ).append((wall, cpu))
        if e["event"] == "done" and e["copies"]:
            copies = e["copies"][2:] or e["copies"]  # the first two map the slots
            per_rank.setdefault("memory copy", {})[e["rank"]] = [tuple(c) for c in copies]
    for name, ranks in per_rank.items():
        out[name] = summary(
            {r: [statistics.median(x[i] for x in v) for i in (0, 1)] for r, v in ranks.items()}
        )
    # Each operation whole: the sum of its stages, rank by rank.
    for what in ("save", "async save", "load", "evaluate", "split_world"):
        totals: dict[int, list[float]] = {}
        for e in events:
            if e["event"] == "timed" and e["what"] == what and e["repeat"] > 0:
                # An asynchronous save's whole is up to its return; the write in the background is
                # apart.
                kept = [wc for s, wc in e["stages"].items() if s != "written in the background"]
                wall, cpu = sum(w for w, _ in kept), sum(c for _, c in kept)
                totals.setdefault(e["rank"], []).append((wall, cpu))
        if totals:
            out[f"{what} (whole)"] = summary(
                {r: [statistics.median(x[i] for x in v) for i in (0, 1)] for r, v in totals.items()}
            )
    # Where only the wall clock is known (the launch and the restart, across processes): the ranks'
    # stages scaled by the share of a core each rank had (n ranks busy at once on c cores each get
    # c/n of one), the agent's as they are (one process: detection, teardown, rendezvous, starting
    # the workers one by one). An estimate of the wall clock with a core a rank; it counts a rank's
    # waits for the others as work.
    share = min(1.0, (os.cpu_count() or 1) / result["n"])
    for phase in ("launch", "restart", "recovery in place"):
        total = 0.0
        for name, cost in out.items():
            if name.startswith(f"{phase}: "):
                cost["share"] = cost["wall"] * (
                    1.0 if name.split(": ")[1] in AGENT_STAGES else share
                )
                total += cost["share"]
        if f"{phase} to first step" in out:
            out[f"{phase} to first step"]["share"] = total
    return out


def _records(folder: Path) -> list[dict]:
    path = folder / "run" / "metrics.jsonl"
    return [json.loads(line) for line in path.open()] if path.exists() else []


def in_place(folder: Path, stopped: list[str]) -> dict[str, dict[str, float]]:
    """The recovery's costs of the same job run under ``--recover in-place`` in ``folder``, if it
    was; a job that failed is added to ``stopped``."""
    if not (folder / "result.json").exists():
        return {}
    if json.loads((folder / "result.json").read_text())["exit"] != 0:
        stopped.append(f"in place: see {folder / 'output.txt'}")
        return {}
    return {k: v for k, v in measure(folder).items() if k.startswith("recovery in place")}


def summary(by_rank: dict[int, list[float]]) -> dict[str, float]:
    others = [c for r, (_, c) in by_rank.items() if r != 0]
    return {
        "wall": max(w for w, _ in by_rank.values()),
        "cpu": max(c for _, c in by_rank.values()),
        "cpu0": by_rank[0][1] if 0 in by_rank else math.nan,
        "cpu_others": statistics.median(others) if others else math.nan,
    }


def fit(points: list[tuple[int, float]]) -> tuple[float, float, float] | None:
    """cost = a * n^b by least squares on logs: (a, b, the 95% half-width of b); None under 2
    points."""
    points = [(n, y) for n, y in points if y > 0]
    if len(points) < 2:
        return None
    xs, ys = [math.log(n) for n, _ in points], [math.log(y) for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = math.exp(my - b * mx)
    dof = len(points) - 2
    if dof == 0:
        return a, b, math.nan
    s2 = sum((y - (my + b * (x - mx))) ** 2 for x, y in zip(xs, ys)) / dof
    return a, b, T95.get(dof, 1.96) * math.sqrt(s2 / sxx)


# -- report ----------------------------------------------------------------------------------------

HEADLINE = [
    "launch to first step",
    "restart to first step",
    "recovery in place to first step",
    "memory copy",
    "save (whole)",
    "save: values gathered",
    "save: planned",
    "save: written",
    "save: indexed",
    "save: marked",
    "async save: stall",
    "load (whole)",
    "load: found and verified",
    "load: planned",
    "load: read",
    "evaluate (whole)",
    "split_world (whole)",
]


def extrapolate(
    points: list[tuple[int, float]], f: tuple[float, float, float], to: int
) -> tuple[float, float, float]:
    """The cost at ``to`` ranks: (low, fitted, high). Anchored at the largest world measured (its
    fitted value) and carried on with the exponent's 95% interval, so the interval widens with the
    distance from it."""
    a, b, pm = f
    last = max(n for n, _ in points)
    at = a * last**b
    pm = 0.0 if math.isnan(pm) else pm
    return tuple(at * (to / last) ** e for e in (b - pm, b, b + pm))  # type: ignore[return-value]


def report(
    root: Path, sizes: list[int], tensor_counts: list[int], beyond: list[int] = ()
) -> tuple[str, dict]:
    import torch

    lines = [
        f"scale: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, python "
        f"{platform.python_version()}, "
        f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        "",
    ]
    fits: dict = {}
    for tensors in tensor_counts:
        measured, stopped = {}, []
        for n in sizes:
            folder = root / f"n{n}-t{tensors}"
            if not (folder / "result.json").exists():
                continue
            result = json.loads((folder / "result.json").read_text())
            if result["exit"] != 0:
                stopped.append(f"{n} ranks: exit {result['exit']} (see {folder / 'output.txt'})")
                continue
            measured[n] = measure(folder) | in_place(root / f"n{n}-t{tensors}{IN_PLACE}", stopped)
        if not measured:
            continue
        ns = sorted(measured)
        lines += [
            f"## {tensors:,} parameter tensors ({3 * tensors + 2:,} tensors in a snapshot's state "
            "with Adam)",
            "",
            "cpu: the largest of the ranks' CPU seconds (rank 0's; the median of the others'), "
            f"wall: the largest rank's wall clock, both in ms, on {os.cpu_count()} cores. Where "
            "only the wall clock is known, 'a core each' scales it by the share of a core each "
            f"rank had ({os.cpu_count()}/n). b: the fitted exponent of cpu (else of 'a core "
            "each'), with its 95% interval.",
            "",
            "| cost | " + " | ".join(f"{n} ranks" for n in ns) + " | b |",
            "|---|" + "---|" * (len(ns) + 1),
        ]
        far: list[str] = []
        names = [h for h in HEADLINE if any(h in measured[n] for n in ns)]
        names += sorted({k for n in ns for k in measured[n]} - set(names))
        for name in names:
            cells = []
            for n in ns:
                m = measured[n].get(name)
                if m is None:
                    cells.append("-")
                elif "cpu" in m:
                    cells.append(
                        f"cpu {1e3 * m['cpu']:.1f} ({1e3 * m['cpu0']:.1f}; "
                        f"{1e3 * m['cpu_others']:.1f}), wall {1e3 * m['wall']:.1f}"
                    )
                else:
                    cells.append(
                        f"wall {1e3 * m['wall']:.1f} (a core each: {1e3 * m['share']:.1f})"
                    )
            key = "cpu" if any("cpu" in measured[n].get(name, {}) for n in ns) else "share"
            points = [(n, measured[n][name][key]) for n in ns if name in measured[n]]
            f = fit(points)
            fits.setdefault(str(tensors), {})[name] = (
                None if f is None else {"a": f[0], "b": f[1], "pm": f[2], "of": key}
            )
            b = "-" if f is None else f"{f[1]:.2f} ± {f[2]:.2f} ({key})"
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {b} |")
            if f is not None and beyond and name in HEADLINE:
                far.append(
                    f"| {name} ({key}) | "
                    + " | ".join(
                        "{1:.3g} ({0:.3g} to {2:.3g})".format(*extrapolate(points, f, to))
                        for to in beyond
                    )
                    + " |"
                )
        lines.append("")
        if far:
            lines += [
                f"Extrapolated, in seconds: the fit carried from {max(ns)} ranks with its "
                "exponent's 95% interval.",
                "",
                "| cost | " + " | ".join(f"{to:,} ranks" for to in beyond) + " |",
                "|---|" + "---|" * len(beyond),
                *far,
                "",
            ]
        if stopped:
            lines += ["Stopped: " + "; ".join(stopped), ""]
    return "\n".join(lines), fits


def plot(
    fits_path: Path, root: Path, sizes: list[int], tensor_counts: list[int], out: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [
        "launch to first step",
        "restart to first step",
        "recovery in place to first step",
        "save (whole)",
        "load (whole)",
        "memory copy",
        "evaluate (whole)",
        "split_world (whole)",
        "async save: stall",
    ]
    fig, axes = plt.subplots(
        1, len(tensor_counts), figsize=(6 * len(tensor_counts), 4.5), squeeze=False
    )
    for ax, tensors in zip(axes[0], tensor_counts):
        measured = {}
        for n in sizes:
            folder = root / f"n{n}-t{tensors}"
            if (folder / "result.json").exists() and json.loads(
                (folder / "result.json").read_text()
            )["exit"] == 0:
                measured[n] = measure(folder) | in_place(Path(f"{folder}{IN_PLACE}"), [])
        for name in shown:
            pts = [
                (n, m[name]["cpu" if "cpu" in m[name] else "share"])
                for n, m in measured.items()
                if name in m
            ]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="ranks",
            ylabel="seconds (cpu, else wall on a core each)",
        )
        ax.set_xticks(sizes, [str(n) for n in sizes], minor=False)  # the world sizes, not 2 x 10^0
        ax.set_xticks([], minor=True)
        ax.set_title(f"{tensors:,} parameter tensors")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="2,4,8,16,32,64", help="world sizes (default 2,4,8,16,32,64)")
    p.add_argument("--tensors", default="10,1000,10000", help="parameter tensors of the model")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument(
        "--repeats", type=int, default=4, help="of each timed operation; the first is left out"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for one job")
    p.add_argument(
        "--quick", action="store_true", help="2 and 4 ranks, 10 and 1,000 tensors, 2 repeats"
    )
    p.add_argument("--dir", default=None, help="where the jobs go (default: a temporary folder)")
    p.add_argument(
        "--report", action="store_true", help="only the tables, from the jobs already in --dir"
    )
    p.add_argument("--plot", default=None, help="a PNG of the costs against the ranks")
    p.add_argument(
        "--beyond", default="1024,16384", help="world sizes to extrapolate each fitted cost to"
    )
    p.add_argument(
        "--variants",
        default="whole",
        help="whole (torchrun's restart of every worker), in-place (--recover in-place), or both",
    )
    a = p.parse_args()
    if a.quick:
        a.sizes, a.tensors, a.repeats = "2,4", "10,1000", 2
    sizes, tensor_counts = (
        [int(s) for s in a.sizes.split(",")],
        [int(t) for t in a.tensors.split(",")],
    )
    root = Path(a.dir or tempfile.mkdtemp(prefix="scale-"))
    if not a.report:
        variants = a.variants.split(",")
        for tensors in tensor_counts:
            for n in sizes:
                for in_place in [v == "in-place" for v in variants]:  # alternated: same load
                    result = run(n, tensors, a, root, in_place)
                    print(json.dumps(result), flush=True)
                if result["exit"] != 0:
                    print(
                        f"{n} ranks x {tensors} tensors stopped: {result['exit']}; larger worlds "
                        "skipped"
                    )
                    break
    text, fits = report(root, sizes, tensor_counts, [int(s) for s in a.beyond.split(",") if s])
    (root / "fits.json").write_text(json.dumps(fits, indent=1))
    print(text)
    if a.plot:
        plot(root / "fits.json", root, sizes, tensor_counts, Path(a.plot))
    print(f"jobs and timelines: {root}")


if __name__ == "__main__":
    main()
