"""``TrainerConfig(compile=True)``: the compiled step trains the same model on N ranks as on one
process, under ``ddp`` and ``fsdp``, and a stopped run resumes bit for bit. Compilation takes tens
of seconds per process on a small CPU, so these are slow tests with a tiny model (the per-token job
of test_token_loss)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit._internals.compiler import cpp_compiler
from ddpkit.testing import run_job
from tests.conftest import _clean_environ
from tests.jobs.scripts.token_loss_job import train
from tests.trainer_checks import bitwise_equal

JOB = str(Path(__file__).parents[1] / "scripts" / "train_job.py")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),  # compilation: tens of seconds per process, more under load
    pytest.mark.skipif(
        cpp_compiler() is None, reason="inductor needs a C++ compiler for CPU kernels; none found"
    ),
]


def _launch(tmp: Path, name: str, *args: str) -> dict:
    (tmp / f"{name}-log").mkdir()
    job = [
        str(tmp / name),
        "--compile",
        "--sample-log",
        str(tmp / f"{name}-log"),
        "--out",
        str(tmp / f"{name}.pt"),
    ]
    proc = run_job(
        JOB, *job, *args, launcher_args=("--max-restarts", "1"), env=_clean_environ(), timeout=500
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp / f"{name}.pt", weights_only=False)


def _run(world: int, run_dir, **kwargs) -> dict:
    return ddpkit.spawn(functools.partial(train, str(run_dir), compile=True, **kwargs), world)[0]


def _max_abs_diff(a: dict, b: dict) -> float:
    return max(float((a["model"][k] - b["model"][k]).abs().max()) for k in a["model"])


def _equal(x, y) -> bool:
    return (
        torch.equal(x, y) if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) else x == y
    )


def _bitwise(a: dict, b: dict) -> bool:
    """Weights and optimizer state (momentum buffers, hyper-parameters) identical to the bit."""
    same_weights = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    same_optim = a["optim"].keys() == b["optim"].keys() and all(
        _equal(a["optim"][k], b["optim"][k]) for k in a["optim"]
    )
    return same_weights and same_optim


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    return _run(1, tmp_path_factory.mktemp("compile") / "one")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_ranks_with_accumulation_train_the_same_model_as_one_process(
    tmp_path, one_process, strategy
):
    ranks = _run(2, tmp_path / strategy, grad_accum=2, strategy=strategy)
    diff = _max_abs_diff(ranks, one_process)
    print(f"compiled, {strategy}, 2 ranks x 2 micro-batches vs 1 process: max |dw| {diff:.1e}")
    assert ranks["step"] == one_process["step"] == 12 and diff < 1e-5
    assert ranks["graphs"] >= 1 and one_process["graphs"] >= 1


def test_a_compiled_run_stopped_and_resumed_is_bitwise_the_uninterrupted_one(tmp_path):
    whole = _run(2, tmp_path / "whole")
    first = _run(2, tmp_path / "parts", max_steps=5)
    assert first["step"] == 5
    resumed = _run(2, tmp_path / "parts")  # a new job: compiles again, loads the step-5 snapshot
    assert resumed["step"] == whole["step"] == 12 and resumed["graphs"] >= 1
    assert _bitwise(resumed, whole)
    # Control: a resume that leaves the momentum buffers out is caught by the same comparison.
    _run(2, tmp_path / "control", max_steps=5)
    control = _run(2, tmp_path / "control", drop_momentum=True)
    assert control["step"] == 12 and not _bitwise(control, whole)


# two 2-rank jobs under the launcher, one restarted: each process compiles
@pytest.mark.timeout(1200)
def test_a_compiled_run_killed_with_sigkill_and_restarted_resumes_bitwise(tmp_path):
    # The kill test's job (BatchNorm over the global batch, dropout, Adam, snapshots every 3 steps)
    # compiled, under the real launcher: rank 1 SIGKILLs itself at step 7; the agent restarts both
    # ranks, which compile again and resume from the snapshot of step 6.
    reference = _launch(tmp_path, "reference")
    killed = _launch(tmp_path, "killed", "--kill-rank", "1", "--kill-step", "7")
    assert list((tmp_path / "killed-log").glob("killed-*")) and killed["attempt"] == 1
    assert bitwise_equal(killed, reference)
