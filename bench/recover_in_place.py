"""In-place recovery against the whole-job restart: the same Trainer job (``tests/jobs/scripts/
memory_job.py``, copies in memory every step) under ``ddpkit run --max-restarts 1``, its last rank
SIGKILLed after step 9, with ``--recover in-place`` and without, at each world size, in one run;
the exponent b of ``a * n^b`` fitted to the in-place times.

Per job: the seconds from the kill (the killed rank's last file, written just before its SIGKILL) to
the state loaded again (the ``resume`` record, written by rank 0 once every rank loaded), and, in
place, the phases: detect (kill to the agent's first sight), then the ``recover`` record's. These
are wall clocks on this machine: with more ranks than cores they count the waits for a core. "A
core a rank" estimates the recovery with one, as ``bench/scale.py`` does (:func:`share`).

    python bench/recover_in_place.py                 # 2, 8, 32 ranks, 3 jobs each way
    python bench/recover_in_place.py --sizes 2,4 --repeats 1
    python bench/recover_in_place.py --sizes 2,4,8,16,32 --report DIR   # the tables again
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
    return measure(folder, n)


def measure(folder: Path, n: int) -> dict:
    """One job's figures, from its folder."""
    killed = next(folder.glob("killed-*")).stat().st_mtime
    records = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").open()]
    resumed = next(r for r in records if r.get("event") == "resume")
    recover = next((r for r in records if r.get("event") == "recover"), None)
    output = (folder / "output.txt").read_text()
    if "--recover" in folder.name or folder.name.split("-")[1] == "True":
        if recover is None:  # given back to the whole-job restart: the output says why
            why = [line for line in output.splitlines() if "not recovered in place" in line]
            print(f"  {n} ranks, {folder.name}: not recovered in place ({why})")
    phases = None
    if recover is not None:  # the agent's first sight of the failure, from its record
        go = json.loads(next(folder.glob("logs/*/recover/go-1")).read_text())
        phases = {"detect": round(go["seen"] - killed, 4), **recover["seconds"]}
    return {"kill to loaded": resumed["time"] - killed, "phases": phases}


def share(phases: dict, n: int) -> float:
    """The recovery with a core a rank, estimated as bench/scale.py does: the ranks' phases (leave,
    regroup, restore) scaled by the share of a core each had (n ranks on c cores: c/n), the agent's
    (detect, decide) as measured."""
    part = min(1.0, (os.cpu_count() or 1) / n)
    agent = phases["detect"] + phases["decide"]
    return agent + part * (phases["leave"] + phases["regroup"] + phases["restore"])


def exponent(points: list[tuple[int, float]]) -> float:
    """b of a * n^b, by least squares on logs."""
    xs, ys = [math.log(n) for n, _ in points], [math.log(t) for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="2,8,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--report", default=None, metavar="DIR", help="the tables again, from DIR")
    a = p.parse_args()
    root = Path(a.report) if a.report else Path(tempfile.mkdtemp(prefix="recover-bench-"))
    print(f"{os.cpu_count()} cores; median of {a.repeats} jobs each way; folders in {root}")
    print(
        f"{'ranks':>5} {'whole restart':>14} {'in place':>9} {'ratio':>6} {'a core a rank':>14}"
        "  in place's phases (s)"
    )
    walls: list[tuple[int, float]] = []
    shares: list[tuple[int, float]] = []
    for n in map(int, a.sizes.split(",")):
        got: dict[bool, list[dict]] = {True: [], False: []}
        for i in range(a.repeats):  # alternated: the machine's load falls on both alike
            for in_place in (False, True):
                folder = root / f"n{n}-{in_place}-{i}"
                got[in_place].append(measure(folder, n) if a.report else one(n, in_place, folder))
        whole, place = (
            statistics.median(r["kill to loaded"] for r in got[k]) for k in (False, True)
        )
        recovered = [r["phases"] for r in got[True] if r["phases"] is not None]
        phases = {k: round(statistics.median(p[k] for p in recovered), 3) for k in recovered[0]}
        core = statistics.median(share(p, n) for p in recovered)
        print(
            f"{n:>5} {whole:>13.3f}s {place:>8.3f}s {place / whole:>6.2f} {core:>13.3f}s  {phases}"
        )
        walls.append((n, place))
        shares.append((n, core))
    if len(walls) > 1:
        sizes = ", ".join(str(n) for n, _ in walls)
        print(
            f"in place: exponent {exponent(walls):.2f} (wall clock), "
            f"{exponent(shares):.2f} (a core a rank) over {sizes} ranks"
        )


if __name__ == "__main__":
    main()
