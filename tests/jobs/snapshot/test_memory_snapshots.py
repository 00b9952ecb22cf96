"""Snapshots in shared memory with real processes: a SIGKILL inside the copy, and real 2-rank jobs
under ``ddpkit run`` killed with SIGKILL, resumed from memory losing at most one step and ending bit
for bit where an uninterrupted run does; the job's folder, memory full, two jobs on a node, and a
lost node served by a peer."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from ddpkit._launch.agent import jobdir
from ddpkit.distributed._channels import MEMORY
from ddpkit.snapshot import _codec as region
from ddpkit.snapshot import _slots as ms
from ddpkit.snapshot import _slots as mslot
from ddpkit.testing import wait_job, wait_until
from tests.jobs.launch import netns
from tests.jobs.snapshot.memory_jobs import (
    SEED,
    STEPS,
    check_exact,
    job_folders,
    lost_steps,
    memory_node_env,
    node_loss,
    run,
    start,
    steps_done,
)
from tests.tmpfs import small_tmpfs
from tests.trainer_checks import rank_differences, same_bits, use_reference
from tests.unit.snapshot.slots import store

KILL_IN_COPY = textwrap.dedent("""
    import os, signal, torch
    from ddpkit.snapshot import _slots as ms
    from tests.unit.snapshot.slots import save, store
    st = store({folder!r})
    tensors = [torch.full((4096,), 1.0), torch.full((4096,), 1.0)]
    save(st, 1, tensors)
    save(st, 2, [t + 1 for t in tensors])
    copy = ms.copy_tensors
    def dying(dests, sources):  # the first tensor of step 3 copied, then SIGKILL
        copy(dests[:1], sources[:1])
        os.kill(os.getpid(), signal.SIGKILL)
    ms.copy_tensors = dying
    save(st, 3, [t + 2 for t in tensors])
""")


def test_a_kill_during_the_copy_leaves_the_previous_state_whole(tmp_path, run_python):
    proc = run_python(KILL_IN_COPY.format(folder=str(tmp_path)), timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    found = store(tmp_path).found()
    assert [f.step for f in found] == [2]  # step 3's slot is not whole; step 2's is untouched
    got = mslot.read_slot(found[0].path, data=True)
    assert got is not None
    assert all(
        torch.equal(t, torch.full((4096,), 2.0)) for t in mslot.tensors_of(got[3], got[0], got[1])
    )
    # Control: the slot the kill interrupted holds half of step 3 over step 1: loaded, it would be a
    # state that never existed. Only its commit record (begin != end) keeps it out.
    torn = next(p for p in tmp_path.glob("*.slot") if p != found[0].path)
    record = mslot.Record.unpack(torn.read_bytes()[: mslot.HEADER])
    # begun as 3, ended as 1
    assert record is not None and record.begin == record.end + 2 and not record.whole
    manifest = json.loads(
        torn.read_bytes()[record.manifest[0] : record.manifest[0] + record.manifest[1]]
    )
    data = torch.frombuffer(bytearray(torn.read_bytes()[record.data[0] :]), dtype=torch.uint8)
    first, second = region.views(
        data, [region.Spec(d, tuple(s), o) for d, s, o in manifest["specs"]]
    )
    assert torch.equal(first, torch.full((4096,), 3.0)) and torch.equal(
        second, torch.full((4096,), 1.0)
    )


# -- real jobs under ddpkit run, killed with SIGKILL -----------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)  # five 2-rank jobs on 2 shared cores
def test_sigkill_at_random_instants_resumes_from_memory_bitwise_losing_at_most_one_step(
    tmp_path, memory_env, memory_reference
):
    rng = random.Random(SEED)
    reference = use_reference(memory_reference, tmp_path)
    report = []
    for i in range(3):
        rank, after, delay = rng.randrange(2), rng.randrange(2, STEPS - 3), rng.uniform(0, 0.03)
        args = [
            "--kill-rank",
            str(rank),
            "--kill-after-step",
            str(after),
            "--kill-delay",
            f"{delay:.4f}",
        ]
        name = f"trial{i}"
        final, job = run(tmp_path, name, *args, env=memory_env)
        assert list((tmp_path / f"{name}-log").glob("killed-*")), (
            f"{args}: no worker was killed (seed {SEED})"
        )
        assert final["attempt"] == 1, f"{args}: not restarted once (seed {SEED})"
        assert [r["file"] for r in job.events("resume")] == ["memory"], f"{args} (seed {SEED})"
        lost = lost_steps(tmp_path / f"{name}-log", tmp_path / name)
        report.append((" ".join(args), final["resumed_from"], lost))
        assert len(lost) == 1 and 0 <= lost[0] <= 1, f"{args}: lost {lost} steps (seed {SEED})"
        check_exact(tmp_path, name, final, reference, " ".join(args))
    # Control: the same kind of kill with the snapshots in memory off (and none on disk) starts
    # over.
    args = ["--no-memory", "--kill-rank", "1", "--kill-after-step", "12"]
    final, _ = run(tmp_path, "no-memory", *args, env=memory_env)
    lost = lost_steps(tmp_path / "no-memory-log", tmp_path / "no-memory")
    report.append(("control: --no-memory, kill after step 12", final["resumed_from"], lost))
    print(f"\nkills at random instants (DDPKIT_KILL_SEED={SEED}):")
    for text, resumed, steps in report:
        print(f"  {text:58s} resumed from step {resumed}, steps lost {steps}")
    assert final["resumed_from"] is None and lost[0] >= 12
    check_exact(tmp_path, "no-memory", final, reference, "control")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_chosen_interval_bounds_the_steps_lost(tmp_path, memory_env, memory_reference):
    # This job's copy to memory takes a few % of its step: within 5%, it would save every step. With
    # a budget of 0.5% the interval chosen after the first saves is larger, and a failure loses up
    # to that many steps.
    reference = use_reference(memory_reference, tmp_path)
    args = [
        "--memory-every",
        "auto",
        "--stall-budget",
        "0.005",
        "--kill-rank",
        "0",
        "--kill-after-step",
        "21",
    ]
    final, job = run(tmp_path, "auto", *args, env=memory_env)
    # the first attempt's choice first (its record moved aside where it is not before the step
    # resumed from), then the one the resumed run made again
    moved = tmp_path / "auto" / "metrics.rewound.jsonl"
    rewound = list(map(json.loads, moved.read_text().splitlines())) if moved.exists() else []
    events = [r for r in rewound if r.get("event") == "memory_snapshots"]
    events = sorted(events + job.events("memory_snapshots"), key=lambda r: r["time"])
    every = events[0]["every_steps"]
    print(
        f"\nchosen: every {every} steps (stall {events[0]['stall_ms']} ms, step "
        f"{events[0]['step_ms']} ms); resumed from {final['resumed_from']}"
    )
    # The largest interval any rank needs: rank 0's stall within the budget of its steps (rounded to
    # the us).
    assert events[0]["stall_ms"] <= 0.005 * every * events[0]["step_ms"] + 1e-3 and every > 1
    lost = lost_steps(tmp_path / "auto-log", tmp_path / "auto")
    assert [r["file"] for r in job.events("resume")] == ["memory"] and lost[0] <= every
    check_exact(tmp_path, "auto", final, reference, "chosen interval")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_kill_inside_the_copy_resumes_every_rank_from_the_step_before_with_loader_workers(
    tmp_path, memory_env
):
    # Augmentation drawn in 2 loader workers per rank, BatchNorm without sync (each rank's own
    # statistics).
    flags = ["--augment", "--workers", "2", "--no-sync-bn"]
    reference, _ = run(tmp_path, "reference", *flags, env=memory_env)
    for rank, step in ((0, 17), (1, 10)):  # mid-epoch, and the last step of an epoch
        name = f"in-copy-rank{rank}"
        kill = ["--kill-in-copy", str(step), "--kill-in-copy-rank", str(rank)]
        final, _ = run(tmp_path, name, *flags, *kill, env=memory_env)
        assert (tmp_path / f"{name}-log" / f"killed-in-copy-step{step}").exists()
        # The killed rank's step was half-copied: every rank resumes from the step before, which all
        # hold.
        assert final["attempt"] == 1 and final["resumed_from"] == step - 1, final["resumed_from"]
        assert lost_steps(tmp_path / f"{name}-log", tmp_path / name) == [1]
        check_exact(tmp_path, name, final, reference, name)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_job_folder_goes_when_the_job_ends_normally_on_failure_and_on_sigterm(
    tmp_path, memory_env
):
    # The launcher told to make no folder: the Trainer says why and trains with disk snapshots only.
    _, off = run(tmp_path, "off", "--epochs", "1", env=memory_env | {jobdir.OFF_ENV: "0"})
    assert {p.read_text() for p in (tmp_path / "off-log").glob("memory-rank*")} == {"off"}
    assert "snapshots in memory are off" in off.stdout + off.stderr and job_folders(tmp_path) == []
    run(tmp_path, "normal", "--epochs", "1", env=memory_env)
    assert {p.read_text() for p in (tmp_path / "normal-log").glob("memory-rank*")} == {"on"}
    assert job_folders(tmp_path) == []
    _, failed = run(
        tmp_path,
        "failed",
        "--epochs",
        "1",
        "--raise-at",
        "1",
        "5",
        env=memory_env,
        restarts=0,
        code=1,
    )
    out = failed.stdout + failed.stderr
    assert "planned failure in user code on rank 1" in out and job_folders(tmp_path) == []
    # SIGTERM to the launcher mid-training: the workers save to disk and exit 75; the folder goes
    # too.
    proc = start(tmp_path, "stopped", "--epochs", "30", env=memory_env, stderr=subprocess.STDOUT)
    wait_until(lambda: steps_done(tmp_path / "stopped-log") >= 3, what="3 steps of the job")
    folders = job_folders(tmp_path)
    found = (folders[0] / MEMORY).glob("*.slot") if folders else []
    slots = sorted(p.name.split("-", 1)[1] for p in found)
    proc.send_signal(signal.SIGTERM)
    stopped = wait_job(proc, 120)
    assert stopped.returncode == 75, stopped.stdout[-2000:]
    # Control: while it ran, the job had its folder, with both slots of both ranks.
    assert len(folders) == 1 and slots == [
        "rank0-0.slot",
        "rank0-1.slot",
        "rank1-0.slot",
        "rank1-1.slot",
    ]
    assert job_folders(tmp_path) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_sigkilled_launchers_folder_is_never_loaded_and_the_next_job_sweeps_it(
    tmp_path, memory_env
):
    proc = start(
        tmp_path, "run", "--epochs", "30", env=memory_env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_until(lambda: steps_done(tmp_path / "run-log") >= 5, what="5 steps of the job")
    # the launcher (the agent) dies without clean-up; its workers die with it (parent-death signal)
    proc.kill()
    proc.wait()
    pids = [int(p.read_text()) for p in (tmp_path / "run-log").glob("pid-rank*")]
    wait_until(
        lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids),
        60,
        what=f"the workers {pids} to end",
    )
    (stale,) = job_folders(tmp_path)
    # Control: the stale slots are whole and belong to this very run directory: only the job key (a
    # new job, a new folder) keeps the next job from resuming from them.
    read = (mslot.read_slot(p) for p in (stale / MEMORY).glob("*.slot"))
    whole = [w for w in read if w is not None]
    assert len(whole) >= 2 and {w[2]["run"] for w in whole} == {ms.run_key(tmp_path / "run")}
    # the same run directory, resumed
    _, job = run(tmp_path, "run", "--epochs", "3", env=memory_env)
    assert not stale.exists() and job_folders(tmp_path) == []
    # no disk snapshot: from the start
    assert job.events("resume") == [] and "resumed from memory" not in job.stdout + job.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_memory_full_falls_back_to_disk_snapshots_with_one_warning(
    tmp_path, memory_env, memory_reference
):
    reference = use_reference(memory_reference, tmp_path)
    # The job starts with room (the agent wants 1 MiB free); then the shared memory fills, leaving
    # 16 KiB: a slot (64 KiB of values alone) does not fit.
    with small_tmpfs(tmp_path / "shm", "2m"):
        args = ["--disk-every-steps", "3", "--kill-rank", "1", "--kill-after-step", "14"]
        args += ["--fill-memory", str(16 << 10)]
        final, job = run(tmp_path, "full", *args, env=memory_env)
    out = job.stdout + job.stderr
    warnings = [line for line in out.splitlines() if "snapshots in memory stop" in line]
    print("\n" + "\n".join(warnings))
    assert len(warnings) == 2  # rank 0's, once per attempt (rank 1's is in its own log)
    assert all("rank 0 (no room for" in w and "No space left on device" in w for w in warnings)
    # From disk: the newest snapshot, or the one before it if the newest was still being written
    # (async).
    assert [r["file"] for r in job.events("resume")] in (["step-00000012"], ["step-00000009"])
    check_exact(tmp_path, "full", final, reference, "memory full")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_jobs_on_one_node_keep_their_own_folders(tmp_path, memory_env, memory_reference):
    reference = use_reference(memory_reference, tmp_path)
    # Job A is killed only after job B has started (its agent sweeps stale folders) and finished.
    done = tmp_path / "b-finished"
    kill = ("--kill-rank", "1", "--kill-after-step", "20", "--kill-when-file", str(done))
    a = start(tmp_path, "a", *kill, env=memory_env, stderr=subprocess.STDOUT)
    wait_until(lambda: steps_done(tmp_path / "a-log") >= 20, what="20 steps of job A")
    run(tmp_path, "b", "--epochs", "1", env=memory_env)
    assert len(job_folders(tmp_path)) == 1  # A's, still there; B's is gone
    done.touch()
    job_a = wait_job(a, 300, run_dir=tmp_path / "a")
    assert job_a.returncode == 0, job_a.stdout[-3000:]
    final = torch.load(tmp_path / "a.pt", weights_only=False)
    assert final["attempt"] == 1 and [r["file"] for r in job_a.events("resume")] == ["memory"]
    # Killed by a timer right after step 20, before or after its copy to memory: from step 19 or 20.
    lost = lost_steps(tmp_path / "a-log", tmp_path / "a")
    assert final["resumed_from"] in (19, 20) and lost == [20 - final["resumed_from"]], (
        final["resumed_from"],
        lost,
    )
    check_exact(tmp_path, "a", final, reference, "job A")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_zero_and_fsdp_resume_a_killed_worker_from_memory_bitwise(
    tmp_path, memory_env, strategy_references, strategy
):
    job = ["--strategy", strategy, "--no-sync-bn"]  # shards, and each rank's own running statistics
    reference = use_reference(strategy_references(strategy), tmp_path)
    kill = ["--kill-rank", "1", "--kill-after-step", "13", "--kill-delay", "0.002"]
    final, killed = run(tmp_path, "killed", *job, *kill, env=memory_env)
    assert list((tmp_path / "killed-log").glob("killed-*")) and final["attempt"] == 1
    assert [r["file"] for r in killed.events("resume")] == ["memory"]
    assert lost_steps(tmp_path / "killed-log", tmp_path / "killed")[0] <= 1
    assert same_bits(final["full"], reference["full"], "model", "optim")
    assert rank_differences(tmp_path / "killed.pt", tmp_path / "reference.pt") == {0: [], 1: []}


# -- a lost node ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_node_resumes_from_a_peers_memory_bitwise(tmp_path):
    with netns.two_nodes(f"dm{os.getpid() % 100000}") as nodes:
        # The uninterrupted run, on one node with the same thread count (two nodes of one rank train
        # the same weights as one node of two: tests/jobs/launch/test_multinode.py).
        reference, _ = run(tmp_path, "reference", env=memory_node_env(tmp_path))
        final, lost = node_loss(nodes, tmp_path, "lost", 29431)
        assert {p.read_text() for p in (tmp_path / "lost-log").glob("memory-rank*")} == {"peers"}
        (event,) = lost.events("resume")
        print(f"\nnode b lost after step 15: {event['file']} at step {event['step']}")
        # Both ranks held after step 15, before its copy: step 14, which the surviving node holds
        # for both ranks.
        assert event["file"].startswith("memory (ranks [") and "from rank" in event["file"]
        assert event["step"] == 14 and final["resumed_from"] == 14
        check_exact(tmp_path, "lost", final, reference, "a lost node", samples=False)
        # Control: without every rank's own part on the survivors, the new node's rank has nothing
        # to resume from but the disk (no snapshot there: the start).
        final, no_peers = node_loss(nodes, tmp_path, "no-peers", 29432, "--no-peers")
        assert no_peers.events("resume") == [] and final["resumed_from"] is None
        check_exact(tmp_path, "no-peers", final, reference, "control", samples=False)
