"""``ddpkit bench``: will more GPUs help? Step time at 1..N ranks, the all-reduce on its own, and a
prediction.

1. The workload's DDP step at 1, 2, ... N ranks on this machine (one job per world size, world sizes
   interleaved over rounds; the fastest round counts), broken into data, forward, backward, the
   exposed all-reduce and the optimizer step.
2. The backend's all-reduce alone over message sizes at 2..N ranks: an alpha-beta fit and
   nccl-tests' bus bandwidth.
3. Predicted step times: at 2..N ranks here, from the 1-rank step and the all-reduce measured on its
   own (on the CPU, in a step's rhythm), next to the measured ones (the predictor's error); and at
   larger world sizes over a given interconnect.
4. DDP's knobs, each tried on its own at N ranks, and the best combination.
5. DataParallel and one GPU against DDP, where there are GPUs.

Writes a table to stdout, ``bench.json`` and (with matplotlib, ``pip install 'ddpkit[plot]'``)
``bench.png``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import io
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError, check_types
from ddpkit._internals.compiler import import_dynamo
from ddpkit._launch.cli.options import MAX_NPROC
from ddpkit.distributed._runtime import init
from ddpkit.distributed._spawn import spawn
from ddpkit.platforms._cpus import cpu_count
from ddpkit.strategies._prepare import GRADIENT_AS_BUCKET_VIEW
from ddpkit.tools import _measure as measure
from ddpkit.tools import _predict as predict
from ddpkit.tools._measure import Knobs, measure_steps, single_process_steps
from ddpkit.tools._predict import MS
from ddpkit.tools._workload import BUILTINS, HOOK, MAX_STEPS, load_workload
from ddpkit.tracking._curves import refuse_bad_name, shown

MAX_WORLD = 1_000_000  # the largest world size --predict extrapolates to
OUTPUTS = ("bench.json", "bench.png")
# each count's bounds, and what to give below the lower one
BOUNDS = {
    "nproc": (2, MAX_NPROC, "measure at least 2 ranks, or there is nothing to scale"),
    "steps": (1, MAX_STEPS, "must be >= 1"),
    "warmup": (0, MAX_STEPS, "give the untimed steps before timing, >= 0"),
    "rounds": (1, MAX_STEPS, "must be >= 1"),
    "gpus_per_node": (1, MAX_NPROC, "must be >= 1"),
}


@dataclass(kw_only=True)
class BenchConfig:
    """What ``ddpkit bench`` measures and predicts: its options (``ddpkit bench -h``); ``script``
    None is the DDP tutorials' CNN on sklearn digits."""

    script: str | None = None
    nproc: int = 2
    steps: int = 60
    warmup: int = 10
    rounds: int = 3
    predict_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    gpus_per_node: int = 8
    intra: str = "measured"
    interconnect: str = "infiniband"
    bandwidth_gbps: float | None = None
    latency_us: float | None = None
    knobs: bool = True
    out: str = "ddpkit-bench"
    pin: bool = True

    def __post_init__(self) -> None:
        check_types(self)
        for name, (low, high, below) in BOUNDS.items():
            if (value := getattr(self, name)) < low:
                raise ConfigError(f"{_flag(name)} {value}: {below}")
            if value > high:
                raise ConfigError(f"{_flag(name)} {value}: at most {high}")
        if not self.predict_sizes or not all(1 <= n <= MAX_WORLD for n in self.predict_sizes):
            raise ConfigError(
                f"--predict {','.join(map(str, self.predict_sizes))}: give world sizes from 1 to "
                f"{MAX_WORLD}, such as 1,2,4,8"
            )
        self._check_links()
        gpus = torch.cuda.device_count()
        if gpus and self.nproc > gpus:
            hint = (
                "lower --nproc"
                if gpus >= 2
                else "DDP needs 2 ranks; with CUDA_VISIBLE_DEVICES= the bench measures CPU "
                "processes over gloo"
            )
            raise ConfigError(
                f"--nproc {self.nproc}: this machine has {gpus} GPU(s), one per rank: {hint}"
            )

    def _check_links(self) -> None:
        presets = ", ".join(predict.PRESETS)
        if self.interconnect not in predict.PRESETS:
            raise ConfigError(f"--interconnect {self.interconnect!r}: choose one of {presets}")
        if self.intra != "measured" and self.intra not in predict.PRESETS:
            raise ConfigError(f"--intra {self.intra!r}: choose measured or one of {presets}")
        if self.bandwidth_gbps is not None and not (0 < self.bandwidth_gbps <= 1e6):
            raise ConfigError(
                f"--bandwidth {self.bandwidth_gbps}: give a bus bandwidth in GB/s, > 0 and <= 1e6"
            )
        if self.latency_us is not None and not (0 <= self.latency_us <= 1e9):  # NaN fails both
            raise ConfigError(
                f"--latency-us {self.latency_us}: give the latency of one ring step in "
                "microseconds, a number >= 0"
            )

    def inter_link(self) -> predict.Interconnect:
        link = predict.PRESETS[self.interconnect]
        if self.bandwidth_gbps is not None:
            link = replace(
                link,
                busbw_bytes_per_s=self.bandwidth_gbps * 1e9,
                note=link.note + " (bandwidth given)",
            )
        if self.latency_us is not None:
            link = replace(
                link, hop_latency_s=self.latency_us * 1e-6, note=link.note + " (latency given)"
            )
        return link


def _start_method() -> str | None:
    """Ranks start afresh (``"spawn"``) where GPUs are visible, else by fork: a fork cannot use CUDA
    once this process touched the driver, which nothing tells in advance. ``device_count()`` asks
    NVML and leaves the driver alone."""
    return "spawn" if torch.cuda.device_count() else None


def _run(job: Callable[..., Any], n: int) -> Any:
    """Rank 0's result of ``job`` on ``n`` ranks."""
    return spawn(job, n, start_method=_start_method())[0]


def measure_scaling(cfg: BenchConfig, log: Any) -> dict[int, dict[str, Any]]:
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in range(1, cfg.nproc + 1)}
    job = functools.partial(
        measure_steps, cfg.script, Knobs(), cfg.steps, cfg.warmup, True, cfg.pin
    )
    for r in range(cfg.rounds):
        for n in runs:
            runs[n].append(_run(job, n))
            log(
                f"  round {r + 1}/{cfg.rounds}, {n} rank(s): step "
                f"{runs[n][-1]['medians']['step'] * MS:.2f} ms"
            )
    out = {}
    for n, rs in runs.items():
        # other work on the machine only adds time: the least disturbed round, whose parts add up
        best = min(rs, key=lambda r: r["medians"]["step"])
        out[n] = {
            "parts": {p: v for p, v in best["medians"].items() if v is not None},
            "rounds_step_s": [x["medians"]["step"] for x in rs],
            **{k: best[k] for k in ("step_samples", "pinned", "threads", "device", "backend")},
            **{k: best[k] for k in ("param_bytes", "batch_size")},
        }
    return out


def measure_allreduce(
    cfg: BenchConfig, buckets: list[int], compute_s: float
) -> tuple[dict[int, predict.AllReduceFit], dict[int, float], dict[int, float]]:
    """The sweep at 2..N ranks (the bucket sizes among the sizes); on the CPU, the buckets'
    all-reduce in a step's rhythm after ``compute_s`` of compute; the buckets' at one rank."""
    sizes = tuple(sorted(set(measure.DEFAULT_SIZES) | set(buckets)))
    fits, in_step = {}, {}
    for n in range(2, cfg.nproc + 1):
        points, in_step_s = _run(
            functools.partial(_sweep_at, sizes, cfg.pin, buckets, compute_s), n
        )
        fits[n] = predict.fit_alpha_beta(n, points)
        if in_step_s is not None:
            in_step[n] = in_step_s
    one_rank = functools.partial(_sweep_at, tuple(sorted(set(buckets))), cfg.pin, [], 0.0)
    return fits, in_step, dict(_run(one_rank, 1)[0])


def _sweep_at(
    sizes: tuple[int, ...], pin: bool, buckets: list[int], compute_s: float
) -> tuple[list[tuple[int, float]], float | None]:
    rt = init()
    cpu = rt.device.type == "cpu"
    if pin and cpu:  # placed as the steps' ranks are
        measure.pin_to_core(rt.rank, rt.world_size)
    in_step = measure.measure_in_step(buckets, compute_s) if cpu and buckets else None
    return measure.measure_allreduce(sizes), in_step


KNOB_TRIALS = (
    Knobs(bucket_cap_mb=1.0),
    Knobs(bucket_cap_mb=100.0),
    Knobs(gradient_as_bucket_view=not GRADIENT_AS_BUCKET_VIEW),
    Knobs(static_graph=True),
    Knobs(num_workers=1),
)


def measure_knobs(cfg: BenchConfig, log: Any) -> dict[str, Any]:
    """Each knob changed on its own at ``nproc`` ranks, rounds interleaved; then the best of each
    together. A knob helps only if it beats the defaults by more than their own spread."""
    trials = [Knobs(), *KNOB_TRIALS]
    if torch.cuda.device_count():  # not is_available(): see _start_method
        trials.append(Knobs(pin_memory=True))
    job = functools.partial(
        measure_steps,
        cfg.script,
        steps=max(10, cfg.steps // 2),
        warmup=cfg.warmup,
        split_comm=False,
        pin=cfg.pin,
    )

    def step_s(knobs: Knobs) -> float:
        return _run(functools.partial(job, knobs=knobs), cfg.nproc)["medians"]["step"]

    results: dict[Knobs, list[float]] = {k: [] for k in trials}
    for r in range(max(2, cfg.rounds)):
        for k in trials:
            results[k].append(step_s(k))
        log(
            f"  knobs, fastest after round {r + 1}: "
            + ", ".join(f"{k.label()} {min(v) * MS:.2f}" for k, v in results.items())
        )
    base = results[trials[0]]
    noise = (max(base) - min(base)) / 2
    best: dict[str, Any] = {}
    for k in trials[1:]:
        if min(base) - min(results[k]) > noise:
            best |= {f: v for f, v in asdict(k).items() if v != getattr(Knobs(), f)}
    combined = Knobs(**best)
    if best and combined not in results:
        results[combined] = [step_s(combined) for _ in range(max(2, cfg.rounds))]
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


def compare_data_parallel(cfg: BenchConfig) -> dict[str, Any]:
    """One GPU and ``nn.DataParallel`` over every visible GPU, each at the per-GPU batch of a DDP
    rank; where there are GPUs. DataParallel over one GPU still scatters and gathers: its cost."""
    if torch.cuda.device_count() == 0:
        return {
            "skipped": "no CUDA GPU on this machine: DataParallel splits each batch over the GPUs "
            "of one process, and one GPU has nothing to compare with; DDP over gloo on CPU "
            "processes is measured above"
        }
    job = functools.partial(single_process_steps, cfg.script, steps=cfg.steps, warmup=cfg.warmup)
    return {
        "single_gpu": _run(functools.partial(job, data_parallel=False), 1),
        "data_parallel": _run(functools.partial(job, data_parallel=True), 1),
    }


def _conditions(cfg: BenchConfig, scaling: dict[int, dict[str, Any]]) -> dict[str, Any]:
    load = tuple(round(x, 2) for x in os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "cores": cpu_count(),
        "load_average_1_5_15": load,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": scaling[1]["device"],
        "backend": scaling[2]["backend"],  # nproc >= 2: the backend between ranks
        "threads_per_rank": 1,
        "pinned_ranks": {n: s["pinned"] for n, s in scaling.items()},
        "config": asdict(cfg),
    }


def run_bench(cfg: BenchConfig, log: Any = print) -> dict[str, Any]:
    # DDP's constructor imports torch._dynamo (seconds): imported once before the forks
    import_dynamo()
    w = load_workload(cfg.script)  # bad input fails here, not inside every rank
    if w.trainer is not None and w.trainer.given.get("step_fn") is not None:
        raise ConfigError(
            f"{cfg.script}: its Trainer has a step_fn (several models and optimizers), and `ddpkit "
            f"bench` times one model's step: define {HOOK}() returning a ddpkit.tools.Workload of "
            "one of its models (`ddpkit check` runs the step_fn Trainer as it is)"
        )
    w.check_sizes(cfg.nproc)
    log(f"measuring the step at 1..{cfg.nproc} ranks ({cfg.rounds} rounds)")
    scaling = measure_scaling(cfg, log)
    log("measuring the all-reduce alone")
    buckets = predict.bucket_sizes(scaling[1]["param_bytes"], Knobs().bucket_cap_mb)
    fits, in_step, one_rank = measure_allreduce(cfg, buckets, predict.compute_seconds(scaling))
    knobs = None
    if cfg.knobs:
        log(f"trying DDP's knobs at {cfg.nproc} ranks")
        knobs = measure_knobs(cfg, log)
    dp = compare_data_parallel(cfg)
    pred = predict.predictions(cfg, scaling, fits, one_rank, in_step)
    return {
        "workload": cfg.script or w.name,
        "scaling": scaling,
        "allreduce": {n: f.to_json() for n, f in fits.items()},
        "predictions": pred,
        "assumptions": predict.assumptions(cfg, scaling, pred),
        "knobs": knobs,
        "data_parallel": dp,
        "conditions": _conditions(cfg, scaling),
    }


def report(result: dict[str, Any]) -> list[str]:
    """The table ``ddpkit bench`` prints, from its result (as written to bench.json)."""
    return [
        *_measured(result),
        *_allreduce_lines(result),
        *_predicted(result),
        *_knob_lines(result),
        *_data_parallel_lines(result),
    ]


def _measured(result: dict[str, Any]) -> list[str]:
    sc, cond = result["scaling"], result["conditions"]
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
    return lines


def _allreduce_lines(result: dict[str, Any]) -> list[str]:
    lines = [
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
    return lines


def _predicted(result: dict[str, Any]) -> list[str]:
    pred, cfg = result["predictions"], result["conditions"]["config"]
    lines = [
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
    return lines + ["assumptions:"] + [f"  - {a}" for a in result["assumptions"]]


def _knob_lines(result: dict[str, Any]) -> list[str]:
    knobs = result.get("knobs")
    if not knobs:
        return []
    lines = [
        "",
        f"DDP and loader knobs at {knobs['world_size']} ranks (fastest round; the defaults' "
        f"spread between rounds: +-{knobs['noise_s'] * MS:.3f} ms)",
    ]
    base = knobs["rows"][0]["step_s"]
    for row in knobs["rows"]:
        lines.append(
            f"  {row['knobs']:<42} {row['step_s'] * MS:8.3f} ms  {row['step_s'] / base - 1:+7.1%}"
        )
    on_cpu = result["conditions"]["device"] == "cpu"
    lines.append(
        f"  best: {knobs['best']} ({knobs['best_step_s'] * MS:.3f} ms); "
        + ("pin_memory only matters for copies to a GPU: not tried on the CPU" if on_cpu else "")
    )
    return lines


def _data_parallel_lines(result: dict[str, Any]) -> list[str]:
    dp, sc = result["data_parallel"], result["scaling"]
    if "skipped" in dp:
        return ["", f"DataParallel / one GPU: skipped: {dp['skipped']}"]
    single, d = dp["single_gpu"], dp["data_parallel"]
    lines = [
        "",
        f"one GPU: {single['step'] * MS:.3f} ms/step, {single['samples'] / single['step']:.0f} "
        "samples/s",
        f"DataParallel over {d['gpus']} GPU(s): {d['step'] * MS:.3f} ms/step, "
        f"{d['samples'] / d['step']:.0f} samples/s"
        + (
            " (one GPU: nothing to split; the cost of its scatter and gather)"
            if d["gpus"] == 1
            else ""
        ),
    ]
    if d["gpus"] in sc:
        s = sc[d["gpus"]]["parts"]["step"]
        batch = sc[1]["batch_size"]
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


def plot_throughput(result: dict[str, Any], path: Path) -> None:
    """Measured and predicted throughput against world size, with the ideal line (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scaling, pred = result["scaling"], result["predictions"]
    batch = scaling[1]["batch_size"]
    one = batch / scaling[1]["parts"]["step"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = sorted({*scaling, *(r["world_size"] for r in pred["larger"][pred["chosen"]]["rows"])})
    ax.plot(sizes, [n * one for n in sizes], color="0.6", linestyle=":", label="ideal (n x 1 rank)")
    for name, block in pred["larger"].items():
        rows, chosen = block["rows"], name == pred["chosen"]
        ax.plot(
            [r["world_size"] for r in rows],
            [r["samples_per_s"] for r in rows],
            marker="." if chosen else None,
            linewidth=2 if chosen else 1,
            alpha=1 if chosen else 0.5,
            label=f"predicted, {pred['intra_link']['name']} in a node, {name} between nodes",
        )
    here = pred["this_machine"]
    ax.plot(
        [1] + [r["world_size"] for r in here],
        [one] + [r["samples_per_s"] for r in here],
        "s--",
        color="tab:purple",
        markerfacecolor="none",
        label="predicted, this machine",
    )
    measured = [n * batch / s["parts"]["step"] for n, s in scaling.items()]
    ax.plot(list(scaling), measured, "o", color="black", label="measured, this machine")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("throughput (samples/s)")
    cond = result["conditions"]
    ax.set_title(
        f"{result['workload']}: batch {batch}/rank ({cond['device']}, {cond['backend']})",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    fs.write_atomic(path, image.getvalue())


def check_out(out: str, overwrite: bool) -> None:
    """Refuse, before anything is measured, an ``--out`` the results could not be written to, or
    one holding an earlier bench's results (unless ``overwrite``)."""
    path = Path(out)
    refuse_bad_name(path, "--out", "give another --out")
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
    # never a half-written file; a link at either name is replaced, not written through
    fs.write_atomic(out / "bench.json", (json.dumps(result, indent=2, default=str) + "\n").encode())
    written = [str(out / "bench.json")]
    try:
        plot_throughput(result, out / "bench.png")
    except ImportError as err:
        return written + [f"(no plot: {err}; pip install 'ddpkit[plot]')"]
    return written + [str(out / "bench.png")]


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give world sizes as 1,2,4,8") from None


# `ddpkit bench`'s options are BenchConfig's fields: `--field-name` (a bool: `--no-field-name`) of
# the field's type and default, unless FLAGS and ARGPARSE say otherwise
HELP = {
    "nproc": "largest world size measured here (default: the GPUs, or 2 CPU processes)",
    "predict_sizes": "world sizes to predict (default 1,2,4,...,256)",
    "intra": "link within a node: measured (default) or a preset",
    "interconnect": "link between nodes (default infiniband)",
    "bandwidth_gbps": "bus bandwidth of the link between nodes, replacing the preset's",
    "latency_us": "latency of one ring step between nodes, replacing the preset's",
    "knobs": "skip the knob trials",
    "out": "folder for bench.json and bench.png",
    "pin": "leave CPU ranks unpinned",
}
FLAGS = {"predict_sizes": "--predict", "bandwidth_gbps": "--bandwidth"}
ARGPARSE: dict[str, dict[str, Any]] = {
    "predict_sizes": {"type": _sizes, "metavar": "N,N,..."},
    "interconnect": {"choices": sorted(predict.PRESETS)},
    "bandwidth_gbps": {"type": float, "metavar": "GB/s"},
    "latency_us": {"type": float},
}


def _flag(name: str) -> str:
    return FLAGS.get(name, "--" + name.replace("_", "-"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddpkit bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # as run, sbatch, k8s and check: a script's own options follow
        description=__doc__,
        epilog=f"Your own training: a script defining {HOOK}() that returns (model, dataset, "
        "loss_fn, optimizer_factory) or a ddpkit.tools.Workload (batch_size per rank, "
        "loader, ...).",
    )
    p.add_argument(
        "script",
        nargs="?",
        help=f"training script defining {HOOK}() or building a ddpkit.Trainer, or a built-in "
        "workload (" + ", ".join(BUILTINS) + "); default: the DDP tutorials' CNN",
    )
    for f in fields(BenchConfig)[1:]:
        option = {"dest": f.name, "help": HELP.get(f.name), **ARGPARSE.get(f.name, {})}
        if isinstance(f.default, bool):  # on by default: the option turns it off
            flag = _flag(f.name).replace("--", "--no-", 1)
            p.add_argument(flag, action="store_false", **option)
        else:
            option.setdefault("type", type(f.default))
            p.add_argument(_flag(f.name), default=f.default, **option)
    gpus = torch.cuda.device_count()
    p.set_defaults(nproc=gpus if gpus >= 2 else 2)
    p.add_argument(
        "--overwrite", action="store_true", help="replace the results of an earlier bench in --out"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = vars(_parser().parse_args(argv))  # BenchConfig's fields and --overwrite
    overwrite = a.pop("overwrite")
    cfg = BenchConfig(**a)
    check_out(cfg.out, overwrite)
    result = run_bench(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print("\n".join(report(result)))
    for path in write_outputs(cfg, result):
        print(f"wrote {shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
