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
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ddpkit._launch.agent import jobdir
from ddpkit.snapshot import _codec as region
from ddpkit.snapshot import _slots as ms
from ddpkit.snapshot import _slots as mslot
from ddpkit.testing import run_job as launch
from ddpkit.testing import start_job, wait_until
from tests.jobs.scripts.train_job import N_SAMPLES
from tests.tmpfs import small_tmpfs
from tests.trainer_checks import (
    assert_each_sample_once,
    bitwise_equal,
    max_abs_diff,
    rank_differences,
    resume_steps,
    samples_per_epoch,
)
from tests.unit.snapshot.test_memory_snapshots import store

ROOT = Path(__file__).resolve().parents[3]
JOB = str(Path(__file__).parents[1] / "scripts" / "memory_job.py")
SEED = int(os.environ.get("DDPKIT_KILL_SEED", time.time_ns() % 100_000))
STEPS = 30  # 3 epochs of 10 steps; no disk snapshot unless asked

KILL_IN_COPY = textwrap.dedent("""
    import os, signal, torch
    from ddpkit.snapshot import _slots as ms
    from tests.unit.snapshot.test_memory_snapshots import save, store
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


def test_a_kill_during_the_copy_leaves_the_previous_state_whole(tmp_path, clean_env):
    code = KILL_IN_COPY.format(folder=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", code], env=clean_env, capture_output=True, text=True, timeout=60
    )
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


@pytest.fixture
def job_env(clean_env, tmp_path) -> dict[str, str]:
    """The launcher's environment, with the job folders of the test under ``tmp_path/shm``."""
    (tmp_path / "shm").mkdir()
    return clean_env | {jobdir.ROOT_ENV: str(tmp_path / "shm")}


def job_args(tmp: Path, name: str, *args: str) -> list[str]:
    (tmp / f"{name}-log").mkdir(exist_ok=True)
    return [
        str(tmp / name),
        "--log",
        str(tmp / f"{name}-log"),
        "--out",
        str(tmp / f"{name}.pt"),
        *args,
    ]


def start(tmp: Path, name: str, *args: str, env: dict, **streams: int) -> subprocess.Popen:
    """The job started in ``tmp``, two restarts allowed, for the tests that signal or kill the
    launcher while it runs; ``streams``: where its ``stdout`` and ``stderr`` go."""
    restart = ("--max-restarts", "2")
    job = job_args(tmp, name, *args)
    return start_job(JOB, *job, launcher_args=restart, env=env, cwd=tmp, **streams)


def run_job(
    tmp: Path, name: str, *args: str, env: dict, restarts: int = 2, code: int = 0
) -> tuple[dict, str]:
    restart = ("--max-restarts", str(restarts))
    proc = launch(
        JOB, *job_args(tmp, name, *args), launcher_args=restart, env=env, cwd=tmp, timeout=300
    )
    assert proc.returncode == code, proc.stderr[-3000:]
    final = torch.load(tmp / f"{name}.pt", weights_only=False) if code == 0 else {}
    return final, proc.stdout + proc.stderr


def resumes(run_dir: Path) -> list[dict]:
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r for r in records if r.get("event") == "resume"]


def lost_steps(log: Path, run_dir: Path) -> list[int]:
    """Per failure: optimizer steps completed before it (over every rank) minus the step resumed
    from."""
    done: dict[int, int] = {}
    for path in log.glob("steps-rank*.txt"):
        for attempt, step in (map(int, line.split()) for line in path.read_text().splitlines()):
            done[attempt] = max(done.get(attempt, 0), step)
    resumed = resume_steps(run_dir)
    return [done.get(a, 0) - resumed[a + 1] for a in sorted(done) if a + 1 in resumed]


def check_exact(
    tmp: Path, name: str, final: dict, reference: dict, what: str, samples: bool = True
) -> None:
    """Bitwise the reference's final state on every rank; and every sample once per epoch
    (``samples``: the sample log tells attempts apart by the agent's restart count, which a
    replacement node starts afresh)."""
    if samples:
        assert_each_sample_once(
            samples_per_epoch(tmp / f"{name}-log", resume_steps(tmp / name)), N_SAMPLES, 3
        )
    assert bitwise_equal(final, reference), (
        f"{what} (seed {SEED}): max |dw| {max_abs_diff(final, reference):.1e}"
    )
    differs = rank_differences(tmp / f"{name}.pt", tmp / "reference.pt")
    assert differs == {0: [], 1: []}, f"{what} (seed {SEED}): a rank's own state differs: {differs}"


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory) -> Path:
    """An uninterrupted run of the job (``reference.pt`` and each rank's
    ``reference.pt.rank<r>``)."""
    from tests.conftest import _clean_environ

    tmp = tmp_path_factory.mktemp("reference")
    (tmp / "shm").mkdir()
    run_job(tmp, "reference", env=_clean_environ() | {jobdir.ROOT_ENV: str(tmp / "shm")})
    return tmp


def use_reference(reference_dir: Path, tmp: Path) -> dict:
    for path in reference_dir.glob("reference.pt*"):
        (tmp / path.name).write_bytes(path.read_bytes())
    return torch.load(tmp / "reference.pt", weights_only=False)


def job_folders(tmp: Path) -> list[Path]:
    """The folders of the jobs in shared memory."""
    base = tmp / "shm" / f"ddpkit-memory-{os.getuid()}"
    return sorted(base.iterdir()) if base.exists() else []


def steps_done(log: Path, rank: int = 0) -> int:
    path = log / f"steps-rank{rank}.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow
@pytest.mark.timeout(900)  # five 2-rank jobs on 2 shared cores
def test_sigkill_at_random_instants_resumes_from_memory_bitwise_losing_at_most_one_step(
    tmp_path, job_env, plain_reference
):
    rng = random.Random(SEED)
    reference = use_reference(plain_reference, tmp_path)
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
        final, _ = run_job(tmp_path, name, *args, env=job_env)
        assert list((tmp_path / f"{name}-log").glob("killed-*")), (
            f"{args}: no worker was killed (seed {SEED})"
        )
        assert final["attempt"] == 1, f"{args}: not restarted once (seed {SEED})"
        assert [r["file"] for r in resumes(tmp_path / name)] == ["memory"], f"{args} (seed {SEED})"
        lost = lost_steps(tmp_path / f"{name}-log", tmp_path / name)
        report.append((" ".join(args), final["resumed_from"], lost))
        assert len(lost) == 1 and 0 <= lost[0] <= 1, f"{args}: lost {lost} steps (seed {SEED})"
        check_exact(tmp_path, name, final, reference, " ".join(args))
    # Control: the same kind of kill with the snapshots in memory off (and none on disk) starts
    # over.
    args = ["--no-memory", "--kill-rank", "1", "--kill-after-step", "12"]
    final, _ = run_job(tmp_path, "no-memory", *args, env=job_env)
    lost = lost_steps(tmp_path / "no-memory-log", tmp_path / "no-memory")
    report.append(("control: --no-memory, kill after step 12", final["resumed_from"], lost))
    print(f"\nkills at random instants (DDPKIT_KILL_SEED={SEED}):")
    for text, resumed, steps in report:
        print(f"  {text:58s} resumed from step {resumed}, steps lost {steps}")
    assert final["resumed_from"] is None and lost[0] >= 12
    check_exact(tmp_path, "no-memory", final, reference, "control")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_chosen_interval_bounds_the_steps_lost(tmp_path, job_env, plain_reference):
    # This job's copy to memory takes a few % of its step: within 5%, it would save every step. With
    # a budget of 0.5% the interval chosen after the first saves is larger, and a failure loses up
    # to that many steps.
    reference = use_reference(plain_reference, tmp_path)
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
    final, _ = run_job(tmp_path, "auto", *args, env=job_env)
    records = map(json.loads, (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines())
    events = [r for r in records if r.get("event") == "memory_snapshots"]
    every = events[0]["every_steps"]
    print(
        f"\nchosen: every {every} steps (stall {events[0]['stall_ms']} ms, step "
        f"{events[0]['step_ms']} ms); resumed from {final['resumed_from']}"
    )
    # The largest interval any rank needs: rank 0's stall within the budget of its steps (rounded to
    # the us).
    assert events[0]["stall_ms"] <= 0.005 * every * events[0]["step_ms"] + 1e-3 and every > 1
    lost = lost_steps(tmp_path / "auto-log", tmp_path / "auto")
    assert [r["file"] for r in resumes(tmp_path / "auto")] == ["memory"] and lost[0] <= every
    check_exact(tmp_path, "auto", final, reference, "chosen interval")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_kill_inside_the_copy_resumes_every_rank_from_the_step_before_with_loader_workers(
    tmp_path, job_env
):
    # Augmentation drawn in 2 loader workers per rank, BatchNorm without sync (each rank's own
    # statistics).
    flags = ["--augment", "--workers", "2", "--no-sync-bn"]
    reference, _ = run_job(tmp_path, "reference", *flags, env=job_env)
    for rank, step in ((0, 17), (1, 10)):  # mid-epoch, and the last step of an epoch
        name = f"in-copy-rank{rank}"
        kill = ["--kill-in-copy", str(step), "--kill-in-copy-rank", str(rank)]
        final, _ = run_job(tmp_path, name, *flags, *kill, env=job_env)
        assert (tmp_path / f"{name}-log" / f"killed-in-copy-step{step}").exists()
        # The killed rank's step was half-copied: every rank resumes from the step before, which all
        # hold.
        assert final["attempt"] == 1 and final["resumed_from"] == step - 1, final["resumed_from"]
        assert lost_steps(tmp_path / f"{name}-log", tmp_path / name) == [1]
        check_exact(tmp_path, name, final, reference, name)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_job_folder_goes_when_the_job_ends_normally_on_failure_and_on_sigterm(
    tmp_path, job_env
):
    # The launcher told to make no folder: the Trainer says why and trains with disk snapshots only.
    _, out = run_job(tmp_path, "off", "--epochs", "1", env=job_env | {jobdir.OFF_ENV: "0"})
    assert {p.read_text() for p in (tmp_path / "off-log").glob("memory-rank*")} == {"off"}
    assert "snapshots in memory are off" in out and job_folders(tmp_path) == []
    run_job(tmp_path, "normal", "--epochs", "1", env=job_env)
    assert {p.read_text() for p in (tmp_path / "normal-log").glob("memory-rank*")} == {"on"}
    assert job_folders(tmp_path) == []
    _, out = run_job(
        tmp_path, "failed", "--epochs", "1", "--raise-at", "1", "5", env=job_env, restarts=0, code=1
    )
    assert "planned failure in user code on rank 1" in out and job_folders(tmp_path) == []
    # SIGTERM to the launcher mid-training: the workers save to disk and exit 75; the folder goes
    # too.
    proc = start(tmp_path, "stopped", "--epochs", "30", env=job_env, stderr=subprocess.STDOUT)
    wait_until(lambda: steps_done(tmp_path / "stopped-log") >= 3, what="3 steps of the job")
    folders = job_folders(tmp_path)
    slots = sorted(p.name.split("-", 1)[1] for p in folders[0].glob("*.slot")) if folders else []
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, out[-2000:]
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
def test_a_sigkilled_launchers_folder_is_never_loaded_and_the_next_job_sweeps_it(tmp_path, job_env):
    proc = start(
        tmp_path, "run", "--epochs", "30", env=job_env, stdout=subprocess.DEVNULL,
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
    whole = [w for w in (mslot.read_slot(p) for p in stale.glob("*.slot")) if w is not None]
    assert len(whole) >= 2 and {w[2]["run"] for w in whole} == {ms.run_key(tmp_path / "run")}
    # the same run directory, resumed
    _, out = run_job(tmp_path, "run", "--epochs", "3", env=job_env)
    assert not stale.exists() and job_folders(tmp_path) == []
    # no disk snapshot: from the start
    assert resumes(tmp_path / "run") == [] and "resumed from memory" not in out


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_memory_full_falls_back_to_disk_snapshots_with_one_warning(
    tmp_path, job_env, plain_reference
):
    reference = use_reference(plain_reference, tmp_path)
    # the job's folder fits; a slot (64 KiB of values alone) does not
    with small_tmpfs(tmp_path / "shm", "64k"):
        args = ["--disk-every-steps", "3", "--kill-rank", "1", "--kill-after-step", "14"]
        final, out = run_job(tmp_path, "full", *args, env=job_env)
    warnings = [line for line in out.splitlines() if "snapshots in memory stop" in line]
    print("\n" + "\n".join(warnings))
    assert len(warnings) == 2  # rank 0's, once per attempt (rank 1's is in its own log)
    assert all("rank 0 (no room for" in w and "No space left on device" in w for w in warnings)
    # From disk: the newest snapshot, or the one before it if the newest was still being written
    # (async).
    assert [r["file"] for r in resumes(tmp_path / "full")] in (["step-00000012"], ["step-00000009"])
    check_exact(tmp_path, "full", final, reference, "memory full")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_jobs_on_one_node_keep_their_own_folders(tmp_path, job_env, plain_reference):
    reference = use_reference(plain_reference, tmp_path)
    # Job A is killed only after job B has started (its agent sweeps stale folders) and finished.
    done = tmp_path / "b-finished"
    kill = ("--kill-rank", "1", "--kill-after-step", "20", "--kill-when-file", str(done))
    a = start(tmp_path, "a", *kill, env=job_env, stderr=subprocess.STDOUT)
    wait_until(lambda: steps_done(tmp_path / "a-log") >= 20, what="20 steps of job A")
    run_job(tmp_path, "b", "--epochs", "1", env=job_env)
    assert len(job_folders(tmp_path)) == 1  # A's, still there; B's is gone
    done.touch()
    out, _ = a.communicate(timeout=300)
    assert a.returncode == 0, out[-3000:]
    final = torch.load(tmp_path / "a.pt", weights_only=False)
    assert final["attempt"] == 1 and [r["file"] for r in resumes(tmp_path / "a")] == ["memory"]
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
def test_zero_and_fsdp_resume_a_killed_worker_from_memory_bitwise(tmp_path, job_env, strategy):
    from tests.jobs.strategies.test_strategies_slow import bitwise_equal_full

    job = ["--strategy", strategy, "--no-sync-bn"]  # shards, and each rank's own running statistics
    reference, _ = run_job(tmp_path, "reference", *job, env=job_env)
    kill = ["--kill-rank", "1", "--kill-after-step", "13", "--kill-delay", "0.002"]
    final, _ = run_job(tmp_path, "killed", *job, *kill, env=job_env)
    assert list((tmp_path / "killed-log").glob("killed-*")) and final["attempt"] == 1
    assert [r["file"] for r in resumes(tmp_path / "killed")] == ["memory"]
    assert lost_steps(tmp_path / "killed-log", tmp_path / "killed")[0] <= 1
    assert bitwise_equal_full(final, reference)
    assert rank_differences(tmp_path / "killed.pt", tmp_path / "reference.pt") == {0: [], 1: []}


# -- a lost node ---------------------------------------------------------------------------------


def _node_loss(
    nodes,
    tmp: Path,
    name: str,
    port: int,
    *extra: str,
    launcher: tuple[str, ...] = (),
    lose_node: bool = True,
) -> tuple[dict, Path]:
    """Two nodes of one rank each train the job (``launcher``: more options of ``ddpkit run``);
    node b's agent is SIGKILLed (its worker dies with it) while both ranks hold after step 15; a
    replacement node b starts (without ``lose_node``, both train to the end). Returns node a's
    final state and the log folder."""
    from tests.jobs.launch.test_multinode import _env, _finish, _on

    (ns_a, addr_a), (ns_b, _) = nodes
    log, hold = tmp / f"{name}-log", tmp / f"{name}-go"
    log.mkdir()
    env = _env() | {
        jobdir.ROOT_ENV: str(tmp / "shm"),
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
    }
    cmd = [
        *(
            sys.executable,
            "-m",
            "ddpkit.cli",
            "run",
            "--nnodes",
            "2",
            "--nproc",
            "1",
            "--max-restarts",
            "3",
            *launcher,
        ),
        *("--rdzv-endpoint", f"{addr_a}:{port}", JOB, str(tmp / name), "--log", str(log)),
        *(
            "--out",
            str(tmp / f"{name}.pt"),
            "--hold-after-step",
            "15",
            "--hold-file",
            str(hold),
            *extra,
        ),
    ]
    if not lose_node:
        hold.touch()
    node_a = _on(ns_a, cmd, tmp, f"{name}-a.log", env)
    node_b = _on(ns_b, cmd, tmp, f"{name}-b.log", env)
    if not lose_node:
        codes = _finish([node_a, node_b], timeout=300)
        logs = [(tmp / f"{name}-{n}.log").read_text() for n in ("a", "b")]
        assert codes == [0, 0], [text[-3000:] for text in logs]
        return torch.load(tmp / f"{name}.pt", weights_only=False), log

    def holding() -> bool:
        assert node_a.poll() is None and node_b.poll() is None, (tmp / f"{name}-a.log").read_text()[
            -3000:
        ]
        return steps_done(log, 0) >= 15 and steps_done(log, 1) >= 15

    wait_until(holding, 240, what="both ranks holding after step 15")
    first = {int(p.read_text()) for p in log.glob("pid-rank*-attempt0")}
    os.killpg(node_b.pid, signal.SIGKILL)  # node b: its agent and its worker
    node_b.wait()
    wait_until(
        lambda: any(not Path(f"/proc/{pid}").exists() for pid in first),
        60,
        what="node b's worker to end",
    )
    # node a's rank goes on, finds its peer gone, and its agent waits for a node to replace b
    hold.touch()
    replacement = _on(ns_b, cmd, tmp, f"{name}-b2.log", env)
    codes = _finish([node_a, replacement], timeout=300)
    logs = [(tmp / f"{name}-{n}.log").read_text() for n in ("a", "b2")]
    assert codes == [0, 0], [text[-3000:] for text in logs]
    return torch.load(tmp / f"{name}.pt", weights_only=False), log


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_node_resumes_from_a_peers_memory_bitwise(tmp_path):
    from tests.jobs.launch import netns
    from tests.jobs.launch.test_multinode import _env

    with netns.two_nodes(f"dm{os.getpid() % 100000}") as nodes:
        _lost_node_checks(nodes, tmp_path, _env)


def _lost_node_checks(nodes, tmp_path, _env) -> None:
    (tmp_path / "shm").mkdir()
    # The uninterrupted run, on one node with the same thread count (two nodes of one rank train the
    # same weights as one node of two: tests/jobs/launch/test_multinode.py).
    env = _env() | {
        jobdir.ROOT_ENV: str(tmp_path / "shm"),
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}",
    }
    reference, _ = run_job(tmp_path, "reference", env=env)
    final, log = _node_loss(nodes, tmp_path, "lost", 29431)
    assert {p.read_text() for p in log.glob("memory-rank*")} == {"peers"}
    (event,) = resumes(tmp_path / "lost")
    print(f"\nnode b lost after step 15: {event['file']} at step {event['step']}")
    # Both ranks held after step 15, before its copy: step 14, which the surviving node holds for
    # both ranks.
    assert event["file"].startswith("memory (ranks [") and "from rank" in event["file"]
    assert event["step"] == 14 and final["resumed_from"] == 14
    check_exact(tmp_path, "lost", final, reference, "a lost node", samples=False)
    # Control: without every rank's own part on the survivors, the new node's rank has nothing to
    # resume from but the disk (no snapshot there: the start).
    final, _ = _node_loss(nodes, tmp_path, "no-peers", 29432, "--no-peers")
    assert resumes(tmp_path / "no-peers") == [] and final["resumed_from"] is None
    check_exact(tmp_path, "no-peers", final, reference, "control", samples=False)
