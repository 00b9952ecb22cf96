"""In-place recovery at its edges: what each failure at an edge of a recovery cost, on 4 CPU
processes of the Trainer with copies in memory after every step (``tests/jobs/scripts/
recover_job.py --trainer``), one run per edge under ``ddpkit run --recover in-place``.

For each edge: how it ended (in place, or the fallback the summary names), the recoveries it took,
and rank 0's ``recover`` records (``metrics.jsonl``): from the failure's first sign to the state
loaded (``total``), split into ``leave``, ``decide``, ``regroup`` and ``restore``; a failure before
the ranks' group has no step to leave, and its ``total`` counts from the agent's first look.

    python bench/recover_edges.py                  # every edge, 4 ranks
    python bench/recover_edges.py --edges three-at-once,raise-before-init --nproc 4
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "jobs" / "scripts" / "recover_job.py"

# KIND:RANK:ATTEMPT[:ARG] (recover_job.py's), the attempt being the run's restart count
EDGES = {
    "raise-before-init": ["raise-before-init:2:0"],
    "killed-as-peers-make-the-group": ["sleep-before-init:0:0:3", "kill-before-init:1:0"],
    "killed-while-the-group-is-made": [
        "sleep-before-init:3:0:3", "sleep-before-init:1:0:1", "kill-before-init:1:0",
    ],
    "killed-during-the-regroup": ["kill-after-step:1:0:20", "kill-before-init:2:1"],
    "replacement-dies-as-it-starts": ["kill-after-step:1:0:20", "kill-before-init:1:1"],
    "one-rank": ["kill-after-step:1:0:20"],
    "two-at-once": ["kill-after-step:1:0:20", "kill-after-step:2:0:20"],
    "three-at-once": [f"kill-after-step:{r}:0:20" for r in (1, 2, 3)],
    "all-but-one-rank-0-among-them": [f"kill-after-step:{r}:0:20" for r in (0, 2, 3)],
    "survivor-stopped-before-the-regroup": ["kill-after-step:1:0:20", "stop-after-step:2:0:20"],
    "survivor-stopped-during-the-regroup": ["kill-after-step:1:0:20", "stop-before-init:2:1"],
    "survivor-stopped-after-the-regroup": ["stop-after-step:2:0:30"],
}  # fmt: skip


def run(edge: str, fails: list[str], nproc: int, work: Path) -> dict:
    folder = work / edge
    (folder / "log").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "PET_"))}
    env["PYTHONPATH"] = f"{ROOT / 'src'}{os.pathsep}{ROOT}"
    plan = [x for fail in fails for x in ("--fail", fail)]
    argv = [
        sys.executable, "-m", "ddpkit.cli", "run", "--nproc", str(nproc), "--max-restarts", "6",
        "--recover", "in-place", "--log-dir", str(folder / "logs"), str(JOB), str(folder / "run"),
        "--log", str(folder / "log"), "--trainer", "--steps", "40", *plan,
    ]  # fmt: skip
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, cwd=folder, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    metrics = folder / "run" / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    recovers = [r for r in records if r.get("event") == "recover"]
    fallback = re.findall(r"not recovered in place[^\n]*", done.stderr)
    return {
        "edge": edge, "code": done.returncode, "wall": wall, "recovers": recovers,
        "in_place": len(re.findall(r"recovering in place \(recovery", done.stderr)),
        "fallback": fallback[0] if fallback else "",
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--edges", default=",".join(EDGES))
    p.add_argument("--nproc", type=int, default=4)
    a = p.parse_args()
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    print(
        f"in-place recovery at its edges: {platform.node()}, {os.cpu_count()} cores, torch "
        f"{torch.__version__}, {a.nproc} ranks (gloo), the Trainer, copies in memory every step; "
        f"{now}"
    )
    print("| edge | ended | recoveries | total, s | leave | decide | regroup | restore |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="recover-edges-") as work:
        for edge in a.edges.split(","):
            got = run(edge, EDGES[edge], a.nproc, Path(work))
            ended = (
                "in place"
                if got["code"] == 0 and not got["fallback"]
                else (got["fallback"] or f"exit {got['code']}")
            )
            for r in got["recovers"] or [{"seconds": {}}]:
                s = r["seconds"]
                cells = [f"{s[k]:.2f}" if k in s else "" for k in
                         ("total", "leave", "decide", "regroup", "restore")]  # fmt: skip
                print(f"| {edge} | {ended} | {got['in_place']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
