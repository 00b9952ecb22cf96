"""Goodput under failures: the same training job without failures, and with a SIGKILL of a random
rank every T seconds, for several ways of surviving them; where each recovery's time goes.

The job (``tests/jobs/scripts/goodput_job.py``): the DDP tutorials' CNN on MNIST-shaped data
(synthetic: 1x28x28, 10 classes), batch 32 per rank, Adam, 2 CPU ranks over gloo (``--nproc``). The
variants:

- ``tutorial``: ``torchrun --max-restarts``, the DDP tutorials' loop: rank 0 saves model and
  optimizer at every epoch end, a restart resumes from the start of the epoch;
- ``disk``: ``ddpkit run --max-restarts``, the Trainer, disk snapshots at every epoch end (as the
  tutorials);
- ``memory``: the same with the snapshots in memory on (``SnapshotConfig(memory=True)``: every step,
  unless that stalls a step more than 5%);
- ``memory-in-place``: ``memory`` with ``ddpkit run --recover in-place``: the other ranks keep their
  processes, the killed one is replaced, every rank runs the script again from the copies in memory
  (docs/recovery.md);
- ``memory-new-interpreters``: ``memory`` with ``ddpkit run --fork-server off``: every worker of
  every attempt a new interpreter that imports torch, as under torchrun (the other ddpkit variants
  fork their workers from the job's fork server, :mod:`ddpkit._launch.agent.forkserver`).

Each variant runs (a) without failures and (b) with a SIGKILL of a random rank at T, 2T, ... seconds
after the launch (a kill that falls while the job is restarting waits for both ranks to be up).
Goodput = (a)'s time / (b)'s time. Steps lost per failure: the steps any rank completed before the
kill minus the step resumed from. A recovery is timed from the kill to the first step after it, in
stages, each the latest over the ranks:

    kill -> detected (the agent sees a worker gone) -> torn down (the other workers stopped)
    -> rendezvous (the agents agree on the new world) -> spawned (worker processes created)
    -> process start (the kernel's start time of the worker) -> script (the job's first line: the
    interpreter and ``ddpkit.worker`` started) -> imports (torch, ddpkit) -> init (process group)
    -> data (the data set mapped from its file) -> built (model, Trainer) -> loaded (snapshot read)
    -> first step

The data set is written to a file once, before the runs, and each start maps it
(``torch.load(mmap=True)``), as a job reads its data set: made afresh at each start (``randn`` of
30000 x 784), it would add ~0.2 s to every recovery here that is the benchmark's, not the job's.

The agent's stages come from torch's elastic agent, instrumented in the launcher's own process
(``python bench/goodput.py launch``): its methods are wrapped to write a timestamp, nothing else
changes.

    python bench/goodput.py  # T=60 s, 30000 samples x 20 epochs, every variant
    python bench/goodput.py --interval 30 --epochs 5 --variants memory,tutorial
    python bench/goodput.py --interval 30 --nproc 8 --variants memory --failures-only
    python bench/goodput.py --interval 30 --nproc 8 --epochs 2 --variants memory,memory-in-place
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "scripts" / "goodput_job.py"
STAGES = (
    "detected torn_down rendezvous spawned proc_start script imports init data built loaded "
    "first_step".split()
)


# -- the launcher, instrumented (runs in the launcher's process) -----------------------------------


def instrument_agent(timeline: str) -> None:
    """Wrap torch's elastic agent's steps so that each writes when it ends: detection of a failed
    worker, the teardown, the rendezvous, the start of the workers."""
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    out = open(timeline, "a", buffering=1)

    def mark(event: str) -> None:
        out.write(json.dumps({"event": event, "t": time.time(), "rank": -1}) + "\n")

    monitor, stop, start = (
        LocalElasticAgent._monitor_workers,
        LocalElasticAgent._stop_workers,
        LocalElasticAgent._start_workers,
    )
    rendezvous = api.SimpleElasticAgent._rendezvous

    # functools.wraps keeps each step's signature: ddpkit checks _monitor_workers' before it hooks
    # the agent, and turns its own additions off (with a warning) where the signature is not
    # torch's.
    @functools.wraps(monitor)
    def monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.state in (api.WorkerState.FAILED, api.WorkerState.UNHEALTHY):
            mark("detected")
        return result

    @functools.wraps(stop)
    def stop_workers(self, *args, **kwargs):
        result = stop(self, *args, **kwargs)
        mark("torn_down")
        return result

    @functools.wraps(rendezvous)
    def do_rendezvous(self, *args, **kwargs):
        result = rendezvous(self, *args, **kwargs)
        mark("rendezvous")
        return result

    @functools.wraps(start)
    def start_workers(self, *args, **kwargs):
        result = start(self, *args, **kwargs)
        mark("spawned")
        return result

    LocalElasticAgent._monitor_workers = monitor_workers
    LocalElasticAgent._stop_workers = stop_workers
    LocalElasticAgent._start_workers = start_workers
    api.SimpleElasticAgent._rendezvous = do_rendezvous


def launch_main(argv: list[str]) -> int:
    """``launch TIMELINE (ddpkit|torchrun) ARGS...``: the launcher, instrumented, in this
    process."""
    timeline, which, args = argv[0], argv[1], argv[2:]
    instrument_agent(timeline)
    if which == "ddpkit":
        from ddpkit._launch.cli.run import main

        return main(args)
    from torch.distributed.run import main as torchrun_main

    sys.argv = ["torchrun", *args]
    torchrun_main(args)
    return 0


# -- one run ---------------------------------------------------------------------------------------


def command(variant: str, folder: Path, timeline: Path, a: argparse.Namespace) -> list[str]:
    job = [str(JOB), str(folder / "run"), "--data", str(a.data), "--epochs", str(a.epochs)]
    job += ["--log-every", "1", "--timeline", str(timeline)]
    launch = [sys.executable, str(Path(__file__).resolve()), "launch", str(timeline)]
    if variant == "tutorial":
        torchrun = [
            "torchrun",
            "--standalone",
            "--nproc-per-node",
            str(a.nproc),
            "--max-restarts",
            "1000",
        ]
        return launch + torchrun + job + ["--mode", "tutorial"]
    ddpkit = ["ddpkit", *(["--fork-server", "off"] if variant == "memory-new-interpreters" else [])]
    ddpkit += ["--recover", "in-place"] if variant == "memory-in-place" else []
    ddpkit += [
        "--nproc",
        str(a.nproc),
        *(["--oversubscribe"] if a.nproc > (os.cpu_count() or 1) else []),
    ]
    ddpkit += ["--max-restarts", "1000", "--log-dir", str(folder / "logs")]
    return (
        launch
        + ddpkit
        + job
        + ["--mode", "trainer", *(["--memory"] if variant.startswith("memory") else [])]
    )


def workers(launcher: int, timeline: Path) -> dict[int, int]:
    """rank -> pid of the job's live worker processes: each rank's newest ``script`` event in the
    timeline names its pid (a worker forked from ddpkit's fork server shows the server's environment
    in /proc, not its RANK), kept if that process is still the launcher's child (a worker of the
    current attempt)."""
    newest: dict[int, tuple[float, int]] = {}
    for line in timeline.read_text().splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if (
                event.get("event") == "script"
                and event["t"] >= newest.get(event["rank"], (0.0, 0))[0]
            ):
                newest[event["rank"]] = (event["t"], event["pid"])
    found = {}
    for rank, (_, pid) in newest.items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == launcher and stat[0] not in ("Z", "X"):
            found[rank] = pid
    return found


def kill_every(
    proc: subprocess.Popen, interval: float, timeline: Path, rng: random.Random, nproc: int = 2
) -> None:
    """SIGKILL a random rank at ``interval``, 2 x ``interval``, ... after the launch, until the job
    ends."""
    out = open(timeline, "a", buffering=1)
    start = time.time()
    k = 1
    while proc.poll() is None:
        if time.time() < start + k * interval:
            time.sleep(0.05)
            continue
        ranks = workers(proc.pid, timeline)
        if len(ranks) < nproc:  # restarting: the kill waits for the job to be up
            time.sleep(0.05)
            continue
        rank = rng.randrange(nproc)
        try:
            os.kill(ranks[rank], signal.SIGKILL)
        except ProcessLookupError:
            continue
        out.write(
            json.dumps({"event": "kill", "t": time.time(), "rank": rank, "pid": ranks[rank]}) + "\n"
        )
        k += 1


def run(
    variant: str, failures: bool, a: argparse.Namespace, root: Path, rng: random.Random
) -> dict:
    folder = root / f"{variant}-{'failures' if failures else 'clean'}"
    folder.mkdir()
    timeline = folder / "timeline.jsonl"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    # what both launchers give 2 ranks on this machine; equal in every variant
    env["OMP_NUM_THREADS"] = "1"
    t0 = time.time()
    with open(folder / "output.txt", "w") as output:
        proc = subprocess.Popen(
            command(variant, folder, timeline, a),
            env=env,
            cwd=folder,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        killer = None
        if failures:
            killer = threading.Thread(
                target=kill_every, args=(proc, a.interval, timeline, rng, a.nproc), daemon=True
            )
            killer.start()
        code = proc.wait()
        if killer is not None:
            killer.join()
    seconds = time.time() - t0
    if code != 0:
        raise SystemExit(f"{variant}: the job failed (exit {code}); see {folder / 'output.txt'}")
    return {"variant": variant, "failures": failures, "seconds": seconds, **analyse(timeline)}


# -- analysis --------------------------------------------------------------------------------------


def analyse(timeline: Path) -> dict:
    """Kills, steps lost and recovery stages from a run's timeline."""
    events = [json.loads(line) for line in timeline.read_text().splitlines()]
    events.sort(key=lambda e: e["t"])
    kills = [e for e in events if e["event"] == "kill"]
    recoveries = []
    for i, kill in enumerate(kills):
        end = kills[i + 1]["t"] if i + 1 < len(kills) else float("inf")
        before = [e for e in events if e["t"] <= kill["t"]]
        after = [e for e in events if kill["t"] < e["t"] < end]
        done = max((e["step"] for e in before if e["event"] == "step"), default=0)
        stages = {}
        for stage in STAGES:
            times = [e["t"] for e in after if e["event"] == stage]
            if stage in ("detected", "torn_down", "rendezvous", "spawned"):
                stages[stage] = min(times) if times else None  # the agent's first, after this kill
            else:  # each rank's first after the kill; the stage ends with the latest rank
                firsts = {}
                for e in after:
                    if e["event"] == stage and e["rank"] not in firsts:
                        firsts[e["rank"]] = e["t"]
                stages[stage] = max(firsts.values()) if firsts else None
        loaded = [e["step"] for e in after if e["event"] == "loaded"]
        if stages["first_step"] is None or not loaded:
            # The next kill came before a step (or the job ended): all the time until then was lost;
            # the steps to redo are counted at the next kill, which finds the same steps done.
            until = end if end != float("inf") else max(e["t"] for e in events)
            recoveries.append(
                {
                    "lost": 0,
                    "seconds": until - kill["t"],
                    "t": kill["t"],
                    "stages": {},
                    "whole": False,
                }
            )
            continue
        recoveries.append(
            {
                "whole": True,
                "lost": done - min(loaded),
                "seconds": stages["first_step"] - kill["t"],
                "t": kill["t"],
                "stages": {
                    s: (t - kill["t"] if t is not None else None) for s, t in stages.items()
                },
            }
        )
    done = [e for e in events if e["event"] == "done"]
    stalls = [s for e in done for s in e.get("memory_stalls", [])]
    steps = sorted(e["t"] for e in events if e["event"] == "step" and e["rank"] == 0)
    step_time = (
        statistics.median(b - a for a, b in zip(steps, steps[1:])) if len(steps) > 2 else None
    )
    return {
        "kills": len(kills),
        "recoveries": recoveries,
        "stall_median": statistics.median(stalls) if stalls else None,
        "step_median": step_time,
    }


def lost_seconds(result: dict) -> float:
    """Time the failures of a run cost it: each recovery (kill to the first step after it) and the
    steps it redid, at the run's median step time."""
    return sum(r["seconds"] + r["lost"] * result["step_median"] for r in result["recoveries"])


def stage_table(recoveries: list[dict]) -> list[str]:
    """Each stage's median time since the stage before it (seconds), over the recoveries that saw
    every stage."""
    whole = [
        r["stages"]
        for r in recoveries
        if r["whole"] and all(r["stages"].get(s) is not None for s in STAGES)
    ]
    rows, previous = [], "kill"
    for stage in STAGES:
        values = [s[stage] - (0.0 if previous == "kill" else s[previous]) for s in whole]
        if values:
            rows.append(f"{previous} -> {stage} {statistics.median(values):.2f}")
        previous = stage
    return rows


def report(results: list[dict], a: argparse.Namespace) -> str:
    import torch

    lines = [
        f"goodput: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, python "
        f"{platform.python_version()}, "
        f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}",
        f"job: the DDP tutorials' CNN on {a.samples} synthetic 28x28 samples x {a.epochs} epochs, "
        f"batch 32 per rank, {a.nproc} ranks (gloo, 1 thread each); a SIGKILL of a random rank "
        f"every {a.interval:.0f} s",
        "",
        "| variant | (a) no failure, s | (b) with failures, s | failures | goodput (a)/(b) | "
        "goodput within (b) | steps lost per failure (median, max) | recovery, s (median) | "
        "snapshot stall / step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["variant"], r["failures"]): r for r in results}
    for variant in a.variants:
        clean, failed = by.get((variant, False)), by.get((variant, True))
        if failed is None:
            continue
        rec = [r for r in failed["recoveries"] if r["whole"]]
        lost = [r["lost"] for r in rec]
        # the stall of the copy: from (b) where (a) was not run (--failures-only)
        timed = clean or failed
        stall = (
            f"{1e6 * timed['stall_median']:.0f} us / {1e3 * timed['step_median']:.1f} ms "
            f"({100 * timed['stall_median'] / timed['step_median']:.1f}%)"
            if timed["stall_median"]
            else "-"
        )
        ratio = f"{100 * clean['seconds'] / failed['seconds']:.1f}%" if clean is not None else "-"
        lines.append(
            f"| {variant} | {clean['seconds'] if clean is not None else float('nan'):.1f} | "
            f"{failed['seconds']:.1f} | {failed['kills']} | {ratio} | "
            f"{100 * (1 - lost_seconds(failed) / failed['seconds']):.1f}% | "
            f"{statistics.median(lost) if lost else '-'}, {max(lost) if lost else '-'} | "
            f"{statistics.median(r['seconds'] for r in rec) if rec else float('nan'):.2f} | "
            f"{stall} |"
        )
    lines += [
        "",
        "goodput within (b): 1 - (the failures' recoveries + the steps they redid at (b)'s median "
        "step time) / (b)'s time; unlike (a)/(b) it does not depend on the machine's load being "
        "the same in two runs.",
        "",
    ]
    for variant in a.variants:
        failed = by.get((variant, True))
        whole = [r for r in (failed or {}).get("recoveries", []) if r["whole"]]
        if whole:
            lines.append(
                f"{variant}: where a recovery's time goes (median over {len(whole)}, s): "
                + "; ".join(stage_table(failed["recoveries"]))
            )
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "launch":
        raise SystemExit(launch_main(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--interval", type=float, default=60.0, help="seconds between kills (default 60)"
    )
    p.add_argument("--samples", type=int, default=30000)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--variants", default="tutorial,disk,memory,memory-new-interpreters")
    p.add_argument("--seed", type=int, default=0, help="which rank each kill hits")
    p.add_argument(
        "--nproc",
        type=int,
        default=2,
        help="ranks (the DDP tutorials' torchrun and ddpkit run alike)",
    )
    p.add_argument(
        "--failures-only", action="store_true", help="(b) alone: goodput within the failed run"
    )
    p.add_argument("--dir", default=None, help="where the runs go (default: a temporary folder)")
    p.add_argument("--report", action="store_true", help="only analyse the runs already in --dir")
    a = p.parse_args()
    a.variants = a.variants.split(",")
    if a.report:
        results = []
        for variant in a.variants:
            for failures in (False, True):
                folder = Path(a.dir) / f"{variant}-{'failures' if failures else 'clean'}"
                if not folder.exists():  # --failures-only
                    continue
                seconds = next(
                    r["seconds"]
                    for r in json.loads((Path(a.dir) / "results.json").read_text())
                    if r["variant"] == variant and r["failures"] == failures
                )
                results.append(
                    {
                        "variant": variant,
                        "failures": failures,
                        "seconds": seconds,
                        **analyse(folder / "timeline.jsonl"),
                    }
                )
        print(report(results, a))
        return
    root = Path(a.dir or tempfile.mkdtemp(prefix="goodput-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    a.data = root / "data.pt"
    subprocess.run(
        [sys.executable, str(JOB), "-", "--samples", str(a.samples), "--make-data", str(a.data)],
        check=True,
    )
    results = []
    # (a) then (b) of each variant, back to back: the machine's load alike
    for variant in a.variants:
        for failures in (True,) if a.failures_only else (False, True):
            results.append(run(variant, failures, a, root, rng))
            print(
                json.dumps({k: v for k, v in results[-1].items() if k != "recoveries"}), flush=True
            )
    (root / "results.json").write_text(json.dumps(results, indent=1))
    print(report(results, a))
    print(f"\nruns and timelines: {root}")


if __name__ == "__main__":
    main()
