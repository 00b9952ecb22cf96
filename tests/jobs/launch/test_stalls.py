"""The stall watch of ``ddpkit run``: a rank that stops making progress is named in seconds, with
real jobs.

Each test has its control: the watch off (``--stall-timeout 0``), where nothing is said and the job
ends only at the collective timeout; or, for the allowances, the same pause where no allowance
covers it.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests.jobs.launch.stall_jobs import run_stall_job

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and /dev/shm"),
]

FLOOR = "3"
# The controls' collective timeout: a job with the watch off ends only then. The watch (floor 3 s)
# names a stall ~3.5 s after it; the runs with the watch on have a 60 s timeout.
COLLECTIVE_TIMEOUT = 10.0
# A job with the watch on (and a 60 s collective timeout) ends within this bound.
ENDED_WITHIN = 20.0
_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
)


@pytest.fixture
def env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCH_VARS and not k.startswith(("TORCHELASTIC", "SLURM"))
    }
    env.pop("DDPKIT_STALL_TIMEOUT", None)
    return env | {"PYTHONUNBUFFERED": "1"}


def _named_then_ended(out, state: str, doing: str) -> None:
    assert out.returncode != 0, out.stderr[-3000:]
    assert out.named_at is not None, out.stderr[-3000:]
    headline = next(line for line in out.stderr.splitlines() if "rank 1 stalled:" in line)
    assert state in headline and doing in headline, headline
    # The floor (3 s), a poll (0.5 s), the stacks (at most 3 s), on a machine shared by many: far
    # below the collective timeout the job would otherwise have waited for.
    assert out.to_named is not None and out.to_named < 3 + 9, (out.to_named, out.stderr[-3000:])
    assert out.to_end is not None and out.to_end < ENDED_WITHIN, (
        out.to_end,
        out.stderr[-3000:],
    )
    summary = out.stderr[out.stderr.rindex("worker(s) failed") :]
    assert "first: rank 1" in summary and "stalled, ended by the stall watch" in summary, summary


def _control(tmp_path, env, job: list[str]) -> None:
    out = run_stall_job(
        ["--stall-timeout", "0", "--collective-timeout", str(COLLECTIVE_TIMEOUT)],
        job,
        env,
        tmp_path / "off",
    )
    assert out.returncode != 0 and out.named_at is None and "stalled" not in out.stderr, out.stderr[
        -3000:
    ]
    assert out.to_end is not None and out.to_end >= COLLECTIVE_TIMEOUT - 1, (
        out.to_end,
        out.stderr[-3000:],
    )


@pytest.fixture
def dirs(tmp_path):
    for name in ("on", "off"):
        (tmp_path / name).mkdir()
    return tmp_path


def test_a_stopped_rank_is_named_and_killed_at_once(dirs, env):
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"], ["stop"], env, dirs / "on"
    )
    _named_then_ended(out, "stopped (SIGSTOP)", "at step 5")
    assert "a stopped process cannot answer for its stack" in out.stderr
    assert "rank 1 killed (SIGKILL)" in out.stderr
    # rank 0's stack, asked while it waited for rank 1 in the gradients' all-reduce
    assert "in backward" in out.stderr.split("rank 0 (local rank 0", 1)[1]
    _control(dirs, env, ["stop"])


def test_a_rank_stuck_in_user_code_between_steps_is_named(dirs, env):
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"], ["sleep"], env, dirs / "on"
    )
    _named_then_ended(out, "sleeping", "in its loop")
    rank1 = out.stderr.split("rank 1 (local rank 1", 1)[1]
    # its own stack, from the script's line
    assert "stall_job.py" in rank1 and "<module>" in rank1, rank1
    _control(dirs, env, ["sleep"])


def test_a_rank_stuck_in_a_loader_worker_is_named(dirs, env):
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"], ["loader"], env, dirs / "on"
    )
    _named_then_ended(out, "sleeping", "loading data")
    assert "dataloader.py" in out.stderr.split("rank 1 (local rank 1", 1)[1]
    _control(dirs, env, ["loader"])


def test_the_trainer_marks_its_phases_and_the_waiting_collective(dirs, env):
    run_dir = str(dirs / "on" / "run")
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"],
        ["trainer-sleep", "5", "300", "12", run_dir],
        env,
        dirs / "on",
    )
    _named_then_ended(out, "sleeping", "user code between steps")
    # rank 0 went on into the step's snapshot and waits in its collective, which rank 1 has not
    # reached
    assert "rank(s) 0 wait in it; rank 1 has not arrived" in out.stderr, out.stderr[-3000:]
    # Rank 1 sleeps 20 s here, twice the 10 s timeout: asleep in a callback, it would hold the job's
    # end through torchrun's 30 s SIGTERM grace after rank 0's failure; it wakes and fails instead.
    _control(dirs, env, ["trainer-sleep", "5", "20", "12", str(dirs / "off" / "run")])


def test_warn_only_says_so_and_the_job_goes_on(dirs, env):
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--on-stall", "warn"], ["sleep", "5", "8"], env, dirs / "on"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.named_at is not None and "the job goes on (--on-stall warn)" in out.stderr
    assert "rank 0 done after 12 steps" in out.stdout


@pytest.mark.parametrize(
    "job",
    [
        ["sleep", "1", "10"],  # a first step of 10 s (compilation, warm-up): allowance 10 x floor
        ["trainer-snapshot", "5", "10", "12"],  # a snapshot of 10 s on one rank: the same allowance
    ],
    ids=["long-first-step", "long-snapshot"],
)
def test_no_false_alarm_on_a_long_first_step_or_snapshot(dirs, env, job):
    job = job + ([str(dirs / "on" / "run")] if job[0].startswith("trainer") else [])
    out = run_stall_job(["--stall-timeout", FLOOR], job, env, dirs / "on")
    assert out.returncode == 0 and out.named_at is None, out.stderr[-3000:]
    assert out.stalled_at is not None  # the pause did happen
    # Control: the same 10 s pause after step 5, in user code, where no allowance covers it.
    out = run_stall_job(["--stall-timeout", FLOOR], ["sleep", "5", "10"], env, dirs / "off")
    assert out.returncode != 0 and out.named_at is not None, out.stderr[-3000:]


def test_the_summary_before_a_restart_names_the_killed_rank(dirs, env):
    out = run_stall_job(["--max-restarts", "1"], ["kill"], env, dirs / "on")
    assert out.returncode == 0, out.stderr[-3000:]
    before = out.stderr[
        : out.stderr.index("ddpkit run: restarting the workers (0 restart(s) left after this one)")
    ]
    summary = before[before.rindex("ddpkit run: ") :]
    assert "first: rank 1 (local rank 1" in summary and "killed by SIGKILL" in summary, summary
    assert "where each rank was: rank 0 at step 6" in summary and "rank 1 at step 5" in summary, (
        summary
    )
    assert "rank 0 done after 12 steps" in out.stdout
    # Control: torchrun's agent alone logs one local rank's exit code (the first by its whole-second
    # stamp, which can be a survivor it stopped itself), never the step nor where the other ranks
    # were. It logs that failure the same way whether or not a restart follows, so the control asks
    # for none: torchrun's own restart of this job can wait on the workers' store past any bound.
    import subprocess

    from tests.jobs.launch.stall_jobs import STALL_JOB

    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    plain = subprocess.run(
        [*torchrun, "--max-restarts", "0", STALL_JOB, "kill"],
        env=env,
        cwd=dirs / "off",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert plain.returncode != 0, plain.stderr[-3000:]
    assert "rank 1 stalls (kill)" in plain.stdout + plain.stderr  # the kill did happen
    assert "first: rank 1" not in plain.stderr and "where each rank was" not in plain.stderr


@pytest.mark.parametrize(
    ("job", "doing"),
    [(["forward"], "in its loop"), (["trainer-forward"], "forward/backward")],
    ids=["hand-loop", "trainer"],
)
def test_a_rank_stalled_in_its_forward_is_named_while_the_other_waits_in_the_all_reduce(
    dirs, env, job, doing
):
    """Rank 0 waits for rank 1 in DDP's all-reduce of the gradients, at the same step: it marks
    that wait (``prepare_model``), so rank 1, still in its forward, is behind, and named."""
    job = job + (["5", "300", "12", str(dirs / "on" / "run")] if job[0].startswith("t") else [])
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"], job, env, dirs / "on"
    )
    _named_then_ended(out, "sleeping", doing)
    assert "rank 0 at step 6, after its backward: DDP's all-reduce" in out.stderr, out.stderr[
        -3000:
    ]
    assert "in forward" in out.stderr.split("rank 1 (local rank 1", 1)[1]


def test_control_over_torchs_ddp_built_by_hand_the_forward_stall_is_left_to_the_timeout(dirs, env):
    """Without the mark (torch's DDP wrapped by hand, not by ``prepare_model``) both ranks are in
    their loop at step 6, and nothing says which one is the cause: the collective timeout ends the
    job."""
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", str(COLLECTIVE_TIMEOUT)],
        ["forward-raw"],
        env,
        dirs / "on",
    )
    assert out.returncode != 0 and out.named_at is None, out.stderr[-3000:]
    assert out.to_end is not None and out.to_end >= COLLECTIVE_TIMEOUT - 1, out.stderr[-3000:]


def test_a_validation_slower_on_one_rank_is_not_a_stall(dirs, env):
    """Rank 1 validates for 12 s, four times the stall timeout, in one batch, while rank 0 waits
    for it in the metrics' all-reduce: an evaluation has the long allowance (10 x the floor, at
    most half the collective timeout), so the run ends well (it was named and killed). The control,
    the same pause in user code where no allowance covers it, is
    `test_no_false_alarm_on_a_long_first_step_or_snapshot`'s."""
    run_dir = str(dirs / "on" / "run")
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"],
        ["trainer-validation", "5", "12", "8", run_dir],
        env,
        dirs / "on",
    )
    assert out.returncode == 0 and out.named_at is None, out.stderr[-3000:]
    assert out.to_end is not None and out.to_end > 12, (out.to_end, out.stderr[-3000:])
