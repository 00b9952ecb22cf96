"""``ddpkit check`` with no rank started: bad arguments named, parameters with rounding-noise
gradients left out of the comparison, a dataset smaller than one global batch refused, a Trainer
kept whole for the check and, with ``step_fn``, refused by the bench."""

from pathlib import Path

import pytest
import torch

from ddpkit._errors import ConfigError
from ddpkit.tools._bench import BenchConfig, run_bench
from ddpkit.tools._check import CheckConfig, _in_float64, _KeepFloat64, _nudge, run_check
from ddpkit.tools._compare import Comparison, Tolerance, compare
from ddpkit.tools._workload import load_workload

SCRIPTS = Path(__file__).parents[2] / "jobs" / "scripts"


def test_bad_arguments_are_refused_with_the_option_named():
    with pytest.raises(ConfigError, match="--nproc 1"):
        CheckConfig(nproc=1)


def _records(grad, weights):
    return {
        "loss": [1.0],
        "grad": [torch.tensor(grad, dtype=torch.float64)],
        "weights": [torch.tensor(weights, dtype=torch.float64)],
        "sizes": [2, 1],
        "error": None,
    }


def test_parameters_with_rounding_noise_gradients_are_left_out_of_the_weights():
    # The second parameter's gradient is rounding noise (a bias BatchNorm cancels): Adam moves it by
    # a full learning rate either way, so its weights may differ; the comparison leaves it out and
    # says so.
    ref = _records([1.0, 1.0, 1e-12], [1.0, 1.0, 0.001])
    other = _records([1.0, 1.0, -1e-12], [1.0, 1.0, -0.001])
    c = compare(other, ref)
    assert c.diffs[0]["weights"] == 0.0 and c.silent == 1
    # control: the same difference in a parameter with a real gradient counts
    ref = _records([1.0, 1.0, 1e-3], [1.0, 1.0, 0.001])
    other = _records([1.0, 1.0, 1e-3], [1.0, 1.0, -0.001])
    c = compare(other, ref)
    assert c.diffs[0]["weights"] > 1e-4 and c.silent == 0


def test_a_dataset_smaller_than_one_global_batch_is_refused_before_any_rank_starts(tmp_path):
    script = tmp_path / "small.py"
    script.write_text(
        "import torch.nn.functional as F\n"
        "from tests.jobs.scripts.check_common import mlp, sgd, toy_data\n"
        "def ddpkit_workload():\n"
        "    return mlp(), toy_data(16), F.cross_entropy, sgd\n"
    )
    with pytest.raises(ConfigError, match="no global batch of 64"):
        run_check(CheckConfig(script=str(script)))


_TWO_MODELS = """
import sys
import torch
import ddpkit

g, d = torch.nn.Linear(4, 2), torch.nn.Linear(2, 1)
data = torch.utils.data.TensorDataset(torch.randn(64, 2), torch.zeros(64, dtype=torch.long))
config = ddpkit.TrainerConfig(run_dir="runs/gan", epochs=1, batch_size=8, num_workers=0)
if "--one" in sys.argv:
    trainer = ddpkit.Trainer(d, torch.optim.SGD(d.parameters(), lr=0.1), data, config)
else:
    optimizers = {"g": torch.optim.SGD(g.parameters()), "d": torch.optim.SGD(d.parameters())}
    trainer = ddpkit.Trainer(
        {"g": g, "d": d},
        optimizers,
        data,
        config,
        step_fn=lambda step: None,
    )
trainer.fit()
"""


def test_a_step_fn_trainer_is_kept_whole_for_the_check_and_refused_by_the_bench(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "gan.py"
    script.write_text(_TWO_MODELS)
    workload = load_workload(str(script))
    assert workload.trainer is not None and workload.trainer.kwargs["step_fn"] is not None
    assert isinstance(workload.model, torch.nn.ModuleDict) and list(workload.model) == ["g", "d"]
    with pytest.raises(ConfigError, match=r"has a step_fn .* define ddpkit_workload\(\)"):
        run_bench(BenchConfig(script=str(script)))
    # Control: the same script building one model's Trainer is kept whole too (the check runs it),
    # with its model, loss and optimizer for the bench, which takes it.
    workload = load_workload(str(script), args=("--one",))
    assert workload.trainer is not None and "step_fn" not in workload.trainer.kwargs
    assert isinstance(workload.model, torch.nn.Linear) and workload.model.in_features == 2
    assert not (tmp_path / "runs").exists()  # stopped where the Trainer would be built


def test_a_difference_is_rounding_within_its_floor_or_a_thousand_times_roundings_reach():
    # rounding's reach at step 0: the nudged run moved the weights by 1e-14, the gradients by 0
    tol = Tolerance(1e-13, ({"weights": 1e-14, "grad": 0.0},))
    assert tol.at(0, "weights") == pytest.approx(1e-11) and tol.at(0, "grad") == 1e-13
    assert tol.at(5, "weights") == 1e-13  # a step the nudged run did not reach: the floor
    same = Comparison([{"weights": 5e-12, "grad": 5e-14, "loss": 0.0}])
    assert not same.differs(tol)
    # control: the same difference in the gradients, where rounding reached nothing, is real
    assert Comparison([{"weights": 5e-12, "grad": 5e-12, "loss": 0.0}]).first(tol) == (
        0,
        "grad",
        5e-12,
    )


def test_a_nudge_moves_every_weight_by_one_unit_in_its_last_place():
    model = torch.nn.Linear(40, 30).double()
    before = [p.detach().clone() for p in model.parameters()]
    _nudge(model)
    for old, new in zip(before, model.parameters()):
        up, down = old.nextafter(old + 1), old.nextafter(old - 1)
        assert bool(((new == up) | (new == down)).all())
        assert 0.3 < float((new == up).double().mean()) < 0.7  # both ways


def test_a_float64_run_keeps_float64_where_the_script_casts_down():
    x = torch.ones(3, dtype=torch.float64)
    with _KeepFloat64():
        kept = [x.float(), x.half(), x.to(torch.float32), x.to("cpu", dtype=torch.bfloat16)]
        # control: tensors of other dtypes, and ddpkit's own float32 flags, are cast as asked
        others = [torch.ones(2).double().float().int().float(), torch.zeros(1, dtype=torch.float32)]
    assert all(t.dtype == torch.float64 for t in kept)
    assert [t.dtype for t in others] == [torch.float32, torch.float32]
    batch = {"x": torch.ones(2), "ids": torch.arange(2), "pair": (torch.ones(1), "text")}
    cast = _in_float64(batch)
    assert cast["x"].dtype == torch.float64 and cast["ids"].dtype == torch.int64
    assert cast["pair"][0].dtype == torch.float64 and cast["pair"][1] == "text"
