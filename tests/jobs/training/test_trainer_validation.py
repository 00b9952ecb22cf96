"""Validation every N steps (exact on resume), the weights files for use outside ddpkit, and what
``on_step_end`` callbacks get: in real gloo jobs of 2 ranks."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from ddpkit.testing import read_records, run_on_ranks
from tests.jobs.scripts.train_job import build_model, train, under_launcher
from tests.trainer_checks import bitwise_equal

JOB = str(Path(__file__).parents[1] / "scripts" / "train_job.py")


def val_by_step(run_dir: Path) -> dict[int, dict]:
    """The ``val`` records by step; a step validated again after a resume keeps its last record (the
    values must be the same: the test compares them with an uninterrupted run's)."""
    return {
        r["step"]: {k: v for k, v in r.items() if k != "time"}
        for r in read_records(run_dir)
        if r["kind"] == "val"
    }


# the test job on 2 ranks under ddpkit run, one restart allowed; its samples logged to NAME-marks
UNDER_LAUNCHER = {"env": None, "restarts": 1, "timeout": 180, "sample_log": "marks"}
VAL = ("--val-every-steps", "3", "--patience", "2", "--epochs", "6")


def _best(run_dir: Path) -> dict:
    return torch.load(run_dir / "best.pt", weights_only=True)


@pytest.mark.slow
# three 2-rank jobs of up to 60 steps under ddpkit run: 1-2 minutes, more under load
@pytest.mark.timeout(600)
def test_a_killed_run_validates_at_the_same_steps_and_picks_the_same_best_as_an_uninterrupted_one(
    tmp_path,
):
    whole = under_launcher(tmp_path, "whole", *VAL, **UNDER_LAUNCHER)[0]
    expected = val_by_step(tmp_path / "whole")
    # every 3 steps, across epoch ends
    assert sorted(expected) == list(range(3, whole["step"] + 1, 3))
    assert whole["stopped_by"] == "early_stopping" and whole["step"] < 60
    best = _best(tmp_path / "whole")
    losses = {step: r["val/loss"] for step, r in expected.items()}
    assert best["step"] == min(losses, key=losses.__getitem__) and best["value"] == min(
        losses.values()
    )
    assert whole["step"] == best["step"] + 2 * 3  # two validations without improvement
    # Killed (SIGKILL, rank 1) right after the first validation without improvement and its step's
    # snapshot were written: the restart resumes from that step, with that validation counted.
    kill = ("--kill-rank", "1", "--kill-step", str(best["step"] + 3), "--kill-after-write")
    killed = under_launcher(tmp_path, "killed", *VAL, *kill, **UNDER_LAUNCHER)[0]
    assert list((tmp_path / "killed-marks").glob("killed-*")) and killed["attempt"] == 1
    assert killed["resumed_from"] == best["step"] + 3
    assert val_by_step(tmp_path / "killed") == expected
    killed_best = _best(tmp_path / "killed")
    assert {k: v for k, v in killed_best.items() if k != "model"} == {
        k: v for k, v in best.items() if k != "model"
    }
    assert all(torch.equal(killed_best["model"][k], v) for k, v in best["model"].items())
    assert killed["stopped_by"] == "early_stopping" and killed["step"] == whole["step"]
    assert bitwise_equal(killed, whole)
    # Control: a resume that leaves early stopping's state out forgets the validation without
    # improvement before the kill, and stops later than the uninterrupted run.
    control = under_launcher(
        tmp_path, "control", *VAL, *kill, "--drop", "early_stopping", **UNDER_LAUNCHER
    )[0]
    assert control["resumed_from"] == best["step"] + 3 and control["step"] > whole["step"]
    assert val_by_step(tmp_path / "control") != expected


def _strict_load(path: Path):
    from safetensors.torch import load_file

    model = build_model()
    model.load_state_dict(load_file(path), strict=True)
    return model


@pytest.mark.parametrize(
    "strategy",
    [
        "ddp",
        pytest.param("zero", marks=pytest.mark.slow),
        pytest.param("fsdp", marks=pytest.mark.slow),
    ],
)
def test_the_final_and_best_weights_files_load_strictly_into_a_plain_model(tmp_path, strategy):
    pytest.importorskip("safetensors")
    out = run_on_ranks(
        functools.partial(
            train,
            str(tmp_path / "run"),
            epochs=1,
            val_every_steps=4,
            strategy=strategy,
            global_dropout=True,
        ),
        2,
    )[0]
    run_dir = tmp_path / "run"
    # ddp: the unwrapped model's state; zero and fsdp: gathered from every rank
    trained = out["model"]
    model = _strict_load(run_dir / "final.safetensors")
    assert model.state_dict().keys() == trained.keys()
    assert all(torch.equal(model.state_dict()[k], trained[k]) for k in trained)
    best = _best(run_dir)
    model = _strict_load(run_dir / "best.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in best["model"].items())
    assert best["step"] in (4, 8)
    # Control: the DDP module's names (module.0.weight, ...) do not load into the plain model.
    with pytest.raises(RuntimeError, match="Missing key"):
        build_model().load_state_dict({f"module.{k}": v for k, v in trained.items()}, strict=True)


class _Outputs:
    """Records what on_step_end gets."""

    def __init__(self) -> None:
        self.outputs: list[dict] = []

    def on_step_end(self, trainer, taken, output) -> None:
        self.outputs.append(
            {
                "step": output.step,
                "taken": taken,
                "loss": output.loss,
                "samples": output.samples,
                "lr": output.lr,
                "grad_norm": output.grad_norm,
                "epoch": output.epoch,
            }
        )


def _with_outputs(run_dir: str) -> list[dict]:
    outputs = _Outputs()
    train(run_dir, epochs=1, log_every_steps=1, clip_grad_norm=1.0, callbacks=[outputs])
    return outputs.outputs


def test_on_step_end_gets_the_ranks_own_loss_the_lr_and_the_global_grad_norm(tmp_path):
    r0, r1 = run_on_ranks(functools.partial(_with_outputs, str(tmp_path / "run")), 2)
    assert [o["step"] for o in r0] == list(range(1, 11)) and all(o["taken"] for o in r0)
    train_records = {r["step"]: r for r in read_records(tmp_path / "run") if r["kind"] == "train"}
    for a, b in zip(r0, r1):
        # Each rank's loss is its own (no collective): they differ, and their sample-weighted mean
        # is the agreed mean the train record holds (logged every step here).
        total = a["samples"] + b["samples"]
        agreed = train_records[a["step"]]["train/loss"]
        assert (a["loss"] * a["samples"] + b["loss"] * b["samples"]) / total == pytest.approx(
            agreed, rel=1e-12
        )
        assert a["loss"] != b["loss"]
        # The lr the step used (StepLR(4, 0.7) stepped after each step), and the global norm: the
        # same on both.
        assert a["lr"] == b["lr"] == pytest.approx(0.05 * 0.7 ** ((a["step"] - 1) // 4))
        assert (
            a["grad_norm"] == b["grad_norm"] == pytest.approx(train_records[a["step"]]["grad_norm"])
        )
