"""`ddpkit plot RUN_DIR` on a hand-written metrics.jsonl: a redone step draws its later record, a
missing run is named."""

from __future__ import annotations

import json

import pytest

import ddpkit
from ddpkit.tracking._curves import read_curves


def test_redone_steps_draw_the_later_record_and_a_missing_run_is_named(tmp_path):
    records = [
        {"kind": "train", "step": 5, "train/loss": 0.9},
        {"kind": "event", "step": 5, "event": "resume"},
        {"kind": "train", "step": 5, "train/loss": 0.7},
    ]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in records) + '{"kind": "tr'
    )
    # and the half-written last line is skipped
    assert read_curves(tmp_path) == {"train/loss": {5: 0.7}}
    with pytest.raises(ddpkit.ConfigError, match="no .*metrics.jsonl: give the run directory"):
        read_curves(tmp_path / "nowhere")
