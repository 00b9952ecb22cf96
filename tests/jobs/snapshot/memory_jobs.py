"""The jobs the snapshot tests kill and resume, run as those tests run them: the Trainer's memory
job (``tests/jobs/scripts/memory_job.py``: 3 epochs of 10 steps, a copy in memory after every step)
and the hand loop (``hand_loop_job.py``), on one node or on two network-namespace nodes; and what
their runs are checked by."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ddpkit.testing import Job, run_job, start_job, wait_until
from tests.jobs.conftest import memory_environ
from tests.jobs.launch import netns
from tests.jobs.scripts.hand_loop_job import EPOCHS, GLOBAL_BATCH
from tests.jobs.scripts.hand_loop_job import N_SAMPLES as HAND_SAMPLES
from tests.jobs.scripts.train_job import N_SAMPLES
from tests.trainer_checks import (
    assert_each_sample_once,
    bitwise_equal,
    max_abs_diff,
    rank_differences,
    resume_steps,
    samples_per_epoch,
)

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
JOB = str(SCRIPTS / "memory_job.py")
SEED = int(os.environ.get("DDPKIT_KILL_SEED", time.time_ns() % 100_000))
STEPS = 30  # 3 epochs of 10 steps; no disk snapshot unless asked
HAND_JOB = str(SCRIPTS / "hand_loop_job.py")
HAND_STEPS = EPOCHS * HAND_SAMPLES // GLOBAL_BATCH  # 20: 4 an epoch; snapshots every 3 steps


def job_args(tmp: Path, name: str) -> list[str]:
    """The memory job's arguments: its run directory ``tmp/name``, its log folder
    ``tmp/name-log`` (made now), its final state to ``tmp/name.pt``."""
    (tmp / f"{name}-log").mkdir(exist_ok=True)
    return [str(tmp / name), "--log", str(tmp / f"{name}-log"), "--out", str(tmp / f"{name}.pt")]


def start(tmp: Path, name: str, *args: str, env: dict, **streams: int) -> subprocess.Popen:
    """The memory job started in ``tmp``, two restarts allowed, for the tests that signal or kill
    the launcher while it runs; ``streams``: where its ``stdout`` and ``stderr`` go."""
    restart = ("--max-restarts", "2")
    job = [*job_args(tmp, name), *args]
    return start_job(JOB, *job, launcher_args=restart, env=env, cwd=tmp, **streams)


def run(
    tmp: Path,
    name: str,
    *args: str,
    env: dict,
    nproc: int = 2,
    restarts: int = 2,
    launcher: tuple[str, ...] = (),
    code: int = 0,
    script: str = JOB,
) -> tuple[dict, Job]:
    """The memory job (or ``script``, a variant of it) to its end in ``tmp``, ``restarts`` restarts
    allowed and ``launcher``'s options: its final state (``{}`` unless it exits with ``code``, as
    it must) and the :class:`~ddpkit.testing.Job` of run directory ``tmp/name``."""
    job = run_job(
        script, *job_args(tmp, name), *args, nproc=nproc,
        launcher_args=("--max-restarts", str(restarts), *launcher), env=env, cwd=tmp, timeout=300,
        run_dir=tmp / name,
    )  # fmt: skip
    assert job.returncode == code, job.stderr[-3000:]
    final = torch.load(tmp / f"{name}.pt", weights_only=False) if code == 0 else {}
    return final, job


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


def job_folders(tmp: Path) -> list[Path]:
    """The folders of the jobs in shared memory."""
    base = tmp / "shm" / f"ddpkit-memory-{os.getuid()}"
    return sorted(base.iterdir()) if base.exists() else []


def steps_done(log: Path, rank: int = 0) -> int:
    path = log / f"steps-rank{rank}.txt"
    return len(path.read_text().splitlines()) if path.exists() else 0


def pids(log: Path) -> dict[int, dict[int, int]]:
    """Global rank -> attempt -> the pid that ran it."""
    out: dict[int, dict[int, int]] = {}
    for path in log.glob("pid-rank*-attempt*"):
        rank, attempt = path.name[len("pid-rank") :].split("-attempt")
        out.setdefault(int(rank), {})[int(attempt)] = int(path.read_text())
    return out


def node_command(
    tmp: Path, name: str, endpoint: str, launcher: tuple[str, ...] = (), job: tuple[str, ...] = ()
) -> list[str]:
    """``ddpkit run`` of the memory job for one of two nodes of one rank each (``launcher``,
    ``job``: more options of each), which holds after step 15 until ``tmp/name-go`` exists."""
    return [
        sys.executable, "-m", "ddpkit.cli", "run", "--nnodes", "2", "--nproc", "1",
        "--max-restarts", "3", *launcher, "--rdzv-endpoint", endpoint, JOB, *job_args(tmp, name),
        "--hold-after-step", "15", "--hold-file", str(tmp / f"{name}-go"), *job,
    ]  # fmt: skip


def memory_node_env(tmp: Path) -> dict[str, str]:
    """A node's environment (:func:`~tests.jobs.launch.netns.node_env`) with the job folders under
    ``tmp/shm``, which both nodes share."""
    return memory_environ(netns.node_env(), tmp)


def node_loss(
    nodes,
    tmp: Path,
    name: str,
    port: int,
    *extra: str,
    launcher: tuple[str, ...] = (),
    lose_node: bool = True,
    spare: bool = False,
) -> tuple[dict, Job]:
    """Two nodes of one rank each train the memory job (``launcher``: more options of ``ddpkit
    run``, ``extra``: of the job); node b's agent is SIGKILLed (its worker dies with it) while both
    ranks hold after step 15; a replacement node b starts (with ``spare``, before the loss, once it
    says it waits for a place; without ``lose_node``, both train to the end). Node a's final state,
    and its :class:`~ddpkit.testing.Job` (its output, the records of ``tmp/name``); the job's log
    folder is ``tmp/name-log``."""
    (ns_a, addr_a), (ns_b, _) = nodes
    log, hold = tmp / f"{name}-log", tmp / f"{name}-go"
    env = memory_node_env(tmp)
    cmd = node_command(tmp, name, f"{addr_a}:{port}", launcher, extra)
    if not lose_node:
        hold.touch()
    node_a = netns.on(ns_a, cmd, tmp, f"{name}-a.log", env)
    node_b = netns.on(ns_b, cmd, tmp, f"{name}-b.log", env)
    if not lose_node:
        codes = netns.finish([node_a, node_b], timeout=300)
        logs = [(tmp / f"{name}-{n}.log").read_text() for n in ("a", "b")]
        assert codes == [0, 0], [text[-3000:] for text in logs]
        final = torch.load(tmp / f"{name}.pt", weights_only=False)
        return final, Job(cmd, 0, logs[0], run_dir=tmp / name)

    def holding() -> bool:
        assert node_a.poll() is None and node_b.poll() is None, (tmp / f"{name}-a.log").read_text()[
            -3000:
        ]
        return steps_done(log, 0) >= 15 and steps_done(log, 1) >= 15

    wait_until(holding, 240, what="both ranks holding after step 15")
    if spare:  # a node started while the job runs on all its nodes waits for a place
        replacement = netns.on(ns_b, cmd, tmp, f"{name}-b2.log", env)
        wait_until(
            lambda: "waiting for one's place" in (tmp / f"{name}-b2.log").read_text(),
            120,
            what="the spare node waiting for a place",
        )
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
    if not spare:
        replacement = netns.on(ns_b, cmd, tmp, f"{name}-b2.log", env)
    codes = netns.finish([node_a, replacement], timeout=300)
    logs = [(tmp / f"{name}-{n}.log").read_text() for n in ("a", "b2")]
    assert codes == [0, 0], [text[-3000:] for text in logs]
    return torch.load(tmp / f"{name}.pt", weights_only=False), Job(
        cmd, 0, logs[0], run_dir=tmp / name
    )


def hand_run(
    tmp: Path,
    name: str,
    *args: str,
    nproc: int = 2,
    env: dict,
    run: str | None = None,
    launcher: tuple[str, ...] = (),
) -> list[dict]:
    """The hand loop job (one restart allowed, and ``launcher``'s options) on ``nproc`` ranks, its
    run directory ``tmp/(run or name)``; each rank's result."""
    job = [str(tmp / (run or name)), "--out", str(tmp / name), *args]
    restart = ["--max-restarts", "1", *launcher]
    done = run_job(HAND_JOB, *job, nproc=nproc, launcher_args=restart, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(tmp / f"{name}-rank{r}.pt", weights_only=False) for r in range(nproc)]
