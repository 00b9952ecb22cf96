"""``ddpkit bench``: will more GPUs help? Step time at 1..N ranks, the all-reduce on its own, and a
prediction.

1. The workload's DDP step at 1, 2, ... N ranks on this machine (one job per world size, world sizes
   interleaved over rounds so that other load on the machine falls on all of them; the fastest round
   counts), broken into data, forward, backward, the exposed all-reduce and the optimizer step (see
   :mod:`ddpkit.tools._steptime`).
2. The backend's all-reduce alone over message sizes at 2..N ranks: an alpha-beta fit and
   nccl-tests' bus bandwidth (:mod:`ddpkit.tools._allreduce`).
3. Predicted step times: at 2..N ranks here, from the 1-rank step and the all-reduce measured on its
   own (on the CPU, in a step's rhythm), next to the measured ones (the predictor's error); and at
   larger world sizes over a given interconnect (:mod:`ddpkit.tools._predict`).
4. DDP's knobs, each tried on its own at N ranks, and the best combination.
5. DataParallel and one GPU against DDP, where there are GPUs.

Writes a table to stdout, ``bench.json`` and (with matplotlib, ``pip install 'ddpkit[plot]'``)
``bench.png``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys
from collections.abc import Sequence, Sized
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._internals.compiler import import_dynamo
from ddpkit._launch.spawn import spawn
from ddpkit.data import ShardedBatchSampler
from ddpkit.strategies._prepare import GRADIENT_AS_BUCKET_VIEW
from ddpkit.tools import _allreduce as allreduce
from ddpkit.tools import _predict as predict
from ddpkit.tools import _steptime as steptime
from ddpkit.tools._bench_config import BenchConfig
from ddpkit.tools._bench_predict import assumptions, compute_seconds, predictions
from ddpkit.tools._bench_report import report
from ddpkit.tools._steptime import Knobs, cores, measure_steps, single_process_steps
from ddpkit.tools._workload import BUILTINS, HOOK, load_workload
from ddpkit.tracking._curves import shown

MS = 1e3


# -- measuring -------------------------------------------------------------------------------------


def _fastest_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the shortest median step (rank 0's; ranks wait for each other in the
    all-reduce).

    Other work on the machine only ever adds time, so the least disturbed round is the best estimate
    of the machine's own speed (timeit's reasoning); the parts come from that round, so that they
    add up."""
    return min(runs, key=lambda r: r["medians"]["step"])


def measure_scaling(cfg: BenchConfig, log: Any) -> dict[int, dict[str, Any]]:
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in range(1, cfg.nproc + 1)}
    job = functools.partial(
        measure_steps, cfg.script, Knobs(), cfg.steps, cfg.warmup, True, cfg.pin
    )
    for r in range(cfg.rounds):
        for n in runs:
            runs[n].append(spawn(job, n, start_method=_start_method())[0])
            log(
                f"  round {r + 1}/{cfg.rounds}, {n} rank(s): step "
                f"{runs[n][-1]['medians']['step'] * MS:.2f} ms"
            )
    out = {}
    for n, rs in runs.items():
        best = _fastest_round(rs)
        out[n] = {
            "parts": {p: v for p, v in best["medians"].items() if v is not None},
            "rounds_step_s": [x["medians"]["step"] for x in rs],
            "step_samples": best["step_samples"],
            "pinned": best["pinned"],
            "threads": best["threads"],
            "device": best["device"],
            "backend": best["backend"],
            "param_bytes": best["param_bytes"],
            "batch_size": best["batch_size"],
        }
    return out


def measure_allreduce(
    cfg: BenchConfig, buckets: list[int], compute_s: float
) -> tuple[dict[int, allreduce.AllReduceFit], dict[int, float], dict[int, float]]:
    """The sweep at 2..N ranks (the bucket sizes among the sizes); on the CPU, the buckets'
    all-reduce in a step's rhythm after ``compute_s`` of compute
    (:func:`~ddpkit.tools._allreduce.measure_in_step`); and the buckets' all-reduce at one rank."""
    sizes = tuple(sorted(set(allreduce.DEFAULT_SIZES) | set(buckets)))
    fits, in_step = {}, {}
    for n in range(2, cfg.nproc + 1):
        job = functools.partial(_sweep_at, sizes, cfg.pin, buckets, compute_s)
        points, in_step_s = spawn(job, n, start_method=_start_method())[0]
        fits[n] = allreduce.fit_alpha_beta(n, points)
        if in_step_s is not None:
            in_step[n] = in_step_s
    one_rank = functools.partial(_sweep_at, tuple(sorted(set(buckets))), cfg.pin, [], 0.0)
    one = dict(spawn(one_rank, 1, start_method=_start_method())[0][0])
    return fits, in_step, one


def _sweep_at(
    sizes: tuple[int, ...], pin: bool, buckets: list[int], compute_s: float
) -> tuple[list[tuple[int, float]], float | None]:
    from ddpkit.distributed._runtime import init

    rt = init()
    cpu = rt.device.type == "cpu"
    if pin and cpu:  # placed as the steps' ranks are: two ranks on one core take turns
        steptime.pin_to_core(rt.rank, rt.world_size)
    in_step = allreduce.measure_in_step(buckets, compute_s) if cpu and buckets else None
    return allreduce.measure(sizes), in_step


KNOB_TRIALS = (
    Knobs(bucket_cap_mb=1.0),
    Knobs(bucket_cap_mb=100.0),
    Knobs(gradient_as_bucket_view=not GRADIENT_AS_BUCKET_VIEW),
    Knobs(static_graph=True),
    Knobs(num_workers=1),
)


def measure_knobs(cfg: BenchConfig, log: Any) -> dict[str, Any]:
    """Each knob changed on its own from the defaults at ``nproc`` ranks, rounds interleaved; then
    the best of each knob together. A knob "helps" only if it beats the defaults by more than the
    defaults' own spread."""
    trials = [Knobs(), *KNOB_TRIALS]
    if torch.cuda.device_count():  # not is_available(): see _start_method
        trials.append(Knobs(pin_memory=True))
    steps = max(10, cfg.steps // 2)
    job = functools.partial(
        measure_steps, cfg.script, steps=steps, warmup=cfg.warmup, split_comm=False, pin=cfg.pin
    )
    results: dict[Knobs, list[float]] = {k: [] for k in trials}
    for r in range(max(2, cfg.rounds)):
        for k in trials:
            results[k].append(
                spawn(functools.partial(job, knobs=k), cfg.nproc, start_method=_start_method())[0][
                    "medians"
                ]["step"]
            )
        log(
            f"  knobs, fastest after round {r + 1}: "
            + ", ".join(f"{k.label()} {min(v) * MS:.2f}" for k, v in results.items())
        )
    base = results[trials[0]]
    noise = (max(base) - min(base)) / 2
    best: dict[str, Any] = {}
    for k in trials[1:]:
        gain = min(base) - min(results[k])
        if gain > noise:
            best |= {f: v for f, v in asdict(k).items() if v != getattr(Knobs(), f)}
    combined = Knobs(**best)
    if best and combined not in results:
        results[combined] = [
            spawn(functools.partial(job, knobs=combined), cfg.nproc, start_method=_start_method())[
                0
            ]["medians"]["step"]
            for _ in range(max(2, cfg.rounds))
        ]
    rows = [
        {"knobs": k.label(), "settings": asdict(k), "step_s": min(v), "rounds_step_s": v}
        for k, v in results.items()
    ]
    return {
        "world_size": cfg.nproc,
        "rows": rows,
        "noise_s": noise,
        "best": combined.label(),
        "best_settings": asdict(combined),
        "best_step_s": min(results[combined]),
    }


def _start_method() -> str | None:
    """How the bench starts each job's ranks: afresh (``"spawn"``) where GPUs are visible, else by
    fork.

    A forked rank cannot use CUDA once this process has touched the CUDA driver, and
    ``torch.cuda.is_available()`` does (here or in a workload script's import), while
    ``torch.cuda.is_initialized()`` still says no; nothing tells a forked child's fate in advance,
    so GPU jobs start clean, at a few seconds each. On the CPU, forking saves every job the import
    of torch. (``torch.cuda.device_count()`` asks NVML and leaves the driver alone.)
    """
    return "spawn" if torch.cuda.device_count() else None


def compare_data_parallel(cfg: BenchConfig) -> dict[str, Any]:
    """One GPU (one process, no process group) and ``nn.DataParallel`` over every visible GPU, each
    at the per-GPU batch of a DDP rank; where there are GPUs."""
    gpus = torch.cuda.device_count()
    if gpus == 0:
        return {
            "skipped": "no CUDA GPU on this machine: DataParallel splits each batch over the GPUs "
            "of one process, and one GPU has nothing to compare with; DDP over gloo on CPU "
            "processes is measured above"
        }

    def one_process(data_parallel: bool) -> dict[str, Any]:
        job = functools.partial(
            single_process_steps, cfg.script, data_parallel, cfg.steps, cfg.warmup
        )
        return spawn(job, 1, start_method=_start_method())[0]

    # DataParallel over one GPU splits nothing, but still scatters each batch and gathers the
    # outputs: what it costs over the plain GPU step is its own overhead.
    return {"single_gpu": one_process(False), "data_parallel": one_process(True)}


# -- reporting -------------------------------------------------------------------------------------


def _conditions(cfg: BenchConfig, scaling: dict[int, dict[str, Any]]) -> dict[str, Any]:
    load = tuple(round(x, 2) for x in os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "cores": cores(),
        "load_average_1_5_15": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": scaling[1]["device"],
        "backend": scaling[2]["backend"] if 2 in scaling else scaling[1]["backend"],
        "threads_per_rank": 1,
        "pinned_ranks": {n: s["pinned"] for n, s in scaling.items()},
        "config": asdict(cfg),
    }


def run_bench(cfg: BenchConfig, log: Any = print) -> dict[str, Any]:
    # DDP's constructor imports torch._dynamo, which takes seconds; imported once here, before
    # ddpkit.spawn forks, every rank of every job inherits it.
    import_dynamo()

    # bad input fails here, with its message, rather than inside every rank
    w = load_workload(cfg.script)
    if w.loader is None:
        ShardedBatchSampler(
            cast(Sized, w.dataset),
            w.batch_size,
            drop_last=w.drop_last,
            rank=0,
            world_size=cfg.nproc,
        )  # checks the workload's sizes; a map-style dataset has a length
    log(f"measuring the step at 1..{cfg.nproc} ranks ({cfg.rounds} rounds)")
    scaling = measure_scaling(cfg, log)
    log("measuring the all-reduce alone")
    buckets = predict.bucket_sizes(scaling[1]["param_bytes"], Knobs().bucket_cap_mb)
    fits, in_step, one_rank = measure_allreduce(cfg, buckets, compute_seconds(scaling))
    knobs = None
    if cfg.knobs:
        log(f"trying DDP's knobs at {cfg.nproc} ranks")
        knobs = measure_knobs(cfg, log)
    dp = compare_data_parallel(cfg)
    pred = predictions(cfg, scaling, fits, one_rank, in_step)
    result = {
        "workload": cfg.script or w.name,
        "scaling": scaling,
        "allreduce": {n: f.to_json() for n, f in fits.items()},
        "predictions": pred,
        "assumptions": assumptions(cfg, scaling, pred),
        "knobs": knobs,
        "data_parallel": dp,
    }
    result["conditions"] = _conditions(cfg, scaling)
    return result


OUTPUTS = ("bench.json", "bench.png")


def check_out(out: str, overwrite: bool) -> None:
    """Refuse an ``--out`` the results could not be written to, or one holding an earlier bench's
    results (unless ``overwrite``), before anything is measured: the measurement takes minutes, and
    its results must not be lost to a bad folder at the end, nor silently replace the last ones."""
    path = Path(out)
    try:
        path.exists()
    except OSError as err:  # a name longer than the file system allows
        raise ConfigError(
            f"--out {out[:80]!r}... ({len(out)} characters): {err.strerror}: give another --out"
        ) from None
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"--out {out!r} is a file: give a folder for bench.json and bench.png (made if missing)"
        )
    earlier = [name for name in OUTPUTS if os.path.lexists(path / name)]
    if earlier and not overwrite:
        raise ConfigError(
            f"--out {out!r} already holds {' and '.join(earlier)} of an earlier bench: give "
            "another --out, or --overwrite to replace them"
        )
    parent = path
    while not parent.exists():  # the nearest folder that exists is where the folders are made
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--out {out!r}: cannot make or write to it ({str(parent)!r} is not a folder you can "
            "write to): give another --out"
        )


def write_outputs(cfg: BenchConfig, result: dict[str, Any]) -> list[str]:
    out = Path(cfg.out)
    fs.make_dirs(out)
    # Never a half-written file; a link at either name is replaced, not written through.
    fs.write_atomic(out / "bench.json", (json.dumps(result, indent=2, default=str) + "\n").encode())
    written = [str(out / "bench.json")]
    try:
        from ddpkit.tools._bench_plot import plot_throughput
    except ImportError as err:
        return written + [f"(no plot: {err}; pip install 'ddpkit[plot]')"]
    plot_throughput(result, out / "bench.png")
    return written + [str(out / "bench.png")]


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give world sizes as 1,2,4,8") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: world sizes must be >= 1")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ddpkit bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
        epilog=f"Your own training: a script defining {HOOK}() that returns (model, dataset, "
        "loss_fn, optimizer_factory) or a ddpkit.tools._workload.Workload (batch_size per rank, "
        "loader, ...).",
    )
    p.add_argument(
        "script",
        nargs="?",
        help=f"training script defining {HOOK}() or building a ddpkit.Trainer, or a built-in "
        "workload (" + ", ".join(BUILTINS) + "); default: the DDP tutorials' CNN",
    )
    gpus = torch.cuda.device_count()
    p.add_argument(
        "--nproc",
        type=int,
        default=gpus if gpus >= 2 else 2,
        help="largest world size measured here (default: the GPUs, or 2 CPU processes)",
    )
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--predict",
        type=_sizes,
        default=BenchConfig.predict_sizes,
        metavar="N,N,...",
        help="world sizes to predict (default 1,2,4,...,256)",
    )
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--intra", default="measured", help="link within a node: measured (default) or a preset"
    )
    p.add_argument(
        "--interconnect",
        default="infiniband",
        choices=sorted(predict.PRESETS),
        help="link between nodes (default infiniband)",
    )
    p.add_argument(
        "--bandwidth",
        type=float,
        dest="bandwidth_gbps",
        metavar="GB/s",
        help="bus bandwidth of the link between nodes, replacing the preset's",
    )
    p.add_argument(
        "--latency-us",
        type=float,
        help="latency of one ring step between nodes, replacing the preset's",
    )
    p.add_argument("--no-knobs", dest="knobs", action="store_false", help="skip the knob trials")
    p.add_argument("--out", default="ddpkit-bench", help="folder for bench.json and bench.png")
    p.add_argument(
        "--overwrite", action="store_true", help="replace the results of an earlier bench in --out"
    )
    p.add_argument("--no-pin", dest="pin", action="store_false", help="leave CPU ranks unpinned")
    a = p.parse_args(argv)
    cfg = BenchConfig(
        script=a.script,
        nproc=a.nproc,
        steps=a.steps,
        warmup=a.warmup,
        rounds=a.rounds,
        predict_sizes=a.predict,
        gpus_per_node=a.gpus_per_node,
        intra=a.intra,
        interconnect=a.interconnect,
        bandwidth_gbps=a.bandwidth_gbps,
        latency_us=a.latency_us,
        knobs=a.knobs,
        out=a.out,
        pin=a.pin,
    )
    check_out(a.out, a.overwrite)
    result = run_bench(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print("\n".join(report(result)))
    for path in write_outputs(cfg, result):
        print(f"wrote {shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
