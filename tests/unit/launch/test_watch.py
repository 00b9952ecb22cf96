"""The stall watch's decisions on records written by hand, a clock of the test's, and real process
states."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpkit._errors import ConfigError
from ddpkit._launch.agent.failure import cause, summarize_failure
from ddpkit._launch.cli.options import build_parser, config_from_args
from ddpkit._launch.watch import stall as watch
from ddpkit.distributed import _channels as channels
from ddpkit.distributed import _progress as progress
from ddpkit.distributed._progress import MAGIC, RECORD, Phase


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write(
    folder: Path,
    rank: int,
    *,
    step: int,
    phase: int = Phase.LOOP,
    coll: int = 0,
    seq: int = 1,
    steps=None,
    last_step: float = 0.1,
    pid: int = 0,
    timeout: float = 0.0,
) -> None:
    steps = step if steps is None else steps
    fields = (pid or 100 + rank, 1, phase, seq, step, steps, coll, -1, -1, 0.0, last_step, timeout)
    data = RECORD.pack(MAGIC, *fields)
    (folder / f"rank{rank}.progress").write_bytes(data)


def make_watch(
    tmp_path: Path, floor: float = 3.0, collective_timeout: float | None = None
) -> tuple[watch.Watch, Clock]:
    clock = Clock()
    policy = watch.StallPolicy(floor=floor, on_stall="warn", collective_timeout=collective_timeout)
    # the ranks' CPU and I/O never move: their records alone tell
    w = watch.Watch(tmp_path, policy, None, clock=clock, activity=lambda pid: (0, 0))
    w.start_attempt({0: (0, 100), 1: (1, 101)})
    return w, clock


def poll_at(w: watch.Watch, clock: Clock, t: float):
    clock.now = t
    w._next_poll = 0.0
    return w.poll({0, 1})


def test_the_rank_behind_is_named_once_its_allowance_is_spent(tmp_path, capsys):
    w, clock = make_watch(tmp_path)
    write(tmp_path, 0, step=6, seq=30)
    write(tmp_path, 1, step=5, seq=25)
    assert poll_at(w, clock, 1000.0) is None
    assert poll_at(w, clock, 1002.9) is None  # within the floor
    stall = poll_at(w, clock, 1003.2)
    assert stall is not None and stall.ranks == [1]
    assert (
        "rank 1 stalled: no progress for 3.2 s" in stall.headline
        and "rank 0 at step 6" in stall.headline
    )
    assert "rank 1 stalled" in capsys.readouterr().err
    assert poll_at(w, clock, 1010.0) is None  # said once


def test_ranks_all_at_the_same_place_are_left_to_the_collective_timeout(tmp_path):
    # Control of the rule above: nobody is ahead, so nobody waits for anyone (a long evaluation
    # everywhere).
    w, clock = make_watch(tmp_path)
    for rank in (0, 1):
        write(tmp_path, rank, step=5, seq=25)
    poll_at(w, clock, 1000.0)
    assert poll_at(w, clock, 1100.0) is None


def test_a_rank_that_advances_is_not_stalled(tmp_path):
    w, clock = make_watch(tmp_path)
    write(tmp_path, 0, step=6, seq=30)
    write(tmp_path, 1, step=5, seq=25)
    poll_at(w, clock, 1000.0)
    write(tmp_path, 1, step=5, seq=26)  # a mark: progress
    assert poll_at(w, clock, 1002.5) is None
    assert poll_at(w, clock, 1005.0) is None
    assert poll_at(w, clock, 1005.6) is not None


def test_behind_in_collectives_at_the_same_step_names_who_has_not_arrived(tmp_path):
    w, clock = make_watch(tmp_path)
    write(tmp_path, 0, step=5, phase=Phase.COLLECTIVE, coll=12, seq=30)
    write(tmp_path, 1, step=5, phase=Phase.USER, coll=11, seq=25)
    poll_at(w, clock, 1000.0)
    stall = poll_at(w, clock, 1004.0)
    assert stall is not None and stall.ranks == [1]
    assert any(
        "all_reduce #12: rank(s) 0 wait in it; rank 1 has not arrived" in line
        for line in stall.report
    )


@pytest.mark.parametrize(
    ("how", "allowed", "collective_timeout"),
    [
        ({"steps": 1}, 30.0, None),  # the first step: 10 x floor
        ({"phase": Phase.SNAPSHOT}, 30.0, None),  # a snapshot: 10 x floor
        ({"phase": Phase.EVALUATION}, 30.0, None),  # an evaluation: 10 x floor
        ({"phase": Phase.MAIN_FIRST}, 30.0, None),  # main_first()'s body on the first rank
        ({"phase": Phase.EXPORT}, 30.0, None),  # the best weights written on rank 0
        # at most half the collective timeout: named before the waiting ranks' collectives fail
        ({"steps": 1}, 10.0, 20.0),
        ({"phase": Phase.SNAPSHOT}, 10.0, 20.0),
        ({"phase": Phase.SNAPSHOT}, 30.0, 300.0),
        ({}, 3.0, None),  # control: any other step gets the floor
        ({}, 2.0, 4.0),  # ... at most half the collective timeout too
        # the rank's own group's timeout (ddpkit.init(timeout=...)) before the launcher's
        ({"phase": Phase.SNAPSHOT, "timeout": 40.0}, 20.0, 6.0),
        ({"phase": Phase.SNAPSHOT, "timeout": 120.0}, 30.0, 6.0),
    ],
)
def test_first_step_snapshot_and_evaluation_allowances(tmp_path, how, allowed, collective_timeout):
    w, clock = make_watch(tmp_path, collective_timeout=collective_timeout)
    write(tmp_path, 0, step=6, seq=30)
    write(tmp_path, 1, step=5, seq=25, **how)
    poll_at(w, clock, 1000.0)
    assert poll_at(w, clock, 1000.0 + allowed - 0.2) is None
    assert poll_at(w, clock, 1000.0 + allowed + 0.2) is not None


def test_ten_times_the_median_step_when_above_the_floor(tmp_path):
    w, clock = make_watch(tmp_path)
    for step in range(3, 8):  # steps of 2 s, seen ending
        write(tmp_path, 0, step=step + 1, seq=step * 10)
        write(tmp_path, 1, step=step, seq=step * 10, last_step=2.0)
        poll_at(w, clock, clock.now + 2.0)
    start = clock.now
    assert poll_at(w, clock, start + 19.5) is None
    assert poll_at(w, clock, start + 20.5) is not None


def test_records_of_another_process_are_not_this_attempts(tmp_path):
    w, clock = make_watch(tmp_path)
    write(tmp_path, 0, step=6, seq=30)
    write(tmp_path, 1, step=5, seq=25, pid=999)  # the last attempt's process wrote it
    poll_at(w, clock, 1000.0)
    assert poll_at(w, clock, 1100.0) is None


def test_off_says_nothing(tmp_path):
    clock = Clock()
    w = watch.Watch(tmp_path, watch.StallPolicy(floor=0), None, clock=clock)
    w.start_attempt({0: (0, 100), 1: (1, 101)})
    write(tmp_path, 0, step=6, seq=30)
    write(tmp_path, 1, step=5, seq=25)
    poll_at(w, clock, 1000.0)
    assert poll_at(w, clock, 2000.0) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_process_state_tells_a_stopped_process_from_a_sleeping_one():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        # control: a live process that was never stopped. Just after exec it may be running,
        # sleeping or in disk sleep (its pages are still being read in), never stopped.
        before = watch.process_state(proc.pid)
        assert before != "gone" and not before.startswith("stopped"), before
        os.kill(proc.pid, signal.SIGSTOP)
        os.waitpid(proc.pid, os.WUNTRACED)  # returns once the child is stopped
        assert watch.process_state(proc.pid) == "stopped (SIGSTOP)"
    finally:
        proc.kill()
        proc.wait()
    assert watch.process_state(proc.pid) == "gone"


def _job_folder(tmp_path, monkeypatch):
    """``tmp_path`` as the job folder; the progress records' folder in it."""
    monkeypatch.setenv(channels.JOB_DIR_ENV, str(tmp_path))
    (tmp_path / channels.PROGRESS).mkdir()
    return tmp_path / channels.PROGRESS


def test_marks_write_a_record_the_watch_reads(tmp_path, monkeypatch):
    tmp_path = _job_folder(tmp_path, monkeypatch)
    monkeypatch.setenv("RANK", "3")
    for name in ("_buf", "_ints", "_floats"):
        monkeypatch.setattr(progress, name, None)
    monkeypatch.setattr(progress, "_opened", False)
    monkeypatch.setattr(progress, "_trainer_counts", False)
    progress.batch_taken()
    with progress.collective("barrier"):
        inside = watch.read_record(tmp_path / "rank3.progress")
    after = watch.read_record(tmp_path / "rank3.progress")
    assert inside is not None and after is not None
    assert inside.pid == os.getpid() and inside.phase == Phase.COLLECTIVE and inside.op == "barrier"
    assert inside.coll == after.coll and after.phase == Phase.LOOP and after.seq == inside.seq + 1
    progress._ints.release()
    progress._floats.release()
    progress._buf.close()


def test_the_group_timeout_reaches_the_record_with_the_first_mark_not_before(tmp_path, monkeypatch):
    """``ddpkit.init`` records its group's collective timeout for the watch's cap; a rank with no
    mark yet keeps no record (it holds the watch's judgement, as before: rank 0 downloading before
    its first mark is no stall)."""
    tmp_path = _job_folder(tmp_path, monkeypatch)
    monkeypatch.setenv("RANK", "2")
    _fresh_progress(monkeypatch)
    progress.collective_timeout(42.0)
    assert not (tmp_path / "rank2.progress").exists()
    progress.begin_step(1)
    record = watch.read_record(tmp_path / "rank2.progress")
    assert record is not None and record.timeout == 42.0 and record.step == 1
    progress._ints.release()
    progress._floats.release()
    progress._buf.close()


def _fresh_progress(monkeypatch) -> None:
    """This process's progress record as before its first mark, put back after the test."""
    for name in ("_buf", "_ints", "_floats"):
        monkeypatch.setattr(progress, name, None)
    monkeypatch.setattr(progress, "_opened", False)
    for name, value in {"_timeout": 0.0, "_trainer_counts": False, "_step": 0, "_steps": 0}.items():
        monkeypatch.setattr(progress, name, value)  # begin_step sets them


def test_a_rerun_in_place_counts_its_record_afresh(tmp_path, monkeypatch):
    """A survivor's record after ``forget_for_recovery`` reads as a fresh process's: no step, no
    collective, the count of marks gone on. Control: the failed run's counts, read before it, would
    put the survivor ahead of a replacement starting at step 0 (the watch would blame that one)."""
    tmp_path = _job_folder(tmp_path, monkeypatch)
    monkeypatch.setenv("RANK", "1")
    _fresh_progress(monkeypatch)
    progress.begin_step(7)
    with progress.collective("all_reduce"):
        pass
    failed = watch.read_record(tmp_path / "rank1.progress")
    assert failed is not None and failed.step == 7 and failed.coll >= 1  # the control
    from ddpkit.distributed import _runtime

    _runtime.forget_for_recovery()
    rerun = watch.read_record(tmp_path / "rank1.progress")
    assert rerun is not None and (rerun.step, rerun.steps, rerun.coll) == (0, 0, 0)
    assert rerun.phase == Phase.STARTING and rerun.seq > failed.seq
    progress._ints.release()
    progress._floats.release()
    progress._buf.close()


def test_outside_ddpkit_run_marks_write_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(channels.JOB_DIR_ENV, raising=False)
    for name in ("_buf", "_ints", "_floats"):
        monkeypatch.setattr(progress, name, None)
    monkeypatch.setattr(progress, "_opened", False)
    progress.mark(Phase.DATA)
    assert progress._buf is None and list(tmp_path.iterdir()) == []


def test_the_cause_is_the_killed_rank_not_the_survivor_stopped_after_it():
    # torchrun stamps failures in whole seconds when it polls: the survivor it stopped with SIGTERM
    # can carry the earlier stamp. Control: torchrun's own choice, the smallest stamp, names the
    # survivor.
    def failure(rank, code, stamp):
        return SimpleNamespace(
            exitcode=code, local_rank=rank, pid=10 + rank, timestamp=stamp, error_file_data={},
            signal_name=lambda: signal.Signals(-code).name,
        )  # fmt: skip

    failures = {0: failure(0, -signal.SIGTERM, 100), 1: failure(1, -signal.SIGKILL, 101)}
    assert cause(failures)[0] == 1
    assert min(failures, key=lambda r: failures[r].timestamp) == 0
    text = summarize_failure(
        SimpleNamespace(failures=failures), where="rank 0 at step 6; rank 1 at step 5"
    )
    assert text.splitlines()[0].endswith("first: rank 1 (local rank 1, pid 11): killed by SIGKILL")
    assert "where each rank was: rank 0 at step 6; rank 1 at step 5" in text


def test_stall_timeout_option_and_variable(monkeypatch):
    def cfg(*args):
        return config_from_args(build_parser().parse_args([*args, "train.py"]))

    assert cfg("--stall-timeout", "0").stall_timeout == 0
    assert cfg("--stall-timeout", "12").stall_timeout == 12
    with pytest.raises(ConfigError, match="--stall-timeout"):
        cfg("--stall-timeout", "soon")
    with pytest.raises(ConfigError, match="--on-stall 'maybe': use end or warn"):
        cfg("--on-stall", "maybe")
    assert watch.policy_from(None, "end", {}).floor == watch.DEFAULT_FLOOR
    assert watch.policy_from(None, "end", {watch.TIMEOUT_ENV: "0"}).on is False
    assert watch.policy_from(5.0, "warn", {watch.TIMEOUT_ENV: "0"}).floor == 5.0  # the option wins
    with pytest.raises(ConfigError, match=watch.TIMEOUT_ENV):
        watch.policy_from(None, "end", {watch.TIMEOUT_ENV: "-3"})


def test_a_rank_whose_cpu_moves_is_named_slow_again_while_it_lasts_and_never_ended(
    tmp_path, capsys
):
    clock = Clock()
    # pids no process has (the policy ends stalls: a kill must reach nobody)
    pid0, pid1 = 2**31 - 2, 2**31 - 1
    ticks = {pid1: 0}

    def activity(pid: int) -> tuple[int, int]:
        if pid == pid1:  # rank 1 computes: 50 clock ticks a second
            ticks[pid1] = int((clock.now - 1000.0) * 50)
        return ticks.get(pid, 0), 0

    policy = watch.StallPolicy(floor=3.0, on_stall="end")
    w = watch.Watch(tmp_path, policy, None, clock=clock, activity=activity)
    w.start_attempt({0: (0, pid0), 1: (1, pid1)})
    write(tmp_path, 0, step=6, seq=30, phase=Phase.COLLECTIVE, coll=9, pid=pid0)  # waits for 1
    write(tmp_path, 1, step=5, seq=25, coll=8, pid=pid1)
    for t in [1000.0 + 0.5 * i for i in range(30)]:  # 15 s
        assert poll_at(w, clock, t) is None  # nothing ended
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("ddpkit run: rank 1 slow:")]
    assert len(said) >= 3, err  # at 3 s, then every 3 s while it lasts
    assert "it runs" in said[0] and "not ended" in said[0] and "stalled" not in err
    # control: its CPU stops moving; past its allowance it is stalled
    w.activity = lambda pid: (0, 0)
    assert poll_at(w, clock, 1016.0) is None
    stall = poll_at(w, clock, 1019.5)
    assert stall is not None and stall.ranks == [1]
