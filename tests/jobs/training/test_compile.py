"""``TrainerConfig(compile=True)``: the compiled step trains the same model on N ranks as on one
process, under ``ddp`` and ``fsdp``, and a stopped run resumes bit for bit. Compilation takes tens
of seconds per process on a small CPU, so these are slow tests with a tiny model (the per-token job
of test_token_loss)."""

from __future__ import annotations

import pytest

from ddpkit._internals.compiler import cpp_compiler
from tests.jobs.scripts.token_loss_job import train_on_ranks
from tests.jobs.scripts.train_job import under_launcher
from tests.trainer_checks import bitwise_equal, max_abs_diff, same_bits

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),  # compilation: tens of seconds per process, more under load
    pytest.mark.skipif(
        cpp_compiler() is None, reason="inductor needs a C++ compiler for CPU kernels; none found"
    ),
]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    return train_on_ranks(1, tmp_path_factory.mktemp("compile") / "one", compile=True)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compiled_ranks_with_accumulation_train_the_same_model_as_one_process(
    tmp_path, one_process, strategy
):
    ranks = train_on_ranks(2, tmp_path / strategy, grad_accum=2, strategy=strategy, compile=True)
    diff = max_abs_diff(ranks, one_process)
    print(f"compiled, {strategy}, 2 ranks x 2 micro-batches vs 1 process: max |dw| {diff:.1e}")
    assert ranks["step"] == one_process["step"] == 12 and diff < 1e-5
    assert ranks["graphs"] >= 1 and one_process["graphs"] >= 1


def test_a_compiled_run_stopped_and_resumed_is_bitwise_the_uninterrupted_one(tmp_path):
    whole = train_on_ranks(2, tmp_path / "whole", compile=True)
    first = train_on_ranks(2, tmp_path / "parts", max_steps=5, compile=True)
    assert first["step"] == 5
    # a new job: compiles again, loads the step-5 snapshot
    resumed = train_on_ranks(2, tmp_path / "parts", compile=True)
    assert resumed["step"] == whole["step"] == 12 and resumed["graphs"] >= 1
    assert same_bits(resumed, whole, "model", "optim")
    # Control: a resume that leaves the momentum buffers out is caught by the same comparison.
    train_on_ranks(2, tmp_path / "control", max_steps=5, compile=True)
    control = train_on_ranks(2, tmp_path / "control", drop_momentum=True, compile=True)
    assert control["step"] == 12 and not same_bits(control, whole, "model", "optim")


# two 2-rank jobs under the launcher, one restarted: each process compiles
@pytest.mark.timeout(1200)
def test_a_compiled_run_killed_with_sigkill_and_restarted_resumes_bitwise(tmp_path, clean_env):
    # The kill test's job (BatchNorm over the global batch, dropout, Adam, snapshots every 3 steps)
    # compiled, under the real launcher: rank 1 SIGKILLs itself at step 7; the agent restarts both
    # ranks, which compile again and resume from the snapshot of step 6.
    launcher = {"env": clean_env, "restarts": 1, "timeout": 500}
    reference, _ = under_launcher(tmp_path, "reference", "--compile", **launcher)
    kill = ("--kill-rank", "1", "--kill-step", "7")
    killed, _ = under_launcher(tmp_path, "killed", "--compile", *kill, **launcher)
    assert list((tmp_path / "killed-log").glob("killed-*")) and killed["attempt"] == 1
    assert bitwise_equal(killed, reference)
