"""zero and fsdp under the real launcher and at several world sizes (minutes: ``pytest -m slow``).

SIGKILL at a random step resumes bit for bit, every rank's state (BatchNorm without sync BatchNorm:
each rank's own running statistics); N ranks train what one process trains; a zero snapshot resumes
at another world size."""

from __future__ import annotations

import functools
import os
import random
import time
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit.testing import run_job, without_launch_env
from tests.jobs.scripts.train_job import train
from tests.trainer_checks import rank_differences

pytestmark = pytest.mark.slow

JOB = str(Path(__file__).parents[1] / "scripts" / "train_job.py")
SEED = int(os.environ.get("DDPKIT_KILL_SEED", time.time_ns() % 100_000))


def bitwise_equal_full(a: dict, b: dict) -> bool:
    """The gathered model and optimizer states (``full``) identical to the bit, key by key."""
    for part in ("model", "optim"):
        x, y = a["full"][part], b["full"][part]
        if x.keys() != y.keys():
            return False
        for k in x:
            same = torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k]
            if not same:
                return False
    return True


def rel_diff(a: dict, b: dict) -> float:
    out = 0.0
    for k, ref in b["full"]["model"].items():
        if ref.is_floating_point():
            got = a["full"]["model"][k].double()
            out = max(
                out, ((got - ref.double()).norm() / ref.double().norm().clamp(min=1e-12)).item()
            )
    return out


@pytest.fixture
def clean_env() -> dict[str, str]:
    return without_launch_env({k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})


def launch(tmp: Path, name: str, *job_args: str, clean_env: dict) -> tuple[dict, str]:
    job = (str(tmp / name), "--out", str(tmp / f"{name}.pt"), *job_args)
    proc = run_job(JOB, *job, launcher_args=("--max-restarts", "2"), env=clean_env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp / f"{name}.pt", weights_only=False), proc.stderr


@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_sigkill_at_a_random_step_resumes_bitwise(tmp_path, clean_env, strategy):
    rng = random.Random(SEED)
    job = ["--strategy", strategy, "--no-sync-bn"]  # each rank's own running statistics
    reference, _ = launch(tmp_path, "reference", *job, clean_env=clean_env)
    trials = [
        ["--kill-rank", str(rng.randrange(2)), "--kill-step", str(rng.randrange(1, 30))],
        # a snapshot's index, values.pt or marker
        ["--kill-in-snapshot", str(rng.randrange(1, 10))],
    ]
    for i, args in enumerate(trials):
        final, stderr = launch(tmp_path, f"trial{i}", *job, *args, clean_env=clean_env)
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
        assert bitwise_equal_full(final, reference), f"{strategy} {args}: final state differs"
        differs = rank_differences(tmp_path / f"trial{i}.pt", tmp_path / "reference.pt")
        assert differs == {0: [], 1: []}, (
            f"{strategy} {args}: a rank's own state differs: {differs}"
        )
    # Control: a run that differs by one step of data is not bitwise equal, and the checks see it.
    shorter, _ = launch(tmp_path, "shorter", *job, "--max-steps", "29", clean_env=clean_env)
    assert not bitwise_equal_full(shorter, reference)
    assert all(rank_differences(tmp_path / "shorter.pt", tmp_path / "reference.pt").values())


def run(world: int, run_dir: Path, **kwargs) -> dict:
    return ddpkit.spawn(functools.partial(train, str(run_dir), **kwargs), world)[0]


@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_n_ranks_train_the_same_model_as_one_process(tmp_path, strategy):
    one = run(1, tmp_path / "w1", global_dropout=True, strategy=strategy)
    for world in (2, 3):
        diff = rel_diff(
            run(world, tmp_path / f"w{world}", global_dropout=True, strategy=strategy), one
        )
        print(
            f"{strategy}: {world} ranks vs 1 process: largest relative weight difference {diff:.2e}"
        )
        assert diff < 1e-5
    # Control: BatchNorm over each rank's slice gives another model.
    local_bn = run(
        2, tmp_path / "local_bn", global_dropout=True, sync_batchnorm=False, strategy=strategy
    )
    assert rel_diff(local_bn, one) > 1e-2


@pytest.mark.parametrize("world", [1, 3])
def test_zero_snapshot_of_2_ranks_resumes_at_another_world_size(tmp_path, world):
    reference = run(2, tmp_path / "reference", global_dropout=True, strategy="zero")
    run(2, tmp_path / "run", max_steps=13, global_dropout=True, strategy="zero")
    final = run(world, tmp_path / "run", global_dropout=True, strategy="zero")
    assert final["resumed_from"] == 13 and final["step"] == 30
    diff = rel_diff(final, reference)
    print(f"zero stopped at 2 ranks, resumed at {world}: largest relative difference {diff:.1e}")
    assert diff < 1e-5
