"""A resume is refused when the model's structure changed though its shapes did not (one process, no launcher)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit.errors import ConfigError
from ddpkit.training.config import LoggingConfig
from ddpkit.training.run_record import RunRecord, module_types, tensor_shapes
from ddpkit.training.trainer import TrainerConfig


def fit(run_dir, activation: type[nn.Module], epochs: int, dropout: float = 0.2) -> ddpkit.Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), activation(), nn.Dropout(dropout), nn.Linear(8, 2))
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    config = TrainerConfig(
        run_dir=str(run_dir), batch_size=8, epochs=epochs, logging=LoggingConfig(progress=False), num_workers=0
    )
    trainer = ddpkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, config)
    trainer.fit()
    return trainer


def test_another_activation_with_the_same_shapes_is_refused_naming_it(tmp_path):
    fit(tmp_path, nn.ReLU, epochs=1)  # 4 steps, snapshot at the epoch's end
    with pytest.raises(ConfigError, match=r"model 1: ReLU in the snapshot, GELU now") as refused:
        fit(tmp_path, nn.GELU, epochs=2)
    assert "model 0.weight" not in str(refused.value)  # the shapes are the same: only the class differs
    # Control: the checks without the module classes (shapes, config, optimizer) let this model through.
    saved = torch.load(tmp_path / "snapshots" / "step-00000004" / "trainer.pt", weights_only=True)["extra"]["record"]
    gelu = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.2), nn.Linear(8, 2))
    shapes = tensor_shapes(gelu.state_dict())
    RunRecord(saved["config"], saved["optimizer_hparams"], shapes, saved["module_types"]).check(saved, "snapshot")
    with pytest.raises(ConfigError, match="GELU now"):
        RunRecord(saved["config"], saved["optimizer_hparams"], shapes, module_types(gelu)).check(saved, "snapshot")
    # Control: the same classes resume, a module's hyper-parameter (the dropout rate) changed or not.
    assert fit(tmp_path, nn.ReLU, epochs=2, dropout=0.3).resumed_from == 4


def test_module_types_name_the_class_the_script_built():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
    assert module_types(model) == {"": "Sequential", "0": "Linear", "1": "Sequential", "1.0": "ReLU"}
    old = {"": "Sequential", "0": "Linear", "1": "Sequential", "1.0": "Tanh", "2": "ReLU"}
    with pytest.raises(ConfigError) as refused:
        RunRecord({}, [], {}, module_types(model)).check({"module_types": old}, "snapshot")
    lines = "model: submodules only in the snapshot: 2\n  model 1.0: Tanh in the snapshot, ReLU now\n"
    assert lines in str(refused.value)
