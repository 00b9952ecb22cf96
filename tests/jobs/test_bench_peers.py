"""``bench/peers.py`` end to end, one round of short jobs (``--keep-first``): every framework runs
under torchrun and gets a ratio to raw DDP, and a peer that is not installed is skipped, saying so,
while the rest run. The figures themselves are the benchmark's, not a test's (docs/speed.md)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs.conftest import clean_environ

ROOT = Path(__file__).resolve().parents[2]
BENCH = str(ROOT / "bench" / "peers.py")
SHORT = ["--rounds", "1", "--keep-first", "--steps", "5", "--warmup", "2"]
PEERS = {"accelerate": "accelerate", "fabric": "lightning", "lightning": "lightning"}


def _bench(args: list[str], env: dict[str, str], out: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, BENCH, *SHORT, "--json", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        # within the test's own 900 s, so that a slow run fails here, with the bench's output
        timeout=840,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {"stdout": proc.stdout, **json.loads(out.read_text())}


@pytest.mark.extended
@pytest.mark.timeout(900)  # 6 torchrun jobs; Lightning's import alone takes seconds
def test_every_installed_framework_gets_a_finite_ratio_to_raw_ddp(tmp_path):
    missing = {name for name, package in PEERS.items() if importlib.util.find_spec(package) is None}
    report = _bench([], clean_environ(), tmp_path / "peers.json")
    ran = set(report["frameworks"])
    assert ran == {"raw", "ddpkit-loop", "ddpkit-trainer", *PEERS} - missing, report["stdout"]
    assert set(report["skipped"]) == missing
    for name, figures in report["frameworks"].items():
        assert math.isfinite(figures["ratio"]) and figures["ratio"] > 0, (name, figures)
        assert math.isfinite(figures["step_ms"]) and figures["step_ms"] > 0, (name, figures)
    assert report["frameworks"]["raw"]["ratio"] == 1.0
    if missing:
        print(f"not installed, skipped by the bench: {sorted(missing)} (pip install -e '.[bench]')")


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_a_peer_that_is_not_installed_is_skipped_and_the_rest_run(tmp_path):
    """Accelerate hidden from the driver (a ``sitecustomize`` that marks it missing, as in an
    install without the ``bench`` extra): raw DDP still runs, and Accelerate is named as skipped,
    with what to install."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['accelerate'] = None\n")
    env = clean_environ()
    env["PYTHONPATH"] = f"{site}:{env['PYTHONPATH']}"
    report = _bench(["--only", "raw,accelerate"], env, tmp_path / "peers.json")
    assert set(report["frameworks"]) == {"raw"}
    assert report["skipped"] == {"accelerate": "accelerate is not installed"}
    assert 'skipped: accelerate is not installed (pip install -e ".[bench]")' in report["stdout"]
