"""Validation of a step function's Trainer (``val_data``, ``metric_fn(models, batch)``,
``trainer.evaluate()``) on 2 real gloo ranks: every sample counted once, with rank 0's BatchNorm
statistics on every rank, each model's mode restored, nothing drawn from the training stream, and a
SIGKILLed run resumed bit for bit with its validations and its metric-driven scheduler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo  # noqa: F401  DDP imports it lazily: once here, not in every forked worker (seconds each)
from torch import nn

from ddpkit.data import build_eval_loader
from ddpkit.distributed._collectives import all_gather_object
from ddpkit.testing import read_records, run_job, run_on_ranks
from ddpkit.training import _evaluation
from tests.jobs.scripts.several_val_job import build, data, metrics, models
from tests.trainer_checks import same_bits

JOB = Path(__file__).parents[1] / "scripts" / "several_val_job.py"
VAL, TEST = data(13, 2), data(11, 3)  # sizes that do not divide by 2


class Modes:
    """Each model's mode after each validation, and inside the metric function."""

    def __init__(self) -> None:
        self.after: list[dict[str, bool]] = []
        self.inside: list[dict[str, bool]] = []

    def metric_fn(self, models: dict[str, nn.Module], batch: Any) -> dict[str, Any]:
        self.inside.append({n: m.training for n, m in models.items()})
        return metrics(models, batch)

    def on_validation_end(self, trainer: Any, values: Any) -> None:
        self.after.append({n: m.training for n, m in trainer.strategy.modules.items()})


def _naive_mean(trainer: Any) -> float:
    """The control: each rank's mean of ``val/d_loss`` over its own share, averaged over ranks."""
    nets = trainer.strategy.modules.eval()  # rank 0's statistics: validation synced them
    with torch.no_grad():
        share = torch.cat([metrics(nets, b)["d_loss"] for b in build_eval_loader(VAL, 4)])
    return sum(all_gather_object(float(share.mean()))) / 2


def _validated(run_dir: Path, sync_buffers: bool = True) -> dict[str, Any]:
    if not sync_buffers:  # the control: each rank evaluates with its own BatchNorm statistics
        _evaluation._sync_buffers = lambda model: None
    modes = Modes()
    trainer = build(str(run_dir), metric_fn=modes.metric_fn)
    trainer.callbacks.append(modes)
    last = trainer.fit()
    test = trainer.evaluate(TEST, "test")
    weights = {k: v.clone() for k, v in trainer.strategy.model_weights().items()}
    return {
        "val": last["val/d_loss"], "fake": last["val/fake_score"], "test": test, "modes": modes,
        "weights": weights, "naive": _naive_mean(trainer),
    }  # fmt: skip


def one_process(weights: dict[str, torch.Tensor], dataset: Any) -> dict[str, float]:
    """The metrics of ``weights`` over the whole ``dataset`` at once, in this process."""
    nets = nn.ModuleDict(models())
    nets.load_state_dict(weights)
    nets.eval()
    with torch.no_grad():
        values = metrics(dict(nets.items()), dataset.tensors)
    total, count = values["fake_score"]
    return {"d_loss": float(values["d_loss"].mean()), "fake_score": float(total) / count}


def test_validation_and_evaluate_of_a_step_fn_trainer_count_every_sample_once(tmp_path):
    ranks = run_on_ranks(_validated, 2, (tmp_path / "synced",), timeout=300)
    got = ranks[0]
    want, test = one_process(got["weights"], VAL), one_process(got["weights"], TEST)
    assert (
        abs(got["val"] - want["d_loss"]) <= 1e-6 and abs(got["fake"] - want["fake_score"]) <= 1e-6
    )
    assert abs(got["test"]["test/d_loss"] - test["d_loss"]) <= 1e-6
    assert abs(got["test"]["test/fake_score"] - test["fake_score"]) <= 1e-6
    assert ranks[1]["val"] == got["val"] and ranks[1]["test"] == got["test"]
    # validated every 2 steps: each model in eval mode inside, in train mode again after
    assert len(got["modes"].after) == 6
    assert all(m == {"g": True, "d": True} for m in got["modes"].after)
    assert got["modes"].inside and all(m == {"g": False, "d": False} for m in got["modes"].inside)
    assert {r["kind"] for r in records(tmp_path / "synced", "test")} == {"test"}
    # Control: each rank's mean over its share (7 and 6 samples), averaged, is another number.
    assert abs(got["naive"] - want["d_loss"]) > 1e-6
    # Control: without rank 0's BatchNorm statistics on rank 1, the metrics describe no one model.
    own = run_on_ranks(_validated, 2, (tmp_path / "own", False), timeout=300)[0]
    assert abs(own["val"] - one_process(own["weights"], VAL)["d_loss"]) > 1e-6


def records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [r for r in read_records(run_dir) if r["kind"] == kind]


def _trained(run_dir: Path, val: bool, draw: bool = False) -> dict[str, torch.Tensor]:
    def drawing(models: dict[str, nn.Module], batch: Any) -> dict[str, Any]:
        torch.rand(1)  # the control: a draw from the training stream
        return metrics(models, batch)

    trainer = build(str(run_dir), val, drawing if draw else metrics, plateau=False)
    trainer.fit()
    return {k: v.clone() for k, v in trainer.strategy.full_state_dict()["model"].items()}


def _with_and_without(run_dir: Path) -> dict[str, bool]:
    plain = _trained(run_dir / "plain", False)

    def same(other: dict[str, torch.Tensor]) -> bool:
        return all(torch.equal(v, other[k]) for k, v in plain.items())

    validated = _trained(run_dir / "val", True)
    return {"validated": same(validated), "drawing": same(_trained(run_dir / "draw", True, True))}


def test_validation_draws_nothing_from_the_training_stream(tmp_path):
    # rank 0's weights (rank 1's BatchNorm statistics are rank 0's after a validation)
    got = run_on_ranks(_with_and_without, 2, (tmp_path,), timeout=300)[0]
    assert got["validated"]
    # Control: a metric function that draws from torch's RNG moves the training's noise.
    assert not got["drawing"]


def launch(tmp: Path, name: str, *args: str) -> list[dict[str, Any]]:
    """The job under ``ddpkit run --nproc 2 --max-restarts 1``; each rank's final state."""
    done = run_job(
        JOB, str(tmp / name), str(tmp / f"{name}.out"), *args,
        launcher_args=("--max-restarts", "1"), timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return [torch.load(f"{tmp / name}.out.rank{r}", weights_only=False) for r in (0, 1)]


def val_records(run_dir: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["val/d_loss"], r["val/fake_score"]) for r in records(run_dir, "val")]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_step_fn_run_with_validation_resumes_bitwise(tmp_path):
    whole = launch(tmp_path, "whole")
    # 12 steps, validated every 2; the plateau halved d's lr at validations 2, 4 and 6
    assert whole[0]["step"] == 12 and whole[0]["lr_d"] == 5e-2 / 8
    assert [s for s, _, _ in val_records(tmp_path / "whole")] == [2, 4, 6, 8, 10, 12]
    # Rank 1 SIGKILLed after step 7: the restart resumes from step 6's snapshot, taken after its
    # validation.
    killed = launch(tmp_path, "killed", "--kill-step", "7")
    assert killed[0]["attempt"] == 1 and killed[0]["resumed_from"] == 6
    for rank in (0, 1):
        assert same_bits(killed[rank]["strategy"], whole[rank]["strategy"], "model", "optim"), (
            f"rank {rank}"
        )
    assert val_records(tmp_path / "killed") == val_records(tmp_path / "whole")
    best = [torch.load(tmp_path / n / "best.pt", weights_only=True) for n in ("whole", "killed")]
    assert best[0]["step"] == best[1]["step"] and best[0]["value"] == best[1]["value"]
    # Control: a resume without the schedulers' state counts validations from 0 again: d's lr is
    # halved at step 10, not 8.
    forgot = launch(tmp_path, "forgot", "--kill-step", "7", "--forget-plateau")
    assert forgot[0]["resumed_from"] == 6 and forgot[0]["lr_d"] == 5e-2 / 4
    assert not same_bits(forgot[0]["strategy"], whole[0]["strategy"], "model", "optim")
