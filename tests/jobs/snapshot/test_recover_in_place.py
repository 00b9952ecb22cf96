"""``ddpkit run --recover in-place`` with real processes: a worker SIGKILLed (twice in one run, at a
random step, at 2 and 4 ranks, in the middle of the state's load), a rank that raised, the Trainer
under ddp, zero and fsdp and a hand loop; each ends bitwise where an uninterrupted run does, the
survivors in their own processes, with a ``recover`` record per recovery; a rank that does not
leave its step in time is shown, killed and replaced. Controls: the whole-job restart replaces every
process."""

from __future__ import annotations

import os
import random
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from ddpkit.testing import Job, run_job, wait_until
from tests.jobs.launch import netns
from tests.jobs.snapshot.memory_jobs import (
    HAND_JOB,
    HAND_STEPS,
    SEED,
    STEPS,
    check_exact,
    hand_run,
    lost_steps,
    memory_node_env,
    node_command,
    node_loss,
    pids,
    run,
    steps_done,
)
from tests.trainer_checks import bitwise_equal, max_abs_diff, same_bits, use_reference

# ddpkit run --max-restarts 3 --recover in-place, and the whole-job restart (the default)
IN_PLACE = {"restarts": 3, "launcher": ("--recover", "in-place")}
WHOLE = {"restarts": 3}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_kills_in_one_run_are_recovered_in_place_bitwise_the_others_in_their_processes(
    tmp_path, memory_env, memory_reference
):
    rng = random.Random(SEED)
    reference = use_reference(memory_reference, tmp_path)
    first, again = rng.randrange(2), rng.randrange(2)
    at, then = rng.randrange(2, STEPS // 2), rng.randrange(STEPS // 2 + 1, STEPS - 2)
    what = f"rank {first} after step {at}, rank {again} after step {then} (seed {SEED})"
    kills = ["--kill-rank", str(first), "--kill-after-step", str(at), "--kill-delay", "0.003",
             "--kill-again", str(again), str(then)]  # fmt: skip
    final, twice = run(tmp_path, "twice", *kills, env=memory_env, **IN_PLACE)
    assert final["attempt"] == 2, f"{what}: {(twice.stdout + twice.stderr)[-2000:]}"
    check_exact(tmp_path, "twice", final, reference, what)
    assert [x <= 1 for x in lost_steps(tmp_path / "twice-log", tmp_path / "twice")] == [True] * 2
    ran = pids(tmp_path / "twice-log")
    for attempt, killed in ((1, first), (2, again)):
        for rank in (0, 1):
            same = ran[rank][attempt] == ran[rank][attempt - 1]
            assert same == (rank != killed), f"{what}: rank {rank} in attempt {attempt}: {ran}"
    records = twice.events("recover")
    assert [(r["recovery"], r["replaced"]) for r in records] == [(1, [first]), (2, [again])], what
    for r in records:
        assert set(r["seconds"]) >= {"leave", "decide", "regroup", "restore", "total"}
        assert all(v >= 0 for v in r["seconds"].values()), r
    # Control: the whole-job restart (the default) gives every rank a new process.
    final, whole = run(tmp_path, "whole", *kills[:6], env=memory_env, **WHOLE)
    ran = pids(tmp_path / "whole-log")
    assert final["attempt"] == 1 and all(ran[r][1] != ran[r][0] for r in (0, 1)), ran
    assert whole.events("recover") == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_four_ranks_a_kill_during_the_states_load_is_recovered_again(tmp_path, memory_env):
    kill = ["--no-sync-bn", "--kill-rank", "2", "--kill-after-step", "9", "--kill-in-restore", "3"]
    final, load = run(tmp_path, "load", *kill, env=memory_env, nproc=4, **IN_PLACE)
    log = tmp_path / "load-log"
    assert list(log.glob("killed-in-restore-rank3")), (load.stdout + load.stderr)[-2000:]
    assert final["attempt"] == 2
    records = load.events("recover")
    assert [r["replaced"] for r in records] == [[3]], records  # the first load never finished
    ran = pids(log)
    kept = [r for r in range(4) if len(set(ran[r].values())) == 1]
    assert kept == [0, 1], ran  # ranks 2 and 3 each replaced once
    # at 4 ranks, in place as by the whole-job restart, where the uninterrupted run ends
    reference, _ = run(tmp_path, "reference", "--no-sync-bn", env=memory_env, nproc=4, **IN_PLACE)
    whole, _ = run(tmp_path, "whole", *kill, env=memory_env, nproc=4, **WHOLE)
    assert whole["attempt"] == 2
    for got in (final, whole):
        assert bitwise_equal(got, reference), max_abs_diff(got, reference)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("strategy", ["zero", "fsdp"])
def test_zero_and_fsdp_recover_a_killed_worker_in_place_bitwise(
    tmp_path, memory_env, strategy_references, strategy
):
    job = ["--strategy", strategy, "--no-sync-bn"]
    reference = use_reference(strategy_references(strategy), tmp_path)
    kill = ["--kill-rank", "0", "--kill-after-step", "13", "--kill-delay", "0.002"]
    final, killed = run(tmp_path, "killed", *job, *kill, env=memory_env, **IN_PLACE)
    assert final["attempt"] == 1 and same_bits(final["full"], reference["full"], "model", "optim")
    ran = pids(tmp_path / "killed-log")
    assert ran[1][1] == ran[1][0] and ran[0][1] != ran[0][0], ran
    assert [r["replaced"] for r in killed.events("recover")] == [[0]]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_that_raised_runs_again_in_its_process_bitwise(
    tmp_path, memory_env, memory_reference
):
    reference = use_reference(memory_reference, tmp_path)
    final, raised = run(tmp_path, "raised", "--raise-at", "1", "11", env=memory_env, **IN_PLACE)
    said = raised.output(1, "stderr")  # in rank 1's own log: rank 0 alone is on the terminal
    assert "rank 1 left its step (RuntimeError: planned failure in user code on rank 1)" in said
    check_exact(tmp_path, "raised", final, reference, "rank 1 raised at step 11")
    ran = pids(tmp_path / "raised-log")
    assert all(ran[r][1] == ran[r][0] for r in (0, 1)), ran  # nobody replaced
    assert [r["replaced"] for r in raised.events("recover")] == [[]]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_that_does_not_leave_its_step_in_time_is_shown_killed_and_replaced(
    tmp_path, memory_env, memory_reference
):
    reference = use_reference(memory_reference, tmp_path)
    env = memory_env | {"DDPKIT_RECOVER_TIMEOUT": "1"}
    # rank 0 pauses 60 s after step 8 (healthy, in no collective) as rank 1 is killed there
    args = ["--sleep-at", "0", "8", "60", "--kill-rank", "1", "--kill-after-step", "8"]
    final, late = run(tmp_path, "late", *args, env=env, **IN_PLACE)
    out = late.stdout + late.stderr
    assert "rank(s) 0 did not leave their step within 1 s of the failure: killed" in out, out
    assert "in on_step_end" in out, out  # where rank 0 was, from its stack
    ran = pids(tmp_path / "late-log")
    assert all(ran[r][1] != ran[r][0] for r in (0, 1)), ran
    assert [r["replaced"] for r in late.events("recover")] == [[0, 1]]
    check_exact(tmp_path, "late", final, reference, "a late rank replaced")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hand_loop_is_recovered_in_place_bitwise(tmp_path, memory_env):
    env = memory_env
    rng = random.Random(SEED)
    kill_rank, kill_step = rng.randrange(2), rng.randrange(2, HAND_STEPS)
    what = f"rank {kill_rank} killed after step {kill_step} (seed {SEED})"

    def hand(name: str, *args: str, recover=IN_PLACE["launcher"]) -> list[dict]:
        return hand_run(tmp_path, name, *args, env=env, launcher=recover)

    def ran(name: str) -> dict[int, list[int]]:
        return {
            r: [int((tmp_path / f"{name}-pid-rank{r}-attempt{a}").read_text()) for a in (0, 1)]
            for r in (0, 1)
        }

    reference = hand("reference", "--memory", "--every-steps", "0")
    kill = ["--memory", "--every-steps", "0", "--kill-rank", str(kill_rank),
            "--kill-step", str(kill_step)]  # fmt: skip
    killed = hand("in-place", *kill)
    assert all(r["attempt"] == 1 for r in killed), what
    assert killed[0]["resumed_from"] == kill_step - (kill_step % 4 == 0), what
    assert all(same_bits(killed[r], reference[r], "model", "optim") for r in (0, 1)), what
    other = 1 - kill_rank
    pid = ran("in-place")
    assert pid[other][0] == pid[other][1] and pid[kill_rank][0] != pid[kill_rank][1], (what, pid)
    # Control: the whole-job restart replaces the process of the rank that was not killed too.
    hand("whole", *kill, recover=())
    pid = ran("whole")
    assert pid[other][0] != pid[other][1], pid
    # Without copies in memory the loop is refused before its first step, naming what to pass.
    job = [str(tmp_path / "disk"), "--out", str(tmp_path / "disk")]
    launcher = ["--max-restarts", "1", *IN_PLACE["launcher"]]
    proc = run_job(HAND_JOB, *job, launcher_args=launcher, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "resumes every rank from the copies in memory, and this run keeps none" in proc.stderr
    assert not (tmp_path / "disk-rank0.pt").exists()


# Across nodes: two network-namespace nodes of one rank each (tests/jobs/launch/netns.py).


def _across(tmp_path: Path, checks, name: str = "") -> None:
    with netns.two_nodes(name or f"ri{os.getpid() % 100000}") as nodes:
        # two nodes of one rank train the weights of one node of two (test_multinode.py)
        reference, _ = run(tmp_path, "reference", env=memory_node_env(tmp_path))
        checks(nodes, reference)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_lost_node_is_replaced_in_place_bitwise_the_other_node_in_its_process(tmp_path):
    def checks(nodes, reference) -> None:
        # then the new node's worker is SIGKILLed after step 20: replaced on the new node
        final, job = node_loss(
            nodes, tmp_path, "lost", 29433, "--kill-again", "1", "20", launcher=IN_PLACE["launcher"]
        )
        ran = pids(tmp_path / "lost-log")
        assert ran[0][0] == ran[0][1] == ran[0][2] and len(set(ran[1].values())) == 3, ran
        lost, again = job.events("recover")
        print(f"\nnode b lost after step 15, recovered in place: {lost}\nthen: {again}")
        assert lost["replaced"] == [1] and lost["step"] == 14
        assert again["replaced"] == [1] and again["step"] in (19, 20)
        assert set(lost["seconds"]) >= {"leave", "decide", "regroup", "restore", "total"}
        check_exact(tmp_path, "lost", final, reference, "a lost node in place", samples=False)
        # Control: the whole-job restart replaces node a's process too.
        node_loss(nodes, tmp_path, "whole", 29434)
        ran = pids(tmp_path / "whole-log")
        assert ran[0][0] != ran[0][1], ran

    _across(tmp_path, checks)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_spare_node_waiting_for_a_place_takes_the_lost_nodes_in_place_bitwise(tmp_path):
    def checks(nodes, reference) -> None:
        launcher = IN_PLACE["launcher"]
        final, job = node_loss(nodes, tmp_path, "spare", 29439, launcher=launcher, spare=True)
        (event,) = job.events("recover")
        print(f"\nnode b lost after step 15, a spare waiting took its place: {event}")
        assert event["replaced"] == [1] and event["step"] == 14
        spare = (tmp_path / "spare-b2.log").read_text()
        assert "waiting for one's place" in spare and "taking the place of lost node 1" in spare
        ran = pids(tmp_path / "spare-log")
        assert ran[0][0] == ran[0][1] and ran[1][0] != ran[1][1], ran
        check_exact(tmp_path, "spare", final, reference, "a spare in place", samples=False)

    _across(tmp_path, checks)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_worker_killed_on_one_node_is_recovered_in_place_across_nodes(tmp_path):
    def checks(nodes, reference) -> None:
        kill = ("--kill-rank", "1", "--kill-after-step", "6", "--kill-delay", "0.003")
        final, killed = node_loss(
            nodes, tmp_path, "kill", 29435, *kill, launcher=IN_PLACE["launcher"], lose_node=False
        )
        ran = pids(tmp_path / "kill-log")
        assert ran[0][0] == ran[0][1] and ran[1][0] != ran[1][1], ran
        (event,) = killed.events("recover")
        print(f"\nrank 1 of node b killed after step 6, recovered in place: {event}")
        assert event["replaced"] == [1] and final["attempt"] == 1
        check_exact(tmp_path, "kill", final, reference, "a worker killed on node b", samples=False)
        # Control: the whole-job restart replaces node a's process too (torch may restart node a
        # for node b rejoining its rendezvous, without counting the restart).
        node_loss(nodes, tmp_path, "whole", 29436, *kill, lose_node=False)
        runs = (tmp_path / "whole-log" / "pids-rank0.txt").read_text().split()
        assert len(runs) == len(set(runs)) == 2, runs

    _across(tmp_path, checks)


def _two_node_job(nodes, tmp: Path, name: str, port: int, *extra: str):
    """Both nodes' `ddpkit run` of the memory job, in place, holding after step 15 until the test
    says go: (command, node a, node b, the log folder, the go file, the environment)."""
    (ns_a, addr_a), (ns_b, _) = nodes
    log, hold = tmp / f"{name}-log", tmp / f"{name}-go"
    env = memory_node_env(tmp)
    cmd = node_command(tmp, name, f"{addr_a}:{port}", (*IN_PLACE["launcher"], *extra))
    node_a = netns.on(ns_a, cmd, tmp, f"{name}-a.log", env)
    node_b = netns.on(ns_b, cmd, tmp, f"{name}-b.log", env)

    def holding() -> bool:
        assert node_a.poll() is None and node_b.poll() is None, (tmp / f"{name}-a.log").read_text()
        return steps_done(log, 0) >= 15 and steps_done(log, 1) >= 15

    wait_until(holding, 240, what="both ranks holding after step 15")
    return cmd, node_a, node_b, log, hold, env


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_new_node_started_after_the_recovery_was_given_back_joins_the_whole_restart(tmp_path):
    """Node b lost, no new node within the survivors' --join-timeout: the recovery is given back
    and node a waits in torchrun's rendezvous (as long again); a new node started then (judging
    node b's silence would take it --node-timeout and more) joins that rendezvous at once, and the
    job restarts whole and resumes bitwise."""

    def checks(nodes, reference) -> None:
        (_, _), (ns_b, _) = nodes
        cmd, node_a, node_b, log, hold, env = _two_node_job(
            nodes, tmp_path, "late", 29441, "--join-timeout", "12", "--node-timeout", "600"
        )
        os.killpg(node_b.pid, signal.SIGKILL)
        node_b.wait()
        hold.touch()
        said_a = lambda: (tmp_path / "late-a.log").read_text()  # noqa: E731
        wait_until(lambda: "not recovered in place" in said_a(), 240, what="the given back")
        new = netns.on(ns_b, cmd, tmp_path, "late-b2.log", env)
        codes = netns.finish([node_a, new], timeout=600)
        said_new = (tmp_path / "late-b2.log").read_text()
        assert codes == [0, 0], [said_a()[-3000:], said_new[-3000:]]
        assert "was given back" in said_new, said_new[-3000:]
        ran = pids(log)
        assert ran[0][0] != ran[0][1], ran  # the whole restart: node a's worker started again
        final = torch.load(tmp_path / "late.pt", weights_only=False)
        check_exact(tmp_path, "late", final, reference, "after a give-back", samples=False)

    _across(tmp_path, checks)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_spare_past_its_join_timeout_waits_for_a_restart_and_ends_when_the_job_ends(tmp_path):
    """A node started while the job runs on all its nodes waits --join-timeout for a place, then in
    torchrun's rendezvous for the job's next whole restart, saying so; the job ending first, it
    ends naming that (torch's agent alone ends in an AttributeError)."""
    with netns.two_nodes(f"rs{os.getpid() % 100000}") as nodes:
        (_, _), (ns_b, _) = nodes
        cmd, node_a, node_b, _, hold, env = _two_node_job(nodes, tmp_path, "late", 29440)
        spare = netns.on(ns_b, [*cmd[:4], "--join-timeout", "1", *cmd[4:]], tmp_path,
                         "late-spare.log", env)  # fmt: skip
        said = lambda: (tmp_path / "late-spare.log").read_text()  # noqa: E731
        wait_until(lambda: "waiting in torchrun's rendezvous" in said(), 120, what="the spare")
        hold.touch()
        codes = netns.finish([node_a, node_b, spare], timeout=300)
        assert codes[:2] == [0, 0], (tmp_path / "late-a.log").read_text()[-3000:]
        assert codes[2] == 2 and "the job ended before this node joined it" in said(), said()
        assert "Traceback" not in said() and "never called" not in said(), said()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_node_cut_from_the_network_is_replaced_and_ends_its_own_workers_naming_why(tmp_path):
    """Node b's link goes down (its agent and worker alive, unreachable): node a counts it lost on
    evidence (its beat still, its agent not answering), a new node takes its place, the job ends
    bitwise; node b's agent, its store silent for --node-timeout, ends its worker saying why."""
    name = f"rc{os.getpid() % 100000}"

    def checks(nodes, reference) -> None:
        (ns_a, _), (ns_b, _) = nodes
        cmd, node_a, node_b, log, hold, env = _two_node_job(
            nodes, tmp_path, "cut", 29437, "--node-timeout", "8"
        )
        subprocess.run(["ip", "-n", ns_b, "link", "set", f"{name}-vb", "down"], check=True)
        hold.touch()
        new = netns.on(ns_a, cmd, tmp_path, "cut-new.log", env)  # the new node, beside node a
        codes = netns.finish([node_a, new, node_b], timeout=600)
        logs = {n: (tmp_path / f"cut-{n}.log").read_text() for n in ("a", "new", "b")}
        assert codes[:2] == [0, 0], [text[-3000:] for text in logs.values()]
        # the evidence of a cut: its agent's address unreachable, or two probes in a row unanswered
        evidence = "is unreachable" in logs["a"] or "did not answer" in logs["a"]
        assert evidence and "node(s) 1 lost" in logs["a"], logs["a"][-3000:]
        assert "recovering in place" in logs["a"], logs["a"][-3000:]
        assert codes[2] != 0 and "does not answer this node" in logs["b"], logs["b"][-3000:]
        (event,) = Job(cmd, codes[0], logs["a"], run_dir=tmp_path / "cut").events("recover")
        assert event["replaced"] == [1]
        final = torch.load(tmp_path / "cut.pt", weights_only=False)
        check_exact(tmp_path, "cut", final, reference, "a node cut off", samples=False)

    _across(tmp_path, checks, name)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_rendezvous_hosts_node_lost_ends_the_other_node_with_its_summary(tmp_path):
    """Node a, which serves the rendezvous, SIGKILLed: node b cannot recover in place (every agent
    meets on that store); its launcher ends with its failure summary and why, not a traceback."""

    def checks(nodes, reference) -> None:
        _, node_a, node_b, _, hold, _ = _two_node_job(
            nodes, tmp_path, "host", 29438, "--node-timeout", "5"
        )
        os.killpg(node_a.pid, signal.SIGKILL)
        node_a.wait()
        hold.touch()
        (code,) = netns.finish([node_b], timeout=300)
        out = (tmp_path / "host-b.log").read_text()
        assert code not in (0, None), out[-3000:]
        assert "not recovered in place" in out and "does not answer this node" in out, out[-3000:]
        assert "Traceback" not in out.split("worker(s) failed", 1)[0][-2000:], out[-3000:]

    _across(tmp_path, checks, f"rh{os.getpid() % 100000}")
