"""Kill workers with SIGKILL under the real launcher; the restarted job must end bit for bit where
an uninterrupted one does, having trained on every sample exactly once per epoch."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from ddpkit.testing import run_job
from tests.jobs.scripts.train_job import N_SAMPLES, under_launcher
from tests.tmpfs import small_tmpfs
from tests.trainer_checks import (
    assert_each_sample_once,
    bitwise_equal,
    max_abs_diff,
    rank_differences,
    rank_max_abs_diff,
    resume_steps,
    samples_per_epoch,
    use_reference,
)

JOB = str(Path(__file__).parents[1] / "scripts" / "train_job.py")
STEPS = 30  # 3 epochs of 10 steps; snapshots every 3 steps and at epoch ends
SEED = int(os.environ.get("DDPKIT_KILL_SEED", time.time_ns() % 100_000))


@pytest.mark.slow
# four 2-rank jobs, two of them restarted: about a minute, more under load
@pytest.mark.timeout(600)
def test_sigkill_at_random_steps_resumes_bitwise(tmp_path, user_env, train_reference):
    rng = random.Random(SEED)
    reference = use_reference(train_reference, tmp_path)
    trials = [
        (
            "rank 0 at a random step",
            ["--kill-rank", "0", "--kill-step", str(rng.randrange(1, STEPS))],
        ),
        (
            "rank 1 at a random step",
            ["--kill-rank", "1", "--kill-step", str(rng.randrange(1, STEPS))],
        ),
        # write_atomic calls cycle through a snapshot's index, values.pt and marker; all are covered
        # over runs
        ("rank 0 inside a snapshot write", ["--kill-in-snapshot", str(rng.randrange(1, 9))]),
    ]
    report = []
    for i, (what, args) in enumerate(trials):
        final, _ = under_launcher(tmp_path, f"trial{i}", *args, env=user_env, timeout=120)
        # Proof of the kill: the worker sent itself SIGKILL (its mark), and the job went on as a
        # restart.
        assert list((tmp_path / f"trial{i}-log").glob("killed-*")), (
            f"{what}: no worker was killed (seed {SEED})"
        )
        assert final["attempt"] >= 1, f"{what}: the job was not restarted (seed {SEED})"
        resumed = resume_steps(tmp_path / f"trial{i}")
        assert_each_sample_once(
            samples_per_epoch(tmp_path / f"trial{i}-log", resumed), N_SAMPLES, 3
        )
        report.append(
            (
                what,
                " ".join(args),
                final["attempt"],
                final["resumed_from"],
                max_abs_diff(final, reference),
            )
        )
        assert bitwise_equal(final, reference), f"{what} ({args}, seed {SEED}): final state differs"
        differs = rank_differences(tmp_path / f"trial{i}.pt", tmp_path / "reference.pt")
        assert differs == {0: [], 1: []}, (
            f"{what} ({args}, seed {SEED}): a rank's own state differs: {differs}"
        )
    print(f"\nkill trials (DDPKIT_KILL_SEED={SEED}): {len(report)} of {len(trials)} kills survived")
    for what, args, attempt, step, diff in report:
        print(
            f"  {what:32s} {args:28s} restarts {attempt}  resumed from step {step}  max |dw| "
            f"{diff:.1e}"
        )


@pytest.mark.slow
def test_a_failing_rank_stops_the_job_fast_and_restart_resumes(tmp_path, user_env, train_reference):
    # No restarts: the exception in user code on rank 1 at step 7 ends every rank, with a summary.
    start = time.monotonic()
    proc = run_job(JOB, str(tmp_path / "fail"), "--raise-at", "1", "7", env=user_env, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    summary = proc.stderr[proc.stderr.index("ddpkit run:") :]
    assert "first: rank 1" in summary
    assert "RuntimeError: planned failure in user code on rank 1" in summary
    assert "rank 1 failed in epoch 0, at optimizer step 7" in summary
    print(
        f"\nfailure at step 7 on rank 1: job ended in {elapsed:.1f}s (collective timeout is 300s)"
    )
    # With restarts the job resumes from the snapshot of step 6 and ends where an uninterrupted run
    # does.
    reference = use_reference(train_reference, tmp_path)
    final, _ = under_launcher(
        tmp_path, "restarted", "--raise-at", "1", "7", env=user_env, timeout=120
    )
    assert final["attempt"] == 1 and final["resumed_from"] == 6
    assert bitwise_equal(final, reference)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--snapshot-sync"]], ids=["async", "sync"])
def test_a_full_disk_during_a_snapshot_is_named_in_the_launchers_summary(tmp_path, user_env, mode):
    # The snapshots on a small file system of their own, which rank 0 fills at step 7: the snapshot
    # of step 9 cannot be written (asynchronously: its error is raised by the save of step 10).
    with small_tmpfs(tmp_path / "run" / "snapshots", "1m"):
        proc = run_job(
            JOB, str(tmp_path / "run"), "--fill-disk-at", "7", *mode, env=user_env, timeout=120
        )
        whole = sorted(p.name for p in (tmp_path / "run" / "snapshots").glob("step-*"))
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = proc.stderr[proc.stderr.index("ddpkit run:") :]
    print(f"\n{summary}")
    first = summary.splitlines()[1]
    assert first.startswith("  SnapshotWriteError: ddpkit: snapshot ")
    assert "step-00000009 was not written: no space left on device" in first
    assert "step-00000006, is whole and untouched: a restart resumes from it" in first
    assert ("(written in the background)" in first) == (mode == [])
    assert whole == ["step-00000003", "step-00000006"]  # nothing half-written left


# The step a kill lands on, and the snapshot the restarted job resumes from (snapshots every 3 steps
# and at epoch ends; 10 steps per epoch): mid-epoch, and at the boundary of epochs 1 and 2. Kill
# step -> the snapshots the job may resume from: the newest one, or the one before it when the
# newest was still being written in the background (asynchronous snapshots) when the kill came.
WORKER_KILLS = {"mid-epoch": (14, (12, 10)), "epoch boundary": (10, (10, 9))}


@pytest.mark.slow
# five jobs of 2 ranks x 3 processes on 2 cores: about 2 minutes, more under load
@pytest.mark.timeout(600)
def test_sigkill_with_two_loader_workers_per_rank_resumes_bitwise(tmp_path, user_env):
    # Augmentation in __getitem__ (torch, numpy, python draws) in 2 persistent workers per
    # rank: each sample's draws are a function of (seed, epoch, index), so the restarted job
    # augments as the uninterrupted one. BatchNorm without sync BatchNorm: each rank's own running
    # statistics.
    workers = ["--augment", "--workers", "2", "--no-sync-bn"]
    reference, _ = under_launcher(tmp_path, "reference", *workers, env=user_env, timeout=120)
    for what, (kill_step, resumed_from) in WORKER_KILLS.items():
        name = what.replace(" ", "-")
        final, _ = under_launcher(
            tmp_path,
            name,
            *workers,
            "--kill-rank",
            "1",
            "--kill-step",
            str(kill_step),
            env=user_env,
            timeout=120,
        )
        killed = list((tmp_path / f"{name}-log").glob("killed-*"))
        assert killed and final["attempt"] == 1 and final["resumed_from"] in resumed_from, what
        assert_each_sample_once(
            samples_per_epoch(tmp_path / f"{name}-log", resume_steps(tmp_path / name)), N_SAMPLES, 3
        )
        print(
            f"\n{what}: killed at step {kill_step}, resumed from {final['resumed_from']}: max |dw| "
            f"{max_abs_diff(final, reference):.1e}"
        )
        assert bitwise_equal(final, reference), what
        assert rank_differences(tmp_path / f"{name}.pt", tmp_path / "reference.pt") == {
            0: [],
            1: [],
        }, what
    # Control: left to the workers' own streams (how loaders draw without ddpkit's seeding), the
    # same kill at the epoch boundary ends elsewhere: the restarted workers' streams start afresh.
    unseeded = [*workers, "--unseeded-samples"]
    plain_reference, _ = under_launcher(
        tmp_path, "plain-reference", *unseeded, env=user_env, timeout=120
    )
    plain, _ = under_launcher(
        tmp_path,
        "plain-killed",
        *unseeded,
        "--kill-rank",
        "1",
        "--kill-step",
        "10",
        env=user_env,
        timeout=120,
    )
    assert plain["resumed_from"] in WORKER_KILLS["epoch boundary"][1]
    print(f"control, unseeded samples: max |dw| {max_abs_diff(plain, plain_reference):.1e}")
    assert not bitwise_equal(plain, plain_reference)


# BatchNorm without sync BatchNorm keeps each rank's own running statistics; with dropout and 2
# micro-batches per step. The killed rank first waits for the snapshot in flight, so that the
# restart resumes from the snapshot the trial is about: kill -> the snapshot resumed from.
LOCAL_BN = ["--no-sync-bn", "--grad-accum", "2"]
LOCAL_BN_KILLS = {
    "rank 1 mid-epoch": (["--kill-rank", "1", "--kill-step", "14", "--kill-after-write"], 12),
    "rank 0 at an epoch end": (["--kill-rank", "0", "--kill-step", "20", "--kill-after-write"], 20),
    # Rank 0 damages the newest snapshot (step 15) before it dies: the one before it is used.
    "newest snapshot damaged": (["--kill-rank", "0", "--kill-step", "17", "--damage-newest"], 12),
}


@pytest.mark.slow
@pytest.mark.timeout(600)  # five 2-rank jobs: about 2 minutes, more under load
def test_sigkill_without_sync_batchnorm_resumes_every_rank_bitwise(tmp_path, user_env):
    reference, _ = under_launcher(tmp_path, "reference", *LOCAL_BN, env=user_env, timeout=120)
    for what, (kill, resumed_from) in LOCAL_BN_KILLS.items():
        name = what.replace(" ", "-")
        final, job = under_launcher(tmp_path, name, *LOCAL_BN, *kill, env=user_env, timeout=120)
        assert list((tmp_path / f"{name}-log").glob("killed-*")) and final["attempt"] == 1, what
        assert final["resumed_from"] == resumed_from, (what, final["resumed_from"])
        if "damaged" in what:
            assert "__1_0.distcp not matching its checksum" in job.stdout + job.stderr, what
        assert_each_sample_once(
            samples_per_epoch(tmp_path / f"{name}-log", resume_steps(tmp_path / name)), N_SAMPLES, 3
        )
        print(
            f"\n{what}: resumed from {final['resumed_from']}: max |dw| over both ranks "
            f"{rank_max_abs_diff(tmp_path / f'{name}.pt', tmp_path / 'reference.pt'):.1e}"
        )
        differs = rank_differences(tmp_path / f"{name}.pt", tmp_path / "reference.pt")
        assert differs == {0: [], 1: []}, f"{what}: {differs}"
    # Control: each rank's own buffers saved as one copy per key (DCP's way with a replicated key,
    # the save of the version before) make the same mid-epoch kill end elsewhere.
    kill, resumed_from = LOCAL_BN_KILLS["rank 1 mid-epoch"]
    final, _ = under_launcher(
        tmp_path, "one-copy", *LOCAL_BN, *kill, "--shared-buffers", env=user_env, timeout=120
    )
    assert final["resumed_from"] == resumed_from
    differs = rank_differences(tmp_path / "one-copy.pt", tmp_path / "reference.pt")
    diff = rank_max_abs_diff(tmp_path / "one-copy.pt", tmp_path / "reference.pt")
    print(f"control, one copy per key: max |dw| {diff:.1e}, differing: {differs}")
    assert any(differs.values())
