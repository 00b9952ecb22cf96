"""`ddpkit plot RUN_DIR`: a run's curves from metrics.jsonl to a PNG."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ddpkit
from ddpkit.tracking.curves import panels, read_curves

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from train_job import train  # noqa: E402


def test_ddpkit_plot_draws_a_trained_run(tmp_path, clean_env):
    ddpkit.spawn(lambda: train(str(tmp_path / "run"), epochs=2, early_stopping_patience=5, log_every_steps=5), 1)
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
    assert sorted(curves["train/loss"]) == [5, 10, 15, 20] and sorted(curves["val/loss"]) == [10, 20]
    assert panels(curves)[0] == ("loss", ["train/loss", "train/epoch_loss", "val/loss"])
    assert [title for title, _ in panels(curves)[1:]] == ["val/accuracy", "lr"]


def test_redone_steps_draw_the_later_record_and_a_missing_run_is_named(tmp_path):
    records = [
        {"kind": "train", "step": 5, "train/loss": 0.9},
        {"kind": "event", "step": 5, "event": "resume"},
        {"kind": "train", "step": 5, "train/loss": 0.7},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"kind": "tr')
    assert read_curves(tmp_path) == {"train/loss": {5: 0.7}}  # and the half-written last line is skipped
    with pytest.raises(ddpkit.ConfigError, match="no .*metrics.jsonl: give the run directory"):
        read_curves(tmp_path / "nowhere")
