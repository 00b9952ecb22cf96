"""``evaluate`` in one process: eval mode while it runs, and every submodule's own mode given
back."""

from __future__ import annotations

import torch
import torch._dynamo  # noqa: F401  DDP imports it lazily: once here, not in every forked worker (seconds each)
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit


def make_classification(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1000 + n)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


class ModeRecorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 3)
        )
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.training)
        return self.body(x)


def test_evaluate_runs_in_eval_mode_and_restores_train_mode():
    model = ModeRecorder().train()
    result = ddpkit.evaluate(model, make_classification(6), batch_size=4)
    assert set(result) == {"loss", "accuracy"}
    assert model.seen == [False, False]  # two batches, both in eval mode (dropout and BN off)
    assert all(m.training for m in model.modules())
    # Deterministic despite dropout: eval mode really was on.
    assert ddpkit.evaluate(model, make_classification(6)) == ddpkit.evaluate(
        model, make_classification(6)
    )
    model.eval()
    ddpkit.evaluate(model, make_classification(6))
    assert not any(m.training for m in model.modules())


def test_evaluate_restores_mixed_train_eval_modes():
    # Fine-tuning often freezes BatchNorm (bn.eval()) inside a model in train mode; evaluate must
    # give back exactly the modes it found, not put every submodule in the top module's mode.
    model = ModeRecorder().train()
    model.body[1].eval()
    before = {name: m.training for name, m in model.named_modules()}
    ddpkit.evaluate(model, make_classification(6))
    assert {name: m.training for name, m in model.named_modules()} == before
