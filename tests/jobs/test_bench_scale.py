"""``bench/scale.py --quick --variants whole,in-place`` runs: jobs of 2 and 4 ranks at 10 and 1,000
parameter tensors, each with a whole restart and a recovery in place, every cost of the report
measured and fitted. The figures themselves are the benchmark's, not a test's
(docs/scale.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

MEASURED = [
    "launch to first step",
    "restart to first step",
    "recovery in place to first step",
    "memory copy",
    "save (whole)",
    "save: planned",
    "async save: stall",
    "load (whole)",
    "load: read",
    "evaluate (whole)",
    "split_world (whole)",
]


@pytest.mark.extended
@pytest.mark.timeout(1500)  # eight jobs, each with a restart or a recovery after a SIGKILL
def test_the_quick_scale_benchmark_measures_and_fits_every_cost(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "scale.py"), "--quick", "--dir", str(tmp_path)]
        + ["--variants", "whole,in-place"],
        capture_output=True,
        text=True,
        # within the test's own 900 s, so that a slow run fails here, with the bench's output
        timeout=1440,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for tensors in (10, 1000):
        for n, variant in [(n, v) for n in (2, 4) for v in ("", "-in-place")]:
            folder = tmp_path / f"n{n}-t{tensors}{variant}"
            assert json.loads((folder / "result.json").read_text())["exit"] == 0, (
                folder / "output.txt"
            ).read_text()
            # The bench's timers wrap torch's agent without hiding it from ddpkit's check: ddpkit's
            # agent ran.
            assert "is not what ddpkit relies on" not in (folder / "output.txt").read_text()
    fits = json.loads((tmp_path / "fits.json").read_text())
    for tensors in ("10", "1000"):
        for name in MEASURED:
            assert fits[tensors].get(name) is not None, (tensors, name)
            assert math.isfinite(fits[tensors][name]["b"]), (tensors, name)
    assert "| save (whole) |" in out.stdout and "| load (whole) |" in out.stdout
