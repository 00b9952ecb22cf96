"""In-place recovery against the whole-job restart: the same Trainer job (``tests/jobs/scripts/
memory_job.py``, copies in memory every step) under ``ddpkit run --max-restarts 1``, its last rank
SIGKILLed after step 9, with ``--recover in-place`` and without, at each world size, in one run;
the exponent b of ``a * n^b`` fitted to the in-place times.

Per job: the seconds from the kill (the killed rank's last file, written just before its SIGKILL) to
the state loaded again (the ``resume`` record, written by rank 0 once every rank loaded), and, in
place, the ``recover`` record's phases. Both are wall clocks on this machine: with more ranks than
cores they count the waits for a core.

    python bench/recover_in_place.py                 # 2, 8, 32 ranks, 3 jobs each way
    python bench/recover_in_place.py --sizes 2,4 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one(n: int, in_place: bool, folder: Path) -> dict:
    folder.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "DDPKIT_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "ddpkit.cli", "run", "--nproc", str(n), "--oversubscribe"]
    cmd += ["--max-restarts", "1", "--log-dir", str(folder / "logs")]
    cmd += ["--recover", "in-place"] if in_place else []
    cmd += ["-m", "tests.jobs.scripts.memory_job", str(folder / "run"), "--log", str(folder)]
    # 96 samples a step at every size (3 a rank at 32 ranks), 3 steps an epoch
    cmd += ["--global-batch", "96", "--epochs", "6"]
    cmd += ["--kill-rank", str(n - 1), "--kill-after-step", "9", "--no-sync-bn"]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    (folder / "output.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    killed = next(folder.glob("killed-*")).stat().st_mtime
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").open()]
    resumed = next(r for r in records if r.get("event") == "resume")
    recover = next((r for r in records if r.get("event") == "recover"), None)
    if in_place and recover is None:  # given back to the whole-job restart: the output says why
        why = [line for line in done.stderr.splitlines() if "not recovered in place" in line]
        print(f"  {n} ranks, {folder.name}: not recovered in place ({why})")
    return {"kill to loaded": resumed["time"] - killed, "phases": recover and recover["seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2,8,32")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="recover-bench-"))
    print(f"{os.cpu_count()} cores; median of {a.repeats} jobs each way; folders in {root}")
    print(f"{'ranks':>5} {'whole restart':>14} {'in place':>9} {'ratio':>6}  in place's phases (s)")
    points: list[tuple[int, float]] = []
    for n in map(int, a.sizes.split(",")):
        got: dict[bool, list[dict]] = {True: [], False: []}
        for i in range(a.repeats):  # alternated: the machine's load falls on both alike
            for in_place in (False, True):
                got[in_place].append(one(n, in_place, root / f"n{n}-{in_place}-{i}"))
        whole, place = (
            statistics.median(r["kill to loaded"] for r in got[k]) for k in (False, True)
        )
        recovered = [r["phases"] for r in got[True] if r["phases"] is not None]
        phases = {k: round(statistics.median(p[k] for p in recovered), 3) for k in recovered[0]}
        print(f"{n:>5} {whole:>13.3f}s {place:>8.3f}s {place / whole:>6.2f}  {phases}")
        points.append((n, place))
    if len(points) > 1:  # least squares on logs
        xs, ys = [math.log(n) for n, _ in points], [math.log(t) for _, t in points]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        print(f"in place: exponent {b:.2f} over {', '.join(str(n) for n, _ in points)} ranks")


if __name__ == "__main__":
    main()
