"""Under a real SLURM: a one-node cluster (Debian's slurmctld, slurmd, munge) brought up by
``scripts/slurm_cluster.sh``. Each SLURM defect found by running ddpkit under it has a test here,
and the digits Trainer is pre-empted (``scontrol requeue``, and SIGUSR1 as ``--signal`` sends it)
and resumed to the weights of an uninterrupted run.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ddpkit._launch.cli.sbatch import BatchConfig, batch_script, submit
from ddpkit.testing import read_records, wait_until
from tests.jobs.conftest import clean_environ
from tests.trainer_checks import newest_snapshot

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "slurm_cluster.sh"
PROBE = str(ROOT / "tests" / "jobs" / "scripts" / "launch_probe.py")
HELLO = str(ROOT / "tests" / "jobs" / "scripts" / "hello.py")
DIGITS = str(ROOT / "examples" / "digits_trainer.py")
PY = sys.executable


@pytest.fixture(scope="module")
def slurm() -> dict[str, str]:
    """The environment to run SLURM commands in; the cluster is stopped afterwards if this fixture
    started it."""
    if os.geteuid() != 0:
        pytest.skip("starting slurmd and munged needs root")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and apt-get is not there to install it")
    was_up = subprocess.run(["bash", str(SCRIPT), "status"], capture_output=True).returncode == 0
    up = subprocess.run(["bash", str(SCRIPT), "up"], capture_output=True, text=True, timeout=900)
    assert up.returncode == 0, up.stderr
    conf = re.search(r"export SLURM_CONF=(\S+)", up.stdout).group(1)
    env = clean_environ(threads=1) | {"SLURM_CONF": conf, "PYTHONUNBUFFERED": "1"}
    yield env
    if not was_up:
        subprocess.run(["bash", str(SCRIPT), "down"], timeout=120)


def sh(
    cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = 180
) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def sbatch(path: Path, env: dict[str, str], *options: str) -> str:
    out = sh(["sbatch", "--parsable", *options, str(path)], env, path.parent)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def job_info(job: str, env: dict[str, str]) -> dict[str, str]:
    out = sh(["scontrol", "show", "job", "-o", job], env, Path("/"))
    assert out.returncode == 0, out.stderr
    return dict(item.split("=", 1) for item in out.stdout.split() if "=" in item)


def wait_for(
    job: str, env: dict[str, str], states: set[str], timeout: float = 300, **fields: str
) -> dict:
    """Poll the job until its state is one of ``states`` (and its other ``fields`` match)."""
    hurried = set()
    last: dict[str, str] = {}

    def reached() -> dict[str, str] | None:
        nonlocal last
        info = last = job_info(job, env)
        if info["JobState"] in states and all(info.get(k) == v for k, v in fields.items()):
            return info
        if (
            info["JobState"] == "PENDING"
            and info.get("Reason") == "BeginTime"
            and info["Restarts"] not in hurried
        ):
            # SLURM holds a requeued job for two minutes (its credential's lifetime); start it
            # sooner, but not at once: slurmd refuses every credential of the job made in or before
            # the second it revoked the old attempt's ("Killing non-startable batch job: Job
            # credential revoked"), which fails the job.
            out = sh(["scontrol", "update", f"jobid={job}", "starttime=now+3"], env, Path("/"))
            assert out.returncode == 0, out.stderr
            hurried.add(info["Restarts"])
        return None

    return wait_until(
        reached,
        timeout,
        what=lambda: f"job {job} to be one of {sorted(states)}, with {fields}; it is {last}",
        interval=0.5,
        max_interval=0.5,
    )


def wait_while_queued_or_running(
    job: str, env: dict[str, str], condition: Callable[[], bool], timeout: float, what: str
) -> None:
    """Poll ``condition`` until it holds; a job that ends first (neither PENDING nor RUNNING) fails
    the wait at once, naming its state."""

    def holds() -> bool:
        if condition():
            return True
        state = job_info(job, env)["JobState"]
        assert state in ("PENDING", "RUNNING"), f"job {job} is {state} before {what}"
        return False

    wait_until(holds, timeout, what=what, interval=0.2, max_interval=0.2)


def requeue(job: str, env: dict[str, str]) -> None:
    out = sh(["scontrol", "requeue", job], env, Path("/"))
    assert out.returncode == 0, out.stderr


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# -------------------------------------------------------------------------------------- the defects


def test_salloc_and_srun_of_a_shell_are_one_world_not_two(slurm, tmp_path):
    # Before: the job names "interactive" (salloc) and "bash" turned SLURM off, and each task ran as
    # a world of one (both printed rank 0).
    for cmd in (
        ["salloc", "-n2", "srun", PY, PROBE, "info"],
        ["srun", "-n2", "bash", "-c", f"{PY} {PROBE} info"],
    ):
        out = sh(cmd, slurm, tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        ranks = sorted(re.findall(r"rank=(\d) world=(\d) launcher=(\w+)", out.stdout))
        assert ranks == [("0", "2", "slurm"), ("1", "2", "slurm")], out.stdout
        assert out.stdout.count("sum=3") == 2


def test_two_concurrent_steps_of_one_job_do_not_collide(slurm, tmp_path):
    # Before: the port came from the job id alone, so both steps' rank 0 bound the same port.
    job = sbatch(
        write(
            tmp_path / "two.sbatch",
            f"""#!/bin/bash
#SBATCH -n4
#SBATCH --output={tmp_path}/two.out
srun -n2 --exact {PY} {PROBE} info first &
srun -n2 --exact {PY} {PROBE} info second &
wait
""",
        ),
        slurm,
    )
    info = wait_for(job, slurm, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    out = (tmp_path / "two.out").read_text()
    assert info["JobState"] == "COMPLETED", out[-3000:]
    for tag in ("first", "second"):
        lines = [line for line in out.splitlines() if line.endswith(f"tag={tag}")]
        assert len(lines) == 2 and all("world=2" in line and "sum=3" in line for line in lines), out
    ports = set(re.findall(r"port=(\d+)", out))
    assert len(ports) == 2 and all(int(p) < 32768 for p in ports)  # below Linux's ephemeral ports


def test_a_requeued_job_counts_its_restart(slurm, tmp_path):
    job = sbatch(
        write(
            tmp_path / "count.sbatch",
            f"""#!/bin/bash
#SBATCH -n2
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={tmp_path}/count.out
srun {PY} {PROBE} info
""",
        ),
        slurm,
    )
    wait_for(job, slurm, {"COMPLETED"})
    requeue(job, slurm)
    wait_for(job, slurm, {"COMPLETED"}, Restarts="1")
    out = (tmp_path / "count.out").read_text()
    # Before: SLURM_RESTART_COUNT was not read and the second attempt also said 0.
    assert sorted(re.findall(r"rank=(\d) .* restarts=(\d)", out)) == [
        ("0", "0"),
        ("0", "1"),
        ("1", "0"),
        ("1", "1"),
    ]


def test_srun_ddpkit_run_passes_sigusr1_to_the_workers(slurm, tmp_path):
    # Before: torchrun's agent died of SIGUSR1 (exit 138) and tore the step down under the workers.
    pids = tmp_path / "pids"
    pids.mkdir()
    job = sbatch(
        write(
            tmp_path / "agent.sbatch",
            f"""#!/bin/bash
#SBATCH -n1
#SBATCH -c2
#SBATCH --output={tmp_path}/agent.out
srun {PY} -m ddpkit.cli run --nproc 2 --log-dir {tmp_path}/logs {PROBE} hold-usr1 {pids}
echo "step exit code $?"
""",
        ),
        slurm,
    )
    wait_while_queued_or_running(
        job,
        slurm,
        lambda: (pids / "rank0.pid").exists() and (pids / "rank1.pid").exists(),
        120,
        "both ranks' pid files",
    )
    # what --signal=USR1@T sends to the steps
    out = sh(["scancel", "--signal=USR1", job], slurm, tmp_path)
    assert out.returncode == 0, out.stderr
    wait_for(job, slurm, {"COMPLETED", "FAILED", "CANCELLED"})
    text = (tmp_path / "agent.out").read_text()
    assert "rank=0 stopping on SIGUSR1" in text and "step exit code 75" in text, text[-3000:]


def test_the_generated_script_requeues_a_preempted_run_and_not_a_finished_one(slurm, tmp_path):
    # The probe exits 75 on its first attempt (as a Trainer stopped by a signal does) and 0 on the
    # next.
    cfg = BatchConfig(
        script=PROBE,
        script_args=["preempted"],
        ntasks_per_node=2,
        cpus_per_task=1,
        output_dir=str(tmp_path),
        workdir=str(tmp_path),
        job_name="preempted",
    )
    path = write(tmp_path / "preempted.sbatch", batch_script(cfg))
    job = sbatch(path, slurm)
    info = wait_for(job, slurm, {"COMPLETED"}, timeout=300, Restarts="1")
    text = (tmp_path / f"preempted-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-3000:]
    assert "requeueing job" in text and "rank=0 attempt=0" in text and "rank=0 attempt=1" in text
    # A run that finishes (exit 0) stays finished: the same script for a job that completes at once.
    cfg = BatchConfig(
        script=PROBE,
        script_args=["info"],
        ntasks_per_node=2,
        cpus_per_task=1,
        output_dir=str(tmp_path),
        workdir=str(tmp_path),
        job_name="finished",
    )
    job = sbatch(write(tmp_path / "finished.sbatch", batch_script(cfg)), slurm)
    info = wait_for(job, slurm, {"COMPLETED", "FAILED"})
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0"
    assert "requeueing" not in (tmp_path / f"finished-{job}.out").read_text()


def test_the_generated_script_writes_its_output_into_a_folder_with_a_space_and_a_percent(
    slurm, tmp_path
):
    # Before: the --output folder was unquoted, so sbatch read "--output=.../logs" and then "with"
    # as the script.
    out = tmp_path / "logs with space 100%"
    cfg = BatchConfig(
        script=HELLO,
        script_args=["two words"],
        ntasks_per_node=1,
        cpus_per_task=1,
        output_dir=str(out),
        workdir=str(tmp_path),
        job_name="quoted",
    )
    path, _ = submit(cfg, dry_run=True)
    job = sbatch(path, slurm)
    info = wait_for(job, slurm, {"COMPLETED", "FAILED"})
    text = (out / f"quoted-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", text[-3000:]
    assert "hello rank=0 world=1" in text and "words=['two words']" in text


# ------------------------------------------------------------------- the digits Trainer, pre-empted


EPOCHS = 12


def _digits_job(tmp_path: Path, name: str, env: dict[str, str]) -> tuple[str, Path]:
    cfg = BatchConfig(
        script=DIGITS,
        script_args=["--run-dir", f"runs/{name}", "--epochs", str(EPOCHS)],
        ntasks_per_node=2,
        cpus_per_task=1,
        output_dir=str(tmp_path),
        workdir=str(tmp_path),
        job_name=name,
    )
    return sbatch(
        write(tmp_path / f"{name}.sbatch", batch_script(cfg)), env
    ), tmp_path / "runs" / name


def _snapshot_steps(run_dir: Path) -> int:
    return sum(r.get("event") == "snapshot" for r in read_records(run_dir))


def _final(run_dir: Path) -> dict:
    step, model = newest_snapshot(run_dir)
    return {"step": step, "model": model}


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory) -> dict:
    """The final snapshot of the digits job run through without a stop: one job for every way of
    pre-empting it."""
    tmp_path = tmp_path_factory.mktemp("reference")
    ref_job, ref_dir = _digits_job(tmp_path, "reference", slurm)
    ref = wait_for(ref_job, slurm, {"COMPLETED", "FAILED"}, timeout=400)
    assert ref["JobState"] == "COMPLETED" and ref["Restarts"] == "0"
    return _final(ref_dir)


# a pre-empted and requeued job (and, once for the module, the uninterrupted one), and SLURM's
# polling: minutes on 2 cores
@pytest.mark.timeout(900)
@pytest.mark.parametrize("how", ["scontrol requeue", "SIGUSR1"])
def test_digits_preempted_resumes_to_the_uninterrupted_weights(slurm, tmp_path, how, uninterrupted):
    job, run_dir = _digits_job(tmp_path, "preempted", slurm)
    # mid-run: two snapshots written
    wait_while_queued_or_running(
        job, slurm, lambda: _snapshot_steps(run_dir) >= 2, 240, "two snapshots"
    )
    if how == "scontrol requeue":
        requeue(job, slurm)  # SIGTERM to every task, then the job goes back to the queue
    else:
        assert sh(["scancel", "--signal=USR1", job], slurm, tmp_path).returncode == 0
    first = wait_for(job, slurm, {"PENDING", "COMPLETED"}, timeout=240)
    if first["JobState"] == "COMPLETED":
        # A Trainer that returns from fit() on a stop signal exits 0 and the script does not requeue
        # it; once fit() raises Preempted (exit 75) the script requeues by itself. Either way the
        # snapshot is there.
        assert first["ExitCode"] == "0:0"
        requeue(job, slurm)
    info = wait_for(job, slurm, {"COMPLETED"}, timeout=400, Restarts="1")
    text = (tmp_path / f"preempted-{job}.out").read_text()
    assert info["ExitCode"] == "0:0", text[-3000:]
    events = [
        (e["event"], e["step"], e.get("reason"), e.get("restart_count"))
        for e in read_records(run_dir)
        if e["kind"] == "event" and e["event"] not in ("snapshot", "best")
    ]
    # Stopped by the signal mid-run, resumed from that step by the requeued job (SLURM_RESTART_COUNT
    # read).
    (_, stop, _, _), (_, resume, _, _) = events[1:3]
    assert events == [
        ("start", 0, None, 0),
        ("stop", stop, "signal", None),
        ("resume", stop, None, 1),
        ("stop", EPOCHS * 22, "epochs", None),
    ], events
    assert 0 < stop < EPOCHS * 22

    got, want = _final(run_dir), uninterrupted
    assert got["step"] == want["step"] == EPOCHS * 22
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
