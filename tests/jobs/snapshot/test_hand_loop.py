"""A hand-written loop with ``ddpkit.Snapshots`` under the real launcher: SIGKILLed at a random step
and restarted, it ends bit for bit where an uninterrupted run does (every rank's weights, BatchNorm
statistics and optimizer state); stopped on 2 ranks and resumed on 3, within 1e-5 relative.
Controls: a resume that leaves out the random streams (the model has dropout) or the loader's
position ends elsewhere, caught by the same comparison."""

from __future__ import annotations

import random

import pytest
import torch

from tests.jobs.snapshot.memory_jobs import HAND_STEPS as STEPS
from tests.jobs.snapshot.memory_jobs import SEED, hand_run
from tests.trainer_checks import same_bits


def newest_snapshot(kill_step: int) -> int:
    """The newest snapshot at a kill after ``kill_step`` (the killed rank waits for the write in
    flight): every 3 steps, one due at an epoch's last step (every 4th) taken a step later; 0 for
    none."""
    saved = [s + (s % 4 == 0) for s in range(3, STEPS + 1, 3)]
    return max([s for s in saved if s <= kill_step], default=0)


def tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value, key=str) for t in tensors(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors(v)]
    return [torch.tensor(float(value))] if isinstance(value, (int, float)) else []


def relative_difference(a: dict, b: dict) -> float:
    pairs = [
        (x.double(), y.double())
        for p in ("model", "optim")
        for x, y in zip(tensors(a[p]), tensors(b[p]))
    ]
    return max(
        float((x - y).abs().max() / y.abs().max().clamp_min(1e-12)) for x, y in pairs if x.numel()
    )


@pytest.mark.slow
# four 2-rank jobs, three of them restarted: about a minute, more under load
@pytest.mark.timeout(900)
def test_a_hand_loop_killed_at_a_random_step_ends_bitwise_and_controls_do_not(
    tmp_path, clean_env, hand_reference
):
    rng = random.Random(SEED)
    kill_rank, kill_step = rng.randrange(2), rng.randrange(3, STEPS)  # after the first snapshot
    reference = hand_reference
    killed = hand_run(
        tmp_path,
        "killed",
        "--kill-rank",
        str(kill_rank),
        "--kill-step",
        str(kill_step),
        env=clean_env,
    )
    what = f"rank {kill_rank} killed after step {kill_step} (DDPKIT_KILL_SEED={SEED})"
    assert all(r["attempt"] == 1 for r in killed), f"{what}: the job was not restarted"
    assert killed[0]["resumed_from"] == newest_snapshot(kill_step), what
    for rank in range(2):
        assert killed[rank]["steps"] == reference[rank]["steps"] == STEPS
        assert (
            killed[rank]["batches"] == reference[rank]["batches"][-len(killed[rank]["batches"]) :]
        ), what
        assert same_bits(killed[rank], reference[rank], "model", "optim"), (
            f"{what}: rank {rank} ends elsewhere"
        )
    print(f"\n{what}: resumed from step {killed[0]['resumed_from']}, every rank bitwise equal")
    # Controls: the same kill (after step 8: the snapshot of step 6 resumed, mid-epoch), the resume
    # leaving a part out. (Without the loader's position the run trains every epoch again.)
    for control in ("streams", "loader"):
        run = hand_run(tmp_path, control, "--kill-step", "8", "--control", control, env=clean_env)
        assert run[0]["attempt"] == 1 and run[0]["resumed_from"] == 6, control
        assert not any(same_bits(run[r], reference[r], "model", "optim") for r in range(2)), (
            f"leaving out the {control} went unnoticed"
        )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_hand_loop_stopped_on_2_ranks_resumes_on_3_within_tolerance(tmp_path, clean_env):
    # Global BatchNorm statistics and no dropout: at another world size the batches are the same and
    # the random streams reseeded, so what differs is the order of floating-point sums.
    same = ["--sync-bn", "--no-dropout"]
    reference = hand_run(tmp_path, "reference", *same, env=clean_env)
    hand_run(tmp_path, "first", *same, "--stop-after", "9", env=clean_env, run="moved")
    # 4 a rank: the same global batch of 12
    moved = hand_run(tmp_path, "moved", *same, nproc=3, env=clean_env)
    assert [r["resumed_from"] for r in moved] == [9, 9, 9]
    # epoch 2, its second batch: the global cursor, not 0
    assert moved[0]["batches"][0] == (2, 1, 10)
    worst = max(relative_difference(moved[r], reference[0]) for r in range(3))
    print(f"\n2 ranks -> 3 ranks after step 9: max relative difference {worst:.1e}")
    assert worst < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_hand_loop_with_copies_in_memory_loses_at_most_one_step_to_a_kill(
    tmp_path, memory_env, hand_reference
):
    env = memory_env
    rng = random.Random(SEED)
    kill_rank, kill_step = rng.randrange(2), rng.randrange(2, STEPS)
    reference = hand_reference
    kill = ["--kill-rank", str(kill_rank), "--kill-step", str(kill_step)]
    # No snapshot on disk: what the restart resumes from is the copy in memory.
    killed = hand_run(tmp_path, "memory", "--memory", "--every-steps", "0", *kill, env=env)
    what = f"rank {kill_rank} killed after step {kill_step} (DDPKIT_KILL_SEED={SEED})"
    assert all(r["attempt"] == 1 for r in killed), f"{what}: the job was not restarted"
    # Every step's copy, but at an epoch's last batch (the next step's copy holds it, with the
    # epoch's end).
    assert killed[0]["resumed_from"] == kill_step - (kill_step % 4 == 0), what
    assert all(same_bits(killed[r], reference[r], "model", "optim") for r in range(2)), (
        f"{what}: a rank ends elsewhere"
    )
    print(
        f"\n{what}, copies in memory: resumed from step {killed[0]['resumed_from']}, every rank "
        "bitwise equal"
    )
    # Control: without the copies in memory (and none on disk) the same kill starts over.
    plain = hand_run(tmp_path, "no-memory", "--every-steps", "0", *kill, env=env)
    assert plain[0]["attempt"] == 1 and plain[0]["resumed_from"] == 0
