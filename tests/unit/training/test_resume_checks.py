"""A resume is refused when the model's structure changed though its shapes did not, and allowed,
with a warning, when only the precision changed (one process, no launcher)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import ddpkit
from ddpkit._errors import ConfigError
from ddpkit.snapshot import _codec as codec
from ddpkit.snapshot import _run_dir as run_record
from ddpkit.snapshot._run_dir import RunRecord, module_types, tensor_shapes
from ddpkit.training._config import LoggingConfig
from ddpkit.training._trainer import TrainerConfig


def fit(run_dir, activation: type[nn.Module], epochs: int, dropout: float = 0.2) -> ddpkit.Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), activation(), nn.Dropout(dropout), nn.Linear(8, 2))
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    config = TrainerConfig(
        run_dir=str(run_dir),
        batch_size=8,
        epochs=epochs,
        logging=LoggingConfig(progress=False),
        num_workers=0,
    )
    trainer = ddpkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, config)
    trainer.fit()
    return trainer


def test_another_activation_with_the_same_shapes_is_refused_naming_it(tmp_path):
    fit(tmp_path, nn.ReLU, epochs=1)  # 4 steps, snapshot at the epoch's end
    with pytest.raises(ConfigError, match=r"model 1: ReLU in the snapshot, GELU now") as refused:
        fit(tmp_path, nn.GELU, epochs=2)
    # the shapes are the same: only the class differs
    assert "model 0.weight" not in str(refused.value)
    # Control: the checks without the module classes (shapes, config, optimizer) let this model
    # through.
    saved = codec.read_file(tmp_path / "snapshots" / "step-00000004" / "values.pt")["extra"][
        "record"
    ]
    gelu = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.2), nn.Linear(8, 2))
    shapes = tensor_shapes(gelu.state_dict())
    RunRecord(saved["config"], saved["optimizer_hparams"], shapes, saved["module_types"]).check(
        saved, "snapshot"
    )
    with pytest.raises(ConfigError, match="GELU now"):
        RunRecord(saved["config"], saved["optimizer_hparams"], shapes, module_types(gelu)).check(
            saved, "snapshot"
        )
    # Control: the same classes resume, a module's hyper-parameter (the dropout rate) changed or
    # not.
    assert fit(tmp_path, nn.ReLU, epochs=2, dropout=0.3).resumed_from == 4


def test_module_types_name_the_class_the_script_built():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU()))
    assert module_types(model) == {
        "": "Sequential",
        "0": "Linear",
        "1": "Sequential",
        "1.0": "ReLU",
    }
    old = {"": "Sequential", "0": "Linear", "1": "Sequential", "1.0": "Tanh", "2": "ReLU"}
    with pytest.raises(ConfigError) as refused:
        RunRecord({}, [], {}, module_types(model)).check({"module_types": old}, "snapshot")
    lines = (
        "model: submodules only in the snapshot: 2\n  model 1.0: Tanh in the snapshot, ReLU now\n"
    )
    assert lines in str(refused.value)


def fit_precision(run_dir, precision: str, epochs: int, half: bool = False) -> ddpkit.Trainer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    if half:
        model = model.half()
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    config = TrainerConfig(
        run_dir=str(run_dir),
        batch_size=8,
        epochs=epochs,
        precision=precision,
        logging=LoggingConfig(progress=False),
        num_workers=0,
    )
    trainer = ddpkit.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, config)
    trainer.fit()
    return trainer


def _events(run_dir, name: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == name]


@pytest.mark.parametrize(
    ("old", "new", "scaler"),
    [
        ("fp32", "bf16", None),
        ("bf16", "fp32", None),
        ("fp16", "fp32", "dropped"),
        ("fp32", "fp16", "fresh"),
    ],
)
def test_a_precision_change_resumes_with_a_warning_that_it_is_not_bitwise(
    tmp_path, capsys, old, new, scaler
):
    first = fit_precision(tmp_path, old, epochs=1)  # 4 steps, snapshot at the epoch's end
    assert (first.scaler is not None) == (old == "fp16")
    capsys.readouterr()
    resumed = fit_precision(tmp_path, new, epochs=2)
    assert resumed.resumed_from == 4 and resumed.step == 8
    assert (resumed.scaler is not None) == (new == "fp16")
    # a new scaler, at its initial scale: nothing of the fp32 run to take it from
    if scaler == "fresh":
        assert resumed.scaler is not None and resumed.scaler.get_scale() == 65536.0
    printed = capsys.readouterr().out
    assert f"WARNING: precision changed from {old} (the snapshot's) to {new} on resume" in printed
    assert "the bitwise-resume guarantee does not hold for this run" in printed
    [event] = _events(tmp_path, "precision_change")
    assert event == event | {
        "from": old,
        "to": new,
        "scaler": scaler,
        "bitwise_resume": False,
        "step": 4,
    }
    # The same precision again resumes without a word about it.
    capsys.readouterr()
    again = fit_precision(tmp_path, new, epochs=3)
    assert again.resumed_from == 8 and "precision changed" not in capsys.readouterr().out
    assert len(_events(tmp_path, "precision_change")) == 1


def test_control_the_precision_compared_as_before_refuses_the_change(tmp_path, monkeypatch):
    fit_precision(tmp_path, "fp32", epochs=1)
    monkeypatch.setattr(run_record, "_NOT_COMPARED", run_record._NOT_COMPARED - {"precision"})
    with pytest.raises(
        ConfigError, match=r"TrainerConfig.precision: 'fp32' in the snapshot, 'bf16' now"
    ):
        fit_precision(tmp_path, "bf16", epochs=2)


def test_parameters_of_another_dtype_are_still_refused(tmp_path):
    # The precision of autocast may change; the dtype of the parameters a snapshot holds may not.
    fit_precision(tmp_path, "fp32", epochs=1)
    with pytest.raises(
        ConfigError, match=r"model 0.weight: \(8, 4\) float32 in the snapshot, \(8, 4\) float16 now"
    ):
        fit_precision(tmp_path, "fp32", epochs=2, half=True)


def _record(**group: object) -> RunRecord:
    param = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    optimizer.param_groups[0].update(group)
    return RunRecord.of(TrainerConfig(run_dir="r", batch_size=8), optimizer, nn.Linear(2, 2))


def _through_a_snapshot(record: RunRecord) -> dict:
    """The record as a resume reads it back: through the codec and JSON."""
    held: list[torch.Tensor] = []
    skeleton = json.loads(json.dumps(codec.encode(record.state_dict(), held)))
    return codec.decode(skeleton, held)


@pytest.mark.parametrize(
    "saved, now",
    [
        (torch.tensor(0.01), torch.tensor(0.01003)),  # str() shows both as tensor(0.0100)
        (torch.tensor([0.9, 0.999]), torch.tensor([0.9, 0.998])),
        (float("nan"), 0.5),
        (np.arange(2000.0), np.arange(2000.0) + np.eye(1, 2000, 1999)[0]),  # str() elides it
    ],
)
def test_a_changed_optimizer_setting_is_refused_to_its_last_bit(saved, now):
    record = _through_a_snapshot(_record(lr=saved))
    with pytest.raises(ConfigError, match="optimizer param group 0 lr"):
        _record(lr=now).check(record, "snapshot")
    # control: the same value is let through, NaN included
    _record(lr=saved).check(record, "snapshot")


def test_a_setting_json_cannot_hold_is_recorded_and_compared():
    """A dict with tuple keys in a param group (the codec holds it; JSON does not) stopped the
    Trainer being built, in the record's JSON text."""
    record = _through_a_snapshot(_record(seen={(1, 2): 3}))
    _record(seen={(1, 2): 3}).check(record, "snapshot")
    with pytest.raises(ConfigError, match="optimizer param group 0 seen"):
        _record(seen={(1, 2): 4}).check(record, "snapshot")


@pytest.mark.heavy
def test_a_setting_that_saves_resumes_in_any_process():
    """A set of strings iterates in another order under another hash seed, and NaN is not equal to
    itself: the record compares each setting by its fingerprint, so a run that saved resumes. Each
    record is made in a process of its own, as a job and its restart are."""
    script = (
        "import json, sys, torch\n"
        "from torch import nn\n"
        "from ddpkit.snapshot import _codec as codec\n"
        "from ddpkit.snapshot._run_dir import RunRecord\n"
        "from ddpkit.training._trainer import TrainerConfig\n"
        "opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)\n"
        "opt.param_groups[0].update(tags={'encoder', 'decoder', 'head', 'lora', 'frozen'},\n"
        "                           last_metric=float('nan'))\n"
        "r = RunRecord.of(TrainerConfig(run_dir='r', batch_size=8), opt, nn.Linear(2, 2))\n"
        "held = []\n"
        "print(json.dumps(codec.encode(r.state_dict(), held)))\n"
    )
    records = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        records.append(codec.decode(json.loads(out.stdout), []))
    first, second = records
    assert first["optimizer_settings"][0]["tags"] != repr(
        {"encoder", "decoder", "head", "lora", "frozen"}
    )
    RunRecord(
        second["config"],
        second["optimizer_hparams"],
        second["model_shapes"],
        second["module_types"],
        second["optimizer_settings"],
    ).check(first, "snapshot")
    # control: compared as JSON text (what the record held before its settings), the same run is
    # refused: the set's text changed with the seed, and NaN differs from itself
    old_way = dict(first, optimizer_settings=None)
    with pytest.raises(ConfigError, match="last_metric"):
        RunRecord(
            second["config"],
            second["optimizer_hparams"],
            second["model_shapes"],
            second["module_types"],
        ).check(old_way, "snapshot")


def _named(lr_g: float, lr_d: float, order: str = "gd", scheduler: bool = False) -> RunRecord:
    params = {name: nn.Parameter(torch.zeros(2)) for name in "gd"}
    lrs = {"g": lr_g, "d": lr_d}
    optimizers = {n: torch.optim.SGD([params[n]], lr=lrs[n]) for n in order}
    if scheduler:
        torch.optim.lr_scheduler.StepLR(optimizers["g"], 2)
    groups = [g for opt in optimizers.values() for g in opt.param_groups]
    joined = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    joined.param_groups = groups
    config = TrainerConfig(run_dir="r", batch_size=8)
    return RunRecord.of(config, joined, nn.Linear(2, 2), named=optimizers)


def test_several_optimizers_settings_are_compared_by_name_not_by_place():
    """A step of several optimizers: the same optimizers passed in another order are the same run,
    and a changed one is named (as it was not: 'param group 0' of whichever came first)."""
    saved = _through_a_snapshot(_named(0.01, 0.001, "gd"))
    _named(0.01, 0.001, "dg").check(saved, "snapshot")
    with pytest.raises(ConfigError, match=r'optimizer "d" param group 0 lr: 0.001 in the snapshot'):
        _named(0.01, 0.002, "dg").check(saved, "snapshot")
    with pytest.raises(ConfigError, match=r'optimizer "g" param group 0: this run has a learning-'):
        _named(0.01, 0.001, "gd", scheduler=True).check(saved, "snapshot")
    # control: compared by place, the reordered run is refused
    by_place = dict(saved, optimizer_settings=None)
    with pytest.raises(ConfigError, match="optimizer param group 0 lr"):
        _named(0.01, 0.001, "dg").check(by_place, "snapshot")
