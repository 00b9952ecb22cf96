"""Validation every N steps and the weights files in one process (no launcher): where they go, what
they hold."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit._errors import ConfigError
from ddpkit.training._config import EarlyStoppingConfig, LoggingConfig
from ddpkit.training._trainer import TrainerConfig


def fit(run_dir, with_val: bool = True, **options) -> ddpkit.Trainer:
    trainer = build(run_dir, with_val, **options)
    trainer.fit()
    return trainer


def build(run_dir, with_val: bool = True, **options) -> ddpkit.Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(32, 4)
    data = torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())
    config = TrainerConfig(
        run_dir=str(run_dir),
        batch_size=8,
        logging=LoggingConfig(progress=False),
        num_workers=0,
        **options,
    )
    return ddpkit.Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        config,
        val_data=data if with_val else None,
    )


def test_validation_every_3_steps_across_epoch_ends(tmp_path, capsys):
    es = EarlyStoppingConfig(metric="val/loss", patience=None)
    trainer = fit(tmp_path, epochs=3, val_every_steps=3, early_stopping=es)  # 4 steps an epoch
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val/loss"] for r in records if r["kind"] == "val"}
    assert sorted(val) == [3, 6, 9, 12]
    assert not [k for r in records if r["kind"] == "epoch" for k in r if k.startswith("val/")]
    best = torch.load(tmp_path / "best.pt", weights_only=True)
    assert best["value"] == min(val.values()) and val[best["step"]] == best["value"]
    assert f"best val/loss {best['value']:.4g} at step {best['step']}" in capsys.readouterr().out
    from safetensors.torch import load_file

    final = load_file(tmp_path / "final.safetensors")
    assert all(
        torch.equal(final[k], v) for k, v in ddpkit.unwrap(trainer.model).state_dict().items()
    )


def test_val_every_steps_without_val_data_is_refused(tmp_path):
    with pytest.raises(
        ConfigError, match=r"val_every_steps=3 needs validation data: pass Trainer\(..., val_data"
    ):
        fit(tmp_path, with_val=False, val_every_steps=3)


@pytest.mark.parametrize(("fmt", "files"), [("pt", ["final_weights.pt"]), (None, [])])
def test_the_weights_format_names_the_files(tmp_path, fmt, files):
    trainer = fit(tmp_path, weights_format=fmt)
    found = sorted(p.name for p in tmp_path.glob("final*"))
    assert found == files
    if fmt == "pt":
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        model.load_state_dict(
            torch.load(tmp_path / "final_weights.pt", weights_only=True), strict=True
        )
        assert torch.equal(model[0].weight, ddpkit.unwrap(trainer.model)[0].weight)


def test_a_resume_with_another_val_every_steps_is_refused(tmp_path):
    es = EarlyStoppingConfig(metric="val/loss", patience=2)
    fit(tmp_path, epochs=1, val_every_steps=3, early_stopping=es)
    with pytest.raises(
        ConfigError, match=r"TrainerConfig.val_every_steps: 3 in the snapshot, 2 now"
    ):
        fit(tmp_path, epochs=2, val_every_steps=2, early_stopping=es)
    # control: the same
    assert fit(tmp_path, epochs=2, val_every_steps=3, early_stopping=es).resumed_from == 4


def test_a_run_resumed_after_its_last_validation_returns_it_and_says_so(tmp_path, capsys):
    # Validations at steps 4 and 8 of a run stopped at step 10; resumed to step 11, no validation
    # falls after the resume: fit() still returns the latest one (step 8), kept by the snapshot, and
    # the summary says where.
    first = fit(tmp_path, epochs=3, val_every_steps=4, max_steps=10)
    assert first.step == 10
    capsys.readouterr()
    trainer = build(tmp_path, epochs=3, val_every_steps=4, max_steps=11)
    metrics = trainer.fit()
    assert trainer.resumed_from == 10 and trainer.step == 11
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val/loss"] for r in records if r["kind"] == "val"}
    assert sorted(val) == [4, 8]
    assert metrics["val/loss"] == val[8]
    summary = capsys.readouterr().out
    assert any(
        line.startswith("  latest validation, at step 8:") and f"val/loss {val[8]:.4g}" in line
        for line in summary.splitlines()
    )
