"""Validation of a step function's Trainer in one process: ``val_data`` without a ``metric_fn`` and
a metric-driven scheduler without a metric to step on are refused, naming the option; a
metric-driven scheduler steps at validations, beside another optimizer's that steps every epoch or
step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit._errors import ConfigError
from ddpkit.training._config import EarlyStoppingConfig, LoggingConfig, TrainerConfig

DATA = TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(1)))


def step_fn(step: Any) -> None:
    for (x,) in step.micro_batches():
        step.backward(step.models["net"](x).pow(2).mean(), "body", "head")
    step.optimizer_step("body")
    step.optimizer_step("head")


def metric_fn(models: dict[str, nn.Module], batch: Any) -> dict[str, torch.Tensor]:
    return {"one": torch.ones(len(batch[0]))}  # never improves: the plateau counts each


def build(tmp_path: Any, plateau: bool = True, metric: str | None = "val/one", **kw: Any):
    given = {"val_data": DATA, "metric_fn": metric_fn} | kw.pop("given", {})
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizers = {
        "body": torch.optim.SGD(net[0].parameters(), lr=0.1),
        "head": torch.optim.SGD(net[2].parameters(), lr=0.1),
    }
    schedulers: dict[str, Any] = {
        "body": torch.optim.lr_scheduler.StepLR(optimizers["body"], 1, gamma=0.5)
    }
    if plateau:
        schedulers["head"] = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizers["head"], factor=0.5, patience=0
        )
    config = TrainerConfig(
        run_dir=str(tmp_path / "run"), epochs=2, batch_size=8, num_workers=0,
        logging=LoggingConfig(progress=False), early_stopping=EarlyStoppingConfig(
            metric=metric, patience=None), **kw,
    )  # fmt: skip
    trainer = ddpkit.Trainer(
        {"net": net}, optimizers, DATA, config, step_fn=step_fn, scheduler=schedulers,
        **given,
    )  # fmt: skip
    return trainer, optimizers


def test_validation_without_a_metric_fn_or_a_plateau_without_a_metric_is_refused(tmp_path):
    with pytest.raises(
        ConfigError, match=r"val_data with step_fn needs a metric_fn: pass metric_fn"
    ):
        build(tmp_path, given={"metric_fn": None})
    with pytest.raises(ConfigError, match=r"ReduceLROnPlateau steps on a validation metric: pass"):
        build(tmp_path, given={"val_data": None, "metric_fn": None})
    with pytest.raises(ConfigError, match=r"name it with EarlyStoppingConfig\(metric="):
        build(tmp_path, metric=None)
    # Control: validation data, a metric_fn and the metric named build.
    assert build(tmp_path)[0].evaluate(DATA) == {"test/one": 1.0}


@pytest.mark.parametrize("interval", ["epoch", "step"])
def test_a_plateau_steps_at_validations_beside_another_optimizers_scheduler(tmp_path, interval):
    trainer, optimizers = build(tmp_path, scheduler_interval=interval)
    trainer.fit()
    # 2 epochs of 4 steps: the StepLR halves body's lr each epoch (or step), the plateau head's at
    # each epoch's validation but the first (which improves on nothing before it)
    body = 0.1 * 0.5 ** (2 if interval == "epoch" else 8)
    assert optimizers["body"].param_groups[0]["lr"] == pytest.approx(body)
    assert optimizers["head"].param_groups[0]["lr"] == pytest.approx(0.05)
    # Control: without the plateau, head's lr stays.
    trainer, optimizers = build(tmp_path / "none", plateau=False, scheduler_interval=interval)
    trainer.fit()
    assert optimizers["head"].param_groups[0]["lr"] == 0.1
