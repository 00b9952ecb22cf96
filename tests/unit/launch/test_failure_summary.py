"""The failed job's summary in the agent of ``ddpkit run``: a rank that left the job with exit
code 0 while the others went on, and ranks that disagreed on a collective. Pure logic over hand-made
exit codes, progress records and failures; the jobs are in ``tests/jobs/launch/test_disagree.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from ddpkit._launch.agent import agent as agent_module
from ddpkit._launch.agent import failure
from ddpkit._launch.agent.agent import Agent
from ddpkit._launch.agent.failure import Left, summarize_failure
from ddpkit._launch.watch import stall as watch
from ddpkit.distributed._progress import MAGIC, RECORD, Phase

LOST = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"


def _failure(exitcode: int, message: str | None = None, local_rank: int = 0, pid: int = 100):
    data = {"message": {"message": message, "extraInfo": {"py_callstack": ""}}} if message else {}
    return SimpleNamespace(
        exitcode=exitcode,
        timestamp=10,
        error_file_data=data,
        local_rank=local_rank,
        pid=pid,
        signal_name=lambda: f"signal {-exitcode}",
    )


class _Proc:
    def __init__(self, pid: int) -> None:
        self.pid, self.code = pid, None

    def poll(self):
        return self.code


def _agent(tmp_path: Path, nproc: int = 2):
    """An agent of ``nproc`` workers (global rank = local rank), without torchrun behind it."""
    agent = object.__new__(Agent)
    procs = {local: _Proc(100 + local) for local in range(nproc)}
    context = object()
    agent.worker_processes = lambda: procs  # type: ignore[method-assign]
    agent.process_context = lambda: context  # type: ignore[method-assign]
    agent.watch = watch.Watch(tmp_path, watch.StallPolicy(floor=0), None)
    agent.watch.start_attempt({r: (r, 100 + r) for r in range(nproc)})
    agent.attempt = agent_module.Attempt({r: r for r in range(nproc)})
    agent.link, agent._round = None, None
    group = SimpleNamespace(
        workers=[SimpleNamespace(local_rank=r, global_rank=r) for r in range(nproc)]
    )
    return agent, procs, group


def _polls(agent, procs, *timeline: dict[int, int]) -> None:
    """Each entry: the workers that have exited by that poll, with their codes."""
    for exited in timeline:
        for local, code in exited.items():
            procs[local].code = code
        agent.attempt.polls += 1
        agent._note_exits({local: p.code for local, p in procs.items()})


def _mark(folder: Path, rank: int, step: int, coll: int, phase: int = Phase.USER) -> None:
    data = RECORD.pack(MAGIC, 100 + rank, 1, phase, 40, step, step, coll, -1, -1, 0.0, 0.1, 0.0)
    (folder / f"rank{rank}.progress").write_bytes(data)


def test_a_rank_that_exits_0_while_the_others_go_on_is_said_before_the_survivors_failure(tmp_path):
    # A Trainer: rank 1 calls sys.exit(0) in a step-end callback at step 5; rank 0 enters the log
    # window's all_gather (its second collective) and loses its peer.
    agent, procs, group = _agent(tmp_path)
    _mark(tmp_path, 0, step=5, coll=2)
    _mark(tmp_path, 1, step=5, coll=1)
    _polls(agent, procs, {}, {1: 0}, {0: 1})
    left = agent._left_early(group)
    assert left == [Left(1, 1, 101, 5)], left
    err = SimpleNamespace(failures={0: _failure(1, LOST)})
    summary = summarize_failure(err, left=left)
    first, second = summary.splitlines()[:2]
    assert first.startswith(
        "ddpkit run: rank 1 (local rank 1, pid 101) left the job with exit code 0 at step 5 while "
        "the others went on; rank 0 then failed (below): a script that returns, or calls "
        "sys.exit(0), on some ranks only"
    ), first
    assert second.startswith("ddpkit run: 1 worker(s) failed; first: rank 0"), second
    # seen in the same poll as the failure: the marks still say it left first
    agent, procs, group = _agent(tmp_path)
    _polls(agent, procs, {}, {0: 1, 1: 0})
    assert [g.rank for g in agent._left_early(group)] == [1]


def test_no_such_line_when_the_rank_that_exited_0_had_not_left_early(tmp_path):
    # Control: every rank reached the last step's collectives; rank 1 exited 0 at its end, then rank
    # 0 failed on its own (writing its weights).
    agent, procs, group = _agent(tmp_path)
    _mark(tmp_path, 0, step=12, coll=12)
    _mark(tmp_path, 1, step=12, coll=12)
    _polls(agent, procs, {}, {1: 0}, {0: 1})
    assert agent._left_early(group) == []
    err = SimpleNamespace(failures={0: _failure(1, "OSError: disk full")})
    assert "left the job" not in summarize_failure(err, left=[])
    # Behind, but it exited after the failure (a script that catches its collective's error and
    # returns): not the cause.
    _mark(tmp_path, 1, step=5, coll=5)
    agent, procs, group = _agent(tmp_path)
    _polls(agent, procs, {}, {0: 1}, {1: 0})
    assert agent._left_early(group) == []


def test_without_marks_an_exit_0_counts_only_when_seen_before_the_failure(tmp_path):
    agent, procs, group = _agent(tmp_path)  # no records: a loop ddpkit does not see
    _polls(agent, procs, {}, {1: 0}, {}, {0: 1})
    assert agent._left_early(group) == [Left(1, 1, 101, None)]
    summary = summarize_failure(
        SimpleNamespace(failures={0: _failure(1, LOST)}), left=agent._left_early(group)
    )
    assert "left the job with exit code 0 while the others went on" in summary, summary
    # control: the exit and the failure in one poll, nothing else to tell them apart
    agent, procs, group = _agent(tmp_path)
    _polls(agent, procs, {}, {0: 1, 1: 0})
    assert agent._left_early(group) == []


def test_a_success_says_nothing_of_ranks_that_left(tmp_path, monkeypatch):
    # Every rank exits 0: torchrun reports a success, and the agent keeps no ranks that left.
    agent, procs, group = _agent(tmp_path)
    _polls(agent, procs, {}, {1: 0}, {0: 0})
    agent._published_to = None
    agent.watch = None
    agent.after_monitor(group, SimpleNamespace(state=agent_module.WorkerState.SUCCEEDED))
    assert agent.left == []


def test_ranks_that_disagreed_on_a_collective_are_said_in_the_summary():
    stall = watch.Stall(
        [1],
        "ddpkit run: rank 1 stalled: no progress for 3.0 s (allowed 3.0 s), sleeping, at step 5, "
        "in collective barrier #2; rank 0 at step 5, in collective all_gather #2",
        [],
    )
    words = "ranks disagree on collective #2: rank 0 in all_gather, rank 1 in barrier: ..."
    stall.disagreement = words
    err = SimpleNamespace(failures={1: _failure(-9, local_rank=1), 0: _failure(-15, LOST)})
    lines = summarize_failure(err, stall=stall, left=[]).splitlines()
    assert lines[0].endswith("first: rank 1 (local rank 1, pid 100): ended by the stall watch "
                             "(killed by signal 9)"), lines  # fmt: skip
    assert lines[1] == f"  {words}" and lines[2].startswith("  rank 1 stalled:"), lines
    # control: a plain stall keeps its words
    stall.disagreement = ""
    lines = summarize_failure(err, stall=stall, left=[]).splitlines()
    assert "stalled, ended by the stall watch" in lines[0] and "disagree" not in "\n".join(lines)


def test_the_collective_a_rank_left_as_the_job_failed_is_kept_for_where_it_was():
    def record(phase: int, coll: int, steps: int = 5) -> watch.Record:
        return watch.Record(100, phase, "all_reduce", 5, steps, 40, coll, -1, -1, 0.0, 0.1)

    waiting = record(Phase.COLLECTIVE, 4)
    assert agent_module._left_collective(waiting, record(Phase.USER, 4))
    # it went on: another collective, or another step
    assert not agent_module._left_collective(waiting, record(Phase.USER, 5))
    assert not agent_module._left_collective(waiting, record(Phase.DATA, 4, steps=6))
    assert not agent_module._left_collective(waiting, record(Phase.COLLECTIVE, 4))
    assert not agent_module._left_collective(None, record(Phase.USER, 4))


def test_the_workers_torchrun_stopped_after_its_poll_are_in_the_summary(tmp_path):
    # torch < 2.7 returns the failures of the workers that had exited when it polled: rank 0's. Rank
    # 1 raised a moment later (its own error file), rank 2 was ended by the agent's SIGTERM, rank 3
    # still runs (a stuck process torchrun gave up on), and rank 4 exited with 0.
    agent, procs, group = _agent(tmp_path, nproc=5)
    errors = {}
    for local in range(5):
        errors[local] = str(tmp_path / f"error{local}.json")
    (tmp_path / "error1.json").write_text(
        '{"message": {"message": "OSError: ddpkit: cannot write metrics.jsonl", '
        '"extraInfo": {"py_callstack": "", "timestamp": "10"}}}'
    )
    context = SimpleNamespace(error_files=errors)
    agent.process_context = lambda: context  # type: ignore[method-assign]
    for local, code in {0: 1, 1: 1, 2: -15, 4: 0}.items():
        procs[local].code = code
    first = _failure(1, "OSError: ddpkit: cannot write metrics.jsonl", local_rank=0, pid=100)
    result = SimpleNamespace(failures={0: first})
    Agent._add_stopped(agent, group, result)
    assert sorted(result.failures) == [0, 1, 2]
    assert result.failures[0] is first  # the poll's own record is kept
    assert result.failures[1].exitcode == 1 and result.failures[2].exitcode == -15
    summary = summarize_failure(result)
    assert "then rank 1 (local rank 1, pid 101): exit code 1: OSError: ddpkit: cannot" in summary
    assert "then rank 2 (local rank 2, pid 102): killed by SIGTERM" in summary
    # control: the poll's failures alone, as torch 2.6 returns them, name rank 0 only
    alone = summarize_failure(SimpleNamespace(failures={0: first}))
    assert "then rank" not in alone and "1 worker(s) failed" in alone


def test_a_rank_that_raised_and_was_cut_short_by_the_launchers_sigterm_sets_the_exit_code():
    # Rank 1 raised and recorded it; while its interpreter wound down, rank 0's lost-peer error was
    # polled first and the agent's SIGTERM ended rank 1. The job failed of rank 1's exception: exit
    # code 1, as when rank 1's own exit is polled first.
    lost = _failure(1, LOST, local_rank=0, pid=100)
    raised = _failure(-15, "ValueError: planned failure on rank 1", local_rank=1, pid=101)
    err = SimpleNamespace(failures={0: lost, 1: raised})
    assert failure.exit_code(err) == 1
    summary = summarize_failure(err)
    assert "first: rank 1 (local rank 1, pid 101): raised, then signal 15 ended it" in summary
    # or the agent's SIGKILL, a thread keeping it alive past the SIGTERM's grace
    killed = _failure(-9, "ValueError: planned failure on rank 1", local_rank=1, pid=101)
    assert failure.exit_code(SimpleNamespace(failures={0: lost, 1: killed})) == 1
    assert "ValueError: planned failure on rank 1" in summary
    # control: ended by SIGTERM with nothing recorded (a scheduler's signal to every process): the
    # shell's code for a death by SIGTERM
    quiet = SimpleNamespace(
        failures={0: _failure(-15, local_rank=0), 1: _failure(-15, local_rank=1)}
    )
    assert failure.exit_code(quiet) == 128 + 15
    assert "killed by signal 15" in summarize_failure(quiet)
