"""`ddpkit plot RUN_DIR`: a trained run's curves from metrics.jsonl to a PNG."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddpkit.testing import run_on_ranks
from ddpkit.tracking._curves import RANKS_PANEL, panels, read_curves
from tests.jobs.scripts.train_job import train


@pytest.mark.heavy
def test_ddpkit_plot_draws_a_trained_run(tmp_path, clean_env):
    run_on_ranks(
        lambda: train(
            str(tmp_path / "run"), epochs=2, early_stopping_patience=5, log_every_steps=5
        ),
        1,
    )
    done = subprocess.run(
        [sys.executable, "-m", "ddpkit.cli", "plot", str(tmp_path / "run")],
        env=clean_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    png = tmp_path / "run" / "curves.png"
    assert f"wrote {png}" in done.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    curves = read_curves(tmp_path / "run")
    assert sorted(curves["train/loss"]) == [5, 10, 15, 20] and sorted(curves["val/loss"]) == [
        10,
        20,
    ]
    assert panels(curves)[0] == ("loss", ["train/loss", "train/epoch_loss", "val/loss"])
    assert [title for title, _ in panels(curves)[1:]] == [
        "val/accuracy",
        "lr",
        "samples_per_s",
        RANKS_PANEL,
    ]
