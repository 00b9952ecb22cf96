"""``ddpkit bench`` end to end at 1-2 ranks: the table, the JSON and the plot it writes."""

import json
from pathlib import Path

import pytest

from ddpkit.testing import run_job, run_on_ranks
from tests.jobs.conftest import clean_environ

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # several jobs end to end
def test_bench_end_to_end_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "out"
    options = ["--steps", "6", "--warmup", "2", "--rounds", "1", "--no-knobs"]
    options += ["--predict", "1,2,16", "--out", str(out)]
    proc = run_job(
        None, command="bench", launcher_args=options, env=clean_environ(), cwd=ROOT, timeout=180
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    text = proc.stdout
    for heading in (
        "Measured on this machine",
        "All-reduce alone",
        "Predicted from the 1-rank run",
        "Predicted at larger world sizes",
        "assumptions:",
        "DataParallel / one GPU: skipped",
    ):
        assert heading in text, text
    result = json.loads((out / "bench.json").read_text())
    assert set(result["scaling"]) == {"1", "2"}
    for n in ("1", "2"):
        parts = result["scaling"][n]["parts"]
        assert 0 < parts["forward"] < parts["step"] and 0 < parts["backward"] < parts["step"]
    fit = result["allreduce"]["2"]
    assert fit["alpha_s"] > 0 and fit["bus_bandwidth_bytes_per_s"] > 0
    assert [r["world_size"] for r in result["predictions"]["larger"]["infiniband"]["rows"]] == [
        1,
        2,
        16,
    ]
    row = result["predictions"]["this_machine"][0]
    assert row["world_size"] == 2 and row["measured_step_s"] > 0
    assert row["error"] == pytest.approx(row["step_s"] / row["measured_step_s"] - 1)
    # on the CPU: the buckets' all-reduce timed in a step's rhythm
    assert row["allreduce_in_step_s"] > 0
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def _lm_steps():
    from ddpkit.tools._measure import Knobs, measure_steps

    return measure_steps("lm", Knobs(), 3, 1, False, False)


@pytest.mark.slow
def test_the_step_timer_runs_the_built_in_language_model_on_two_ranks():
    from ddpkit.demo._datasets import CHARS
    from ddpkit.demo._models import TinyGPT

    runs = run_on_ranks(_lm_steps, 2)
    gpt_bytes = sum(p.numel() * 4 for p in TinyGPT(len(CHARS)).parameters())
    for r in runs:
        assert 0 < r["medians"]["forward"] < r["medians"]["step"] and r["batch_size"] == 8
        assert sum(r["param_bytes"]) == gpt_bytes  # the LM's parameters are what DDP all-reduces
