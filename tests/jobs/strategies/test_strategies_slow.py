"""zero and fsdp under the real launcher and at several world sizes (minutes: ``pytest -m slow``).

SIGKILL at a random step resumes bit for bit, every rank's state (BatchNorm without sync BatchNorm:
each rank's own running statistics); N ranks train what one process trains; a zero snapshot resumes
at another world size."""

from __future__ import annotations

import os
import random
import time

import pytest

from tests.jobs.scripts.train_job import train_on_ranks, under_launcher
from tests.trainer_checks import rank_differences, same_bits

pytestmark = pytest.mark.slow

SEED = int(os.environ.get("DDPKIT_KILL_SEED", time.time_ns() % 100_000))


def rel_diff(a: dict, b: dict) -> float:
    out = 0.0
    for k, ref in b["full"]["model"].items():
        if ref.is_floating_point():
            got = a["full"]["model"][k].double()
            out = max(
                out, ((got - ref.double()).norm() / ref.double().norm().clamp(min=1e-12)).item()
            )
    return out


# the test job under ddpkit run, two restarts allowed, no sample log
UNDER_LAUNCHER = {"restarts": 2, "timeout": 180, "sample_log": None}


@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_sigkill_at_a_random_step_resumes_bitwise(tmp_path, user_env, strategy):
    rng = random.Random(SEED)
    job = ["--strategy", strategy, "--no-sync-bn"]  # each rank's own running statistics
    reference, _ = under_launcher(tmp_path, "reference", *job, env=user_env, **UNDER_LAUNCHER)
    trials = [
        ["--kill-rank", str(rng.randrange(2)), "--kill-step", str(rng.randrange(1, 30))],
        # a snapshot's index, values.pt or marker
        ["--kill-in-snapshot", str(rng.randrange(1, 10))],
    ]
    for i, args in enumerate(trials):
        final, trial = under_launcher(
            tmp_path, f"trial{i}", *job, *args, env=user_env, **UNDER_LAUNCHER
        )
        stderr = trial.stderr
        # Proof of the kill: a restart, and the agent's report of the first failure: the killed rank
        # (-9), or a survivor it stopped (-15) whose own error was stamped in an earlier second (the
        # agent's timestamps are whole seconds; on a loaded machine its poll can fall a second
        # behind the survivor's exception).
        assert final["attempt"] >= 1 and ("exitcode: -9" in stderr or "exitcode: -15" in stderr), (
            args
        )
        print(
            f"\n{strategy} (DDPKIT_KILL_SEED={SEED}) {' '.join(args)}: resumed from step "
            f"{final['resumed_from']}"
        )
        assert same_bits(final["full"], reference["full"], "model", "optim"), (
            f"{strategy} {args}: final state differs"
        )
        differs = rank_differences(tmp_path / f"trial{i}.pt", tmp_path / "reference.pt")
        assert differs == {0: [], 1: []}, (
            f"{strategy} {args}: a rank's own state differs: {differs}"
        )
    # Control: a run that differs by one step of data is not bitwise equal, and the checks see it.
    shorter, _ = under_launcher(
        tmp_path, "shorter", *job, "--max-steps", "29", env=user_env, **UNDER_LAUNCHER
    )
    assert not same_bits(shorter["full"], reference["full"], "model", "optim")
    assert all(rank_differences(tmp_path / "shorter.pt", tmp_path / "reference.pt").values())


@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_n_ranks_train_the_same_model_as_one_process(tmp_path, strategy):
    one = train_on_ranks(1, tmp_path / "w1", global_dropout=True, strategy=strategy)
    for world in (2, 3):
        diff = rel_diff(
            train_on_ranks(world, tmp_path / f"w{world}", global_dropout=True, strategy=strategy),
            one,
        )
        print(
            f"{strategy}: {world} ranks vs 1 process: largest relative weight difference {diff:.2e}"
        )
        assert diff < 1e-5
    # Control: BatchNorm over each rank's slice gives another model.
    local_bn = train_on_ranks(
        2, tmp_path / "local_bn", global_dropout=True, sync_batchnorm=False, strategy=strategy
    )
    assert rel_diff(local_bn, one) > 1e-2


@pytest.mark.parametrize("world", [1, 3])
def test_zero_snapshot_of_2_ranks_resumes_at_another_world_size(tmp_path, zero_reference, world):
    reference = zero_reference
    train_on_ranks(2, tmp_path / "run", max_steps=13, global_dropout=True, strategy="zero")
    final = train_on_ranks(world, tmp_path / "run", global_dropout=True, strategy="zero")
    assert final["resumed_from"] == 13 and final["step"] == 30
    diff = rel_diff(final, reference)
    print(f"zero stopped at 2 ranks, resumed at {world}: largest relative difference {diff:.1e}")
    assert diff < 1e-5
