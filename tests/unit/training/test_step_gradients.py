"""Gradients between two steps: what a callback leaves on the model does not reach the next step."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.training._config import LoggingConfig, TrainerConfig
from ddpkit.training._step import OptimizerStep


class LeavesGradients:
    """A GAN's generator step, as pytorch/examples' dcgan writes it: a backward through the
    discriminator (the Trainer's model), whose gradients it leaves there."""

    def __init__(self, value: float) -> None:
        self.x = torch.full((4, 4), 3.0)
        self.value = value

    def on_step_end(self, trainer, taken, output):
        (trainer.model(self.x).sum() * self.value).backward()


def _weights(tmp_path, name, callbacks=(), **config):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
    cfg = TrainerConfig(
        run_dir=str(tmp_path / name), batch_size=4, epochs=1, num_workers=0,
        logging=LoggingConfig(progress=False), **config,
    )  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = ddpkit.Trainer(
        model, optimizer, data, cfg, loss_fn=torch.nn.functional.mse_loss, callbacks=callbacks
    )
    trainer.fit()
    return [p.detach().clone() for p in model.parameters()], trainer.skipped_steps


def _old_order(monkeypatch):
    """main's order: gradients zeroed after the optimizer step (before on_step_end), not before the
    next step."""
    step = OptimizerStep.__call__

    def zero_after(self, window):
        taken = step(self, window)
        self.strategy.optimizer.zero_grad(set_to_none=True)
        return taken

    monkeypatch.setattr(OptimizerStep, "begin", lambda self: None)
    monkeypatch.setattr(OptimizerStep, "__call__", zero_after)


@pytest.mark.parametrize(
    "config, value",
    [
        ({}, 1.0),
        # micro-batches add up; the scaler unscales
        ({"grad_accum_steps": 2, "precision": "fp16"}, 1.0),
        # a NaN left behind skips nothing
        ({"grad_accum_steps": 2, "on_nonfinite": "skip"}, float("nan")),
    ],
)
def test_gradients_a_callback_leaves_do_not_change_the_next_step(
    tmp_path, monkeypatch, config, value
):
    plain, plain_skipped = _weights(tmp_path, "plain", **config)
    left, left_skipped = _weights(tmp_path, "left", [LeavesGradients(value)], **config)
    assert plain_skipped == left_skipped == 0
    # bitwise
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(plain, left))
    # Control: zeroed before on_step_end (main's order), the callback's gradients join the next
    # step.
    _old_order(monkeypatch)
    again, _ = _weights(tmp_path, "plain_old", **config)
    # without the callback the order changes nothing
    assert all(torch.equal(a, b) for a, b in zip(plain, again))
    old, old_skipped = _weights(tmp_path, "left_old", [LeavesGradients(value)], **config)
    assert (
        old_skipped > 0
        if value != value
        else not all(torch.equal(a, b) for a, b in zip(plain, old))
    )
