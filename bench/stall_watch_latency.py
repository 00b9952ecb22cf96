"""Seconds from a rank's stall to the launcher naming it, and to the job's end, under
``ddpkit run``.

A two-rank job (``tests/jobs/scripts/stall_job.py``: a hand-written DDP loop over a ``build_loader``
loader, one ``ddpkit.all_reduce`` a step) where rank 1 stalls after step 5, by SIGSTOP or by
sleeping in user code; ``--stall-timeout 3``. The stall's time is what rank 1 prints just before it;
the naming's, when the launcher's line ``rank 1 stalled:`` comes out; the end, when ``ddpkit run``
exits. Median of N runs each.

    python bench/stall_watch_latency.py            # 3 runs of each
    python bench/stall_watch_latency.py --runs 5 --floor 10
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.jobs.launch.stall_jobs import run_stall_job  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--floor", default="3")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")} | {
        "PYTHONUNBUFFERED": "1"
    }
    print(
        f"date {datetime.date.today()}  python {platform.python_version()}  {os.cpu_count()} cores "
        "(shared)"
    )
    for mode in ("stop", "sleep"):
        named, ended = [], []
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                out = run_stall_job(
                    ["--stall-timeout", args.floor, "--collective-timeout", "120"],
                    [mode],
                    env,
                    Path(tmp),
                )
            if out.to_named is None or out.to_end is None:
                print(f"{mode}: not named ({out.returncode})\n{out.stderr[-2000:]}")
                continue
            named.append(out.to_named)
            ended.append(out.to_end)
        if named:
            print(
                f"{mode:5s} --stall-timeout {args.floor}: to the named summary median "
                f"{statistics.median(named):.1f} s {[round(t, 1) for t in named]}, to the job's "
                f"end median {statistics.median(ended):.1f} s {[round(t, 1) for t in ended]}"
            )


if __name__ == "__main__":
    main()
