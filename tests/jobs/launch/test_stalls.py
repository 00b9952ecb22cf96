"""The stall watch of ``ddpkit run``: a rank that stops making progress is named in seconds, with
real jobs.

Each test has its control: the watch off (``--stall-timeout 0``), where nothing is said and the job
ends only at the collective timeout; or, for the allowances, the same pause where no allowance
covers it.
"""

from __future__ import annotations

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


@pytest.fixture
def env(user_env) -> dict[str, str]:
    """A user's environment without a stall timeout of the shell's: each test sets its own."""
    user_env.pop("DDPKIT_STALL_TIMEOUT", None)
    return user_env


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
    rank1 = out.stderr.split("rank 1 (local rank 1", 1)[1]
    assert "dataloader.py" in rank1
    # the worker it waits for: its pid, state and stack, where it hangs
    worker = rank1.split("its loader worker pid", 1)[1]
    assert worker.split("\n", 1)[0].strip().split(": ", 1)[1] == "sleeping", worker[:300]
    assert "in __getitem__" in worker.split("ending the job", 1)[0], worker[:2000]
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
    assert "rank 0 at step 6, at its backward's end, in DDP's all-reduce" in out.stderr, out.stderr[
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


# -- healthy pauses: nothing stalled, nothing ended ------------------------------------------------


def _healthy(out) -> None:
    assert out.returncode == 0, out.stderr[-3000:]
    # the pause did happen (said by rank 1, in its log; by rank 0 on the launcher's output)
    assert out.stalled_at is not None or "stalls (" in out.stdout, out.stderr[-3000:]
    assert "stalled:" not in out.stderr and "killed (SIGKILL)" not in out.stderr, out.stderr[-3000:]
    assert "rank 0 done after 12 steps" in out.stdout


@pytest.mark.parametrize("mode", ["same-sleep", "same-cpu"])
def test_the_same_long_work_on_every_rank_finished_apart_is_no_stall(dirs, env, mode):
    """Every rank pauses 8 s (asleep, or computing) after step 3, rank 1 1.5 s longer than rank 0:
    nobody waits past the floor (3 s) for anybody. The watch before this judged the last rank by
    its own silence (8 s since its last mark) and killed it as the first one moved on. Control: the
    same 8 s on rank 1 alone is named and ended."""
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"], [mode, "3", "8"], env, dirs / "on"
    )
    _healthy(out)
    assert "slow:" not in out.stderr, out.stderr[-3000:]
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"], ["sleep", "3", "8"], env,
        dirs / "off",
    )  # fmt: skip
    _named_then_ended(out, "sleeping", "in its loop")


@pytest.mark.parametrize(
    ("mode", "args"),
    [
        ("main-first", ["3", "12"]),  # rank 0 alone in main_first()'s body, 12 s asleep
        ("trainer-export", ["5", "8", "12"]),  # rank 0 writes the best weights for 8 s
    ],
)
def test_ddpkits_own_phases_on_rank_0_alone_have_their_allowance(dirs, env, mode, args):
    """Rank 0 works alone where ddpkit knows it does (main_first's body, the best weights' export)
    while rank 1 waits: the long allowance (10 x the floor) covers it; nothing is named. Control:
    the same pause in user code (`test_the_same_long_work..`'s) is ended."""
    args = args + ([str(dirs / "on" / "run")] if mode.startswith("trainer") else [])
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"], [mode, *args], env, dirs / "on"
    )
    _healthy(out)
    assert "slow:" not in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("mode", ["barrier-cpu", "slow"])
def test_a_rank_that_computes_while_the_others_wait_is_named_slow_and_not_ended(dirs, env, mode):
    """Rank 0 computes 8 s before a barrier (or rank 1 after its step) while the other waits: named
    as slow once the wait passes the floor and again each floor while it lasts, with its stack;
    never killed: the job ends well. Control: the same rank asleep as long (`sleep`) is stalled and
    ended (`test_a_rank_stuck_in_user_code_between_steps_is_named`)."""
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"], [mode, "3", "8"], env, dirs / "on"
    )
    _healthy(out)
    slow = 0 if mode == "barrier-cpu" else 1
    lines = [line for line in out.stderr.splitlines() if f"rank {slow} slow:" in line]
    assert len(lines) >= 2, out.stderr[-3000:]  # said again while it lasts
    assert "it runs" in lines[0] and "not ended" in lines[0], lines[0]
    assert "spin" in out.stderr.split(f"rank {slow} (local rank {slow}", 1)[1]  # its stack


# -- what must be named ---------------------------------------------------------------------------


def test_ranks_in_different_torch_collectives_are_named_within_the_allowance(dirs, env):
    """A logging branch: rank 0 alone calls ``torch.distributed.broadcast`` after step 3, rank 1
    goes on into the next step's all-reduce (a DDP built by hand, which nothing marks). torch's own
    collectives are marked: the ranks are named as waiting in different collectives after the
    floor, and the job ended. Control: the watch off waits out the collective timeout."""
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"], ["desync", "3"], env, dirs / "on"
    )
    assert out.returncode != 0, out.stderr[-3000:]
    line = next(line for line in out.stderr.splitlines() if "ranks disagree" in line)
    assert "rank 0 in broadcast #" in line and "of 3 elements" in line, line
    assert "rank 1 blocked at step 4" in line, line
    assert out.to_end is not None and out.to_end < ENDED_WITHIN, (out.to_end, out.stderr[-3000:])
    _control(dirs, env, ["desync", "3"])


def test_a_rank_idle_after_its_backward_is_named_not_the_one_waiting_for_it(dirs, env):
    """Over ``prepare_model``'s DDP, rank 0 polls for a file after its backward while rank 1 waits
    in ``torch.distributed.barrier()``: rank 0 left DDP's all-reduce (its mark says so) and is the
    one named; the rank waiting is not taken for one that disagrees. Control: the watch off waits
    out the collective timeout."""
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"], ["idle-rank-0", "3", "120"],
        env, dirs / "on",
    )  # fmt: skip
    assert out.returncode != 0, out.stderr[-3000:]
    headline = next(line for line in out.stderr.splitlines() if " stalled:" in line)
    assert headline.startswith("ddpkit run: rank 0 stalled:"), headline
    assert "in its loop" in headline and "rank 1 at step 3, in collective barrier" in headline
    assert "disagree" not in out.stderr, out.stderr[-3000:]
    _control(dirs, env, ["idle-rank-0", "3", "120"])


def test_ranks_that_recv_from_each_other_are_named_a_deadlock(dirs, env):
    """After step 3 each rank calls ``recv`` from the other: both wait in point-to-point calls,
    each for the other, named a deadlock with what to change. Control: the same calls ordered
    (rank 0 sends first) finish, and nothing is said."""
    out = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"], ["p2p-deadlock", "3"], env,
        dirs / "on",
    )  # fmt: skip
    assert out.returncode != 0, out.stderr[-3000:]
    line = next(line for line in out.stderr.splitlines() if "wait for each other" in line)
    assert "rank 0 in recv from rank 1, rank 1 in recv from rank 0: a deadlock" in line, line
    ordered = run_stall_job(
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"], ["p2p-ordered", "3"], env,
        dirs / "off",
    )  # fmt: skip
    assert ordered.returncode == 0 and "stalled" not in ordered.stderr, ordered.stderr[-3000:]


def test_a_stopped_rank_is_named_whatever_the_collective_timeout(dirs, env):
    """A collective timeout (4 s) below the floor (30 s, the default): the stopped rank is named
    and ended before the timeout would blame the rank that waited for it. Every allowance is at
    most half the collective timeout, and a stopped rank needs none."""
    out = run_stall_job(["--collective-timeout", "4"], ["stop"], env, dirs / "on")
    _named_then_ended(out, "stopped (SIGSTOP)", "at step 5")
    assert "timed out" not in out.stderr.split("worker(s) failed", 1)[1], out.stderr[-3000:]


def test_debug_collectives_is_refused_where_torchs_detail_mode_crashes(dirs, env):
    """``TORCH_DISTRIBUTED_DEBUG=DETAIL`` segfaults DDP's constructor on some builds (torch 2.13's
    CPU wheel): ``--debug-collectives`` is tried first and refused with the reason, before any
    worker starts. Where it works, the job runs with it."""
    from ddpkit._errors import ConfigError
    from ddpkit._launch.cli.run import check_debug_collectives

    try:
        check_debug_collectives()
        works = True
    except ConfigError:
        works = False
    out = run_stall_job(["--debug-collectives"], ["none", "3", "1", "4"], env, dirs / "on")
    if works:
        assert out.returncode == 0, out.stderr[-3000:]
    else:
        assert (
            out.returncode != 0
            and "--debug-collectives: with TORCH_DISTRIBUTED_DEBUG=DETAIL" in out.stderr
        )
        assert "SIGSEGV" in out.stderr or "exited with" in out.stderr, out.stderr[-3000:]
        assert "rank 0 done" not in out.stdout  # refused before any worker started
