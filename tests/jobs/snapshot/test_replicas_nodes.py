"""A lost node healed in place from the copies of its ranks' state on other nodes, under
``ddpkit run --recover in-place`` across network-namespace nodes (tests/jobs/launch/netns.py):
``fsdp`` and ``zero`` with a node lost after a step, a node lost in the middle of a copy's
transfer, two losses in a row, two of three nodes lost at once. Each ends bitwise where an
uninterrupted run ends, the surviving rank in its own process; each control (copies off, or fewer
than the loss needs) goes back to the disk."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit._launch.agent import jobdir
from ddpkit.snapshot import _folders as folders
from ddpkit.testing import read_records, run_job, wait_until
from tests.jobs.launch import netns
from tests.jobs.snapshot.memory_jobs import pids, steps_done
from tests.trainer_checks import rank_differences

JOB = str(Path(__file__).parents[1] / "scripts" / "replica_job.py")
IN_PLACE = ("--recover", "in-place")


def _env(tmp: Path) -> dict[str, str]:
    return netns.node_env(1) | {jobdir.ROOT_ENV: str(tmp / "shm")}


def _records(run_dir: Path, event: str) -> list[dict]:
    return [r for r in read_records(run_dir) if r.get("event") == event]


def _listening(ns: str, port: int) -> bool:
    """Whether a process of namespace ``ns`` listens on TCP ``port``."""
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "ss", "-ltnH", f"sport = :{port}"],
        capture_output=True,
        text=True,
    )
    return bool(out.stdout.strip())


def _same(final: dict, reference: dict) -> bool:
    """The gathered model and optimizer states (``full``) identical to the bit."""
    for part in ("model", "optim"):
        x, y = final["full"][part], reference["full"][part]
        if x.keys() != y.keys():
            return False
        for k in x:
            if not (torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k]):
                return False
    return True


class Job:
    """One job of ``nnodes`` nodes of one rank (``nodes[i]`` the namespace of node i, the first
    serving the rendezvous), started on each; a node taken away and a new one started in its
    place."""

    def __init__(
        self,
        tmp: Path,
        name: str,
        addr: str,
        port: int,
        nodes: list[str],
        *args: str,
        launch: tuple[str, ...] = ("--nnodes", ""),
    ):
        self.tmp, self.name, self.nodes = tmp, name, nodes
        self.log, self.hold = tmp / f"{name}-log", tmp / f"{name}-go"
        self.log.mkdir()
        launch = tuple(a or str(len(nodes)) for a in launch)  # "": every node
        self.cmd = [
            sys.executable, "-m", "ddpkit.cli", "run", *launch, "--nproc", "1", "--max-restarts",
            "3", *IN_PLACE, "--rdzv-endpoint", f"{addr}:{port}", JOB, str(tmp / name), "--log",
            str(self.log), "--out", str(tmp / f"{name}.pt"), *args,
        ]  # fmt: skip
        # node 0 first, and the others once it serves the rendezvous: a node started in the same
        # namespace could serve it instead, and then be one of the nodes taken away
        self.procs = [self._on(nodes[0], "0")]
        self.wait(lambda: _listening(nodes[0], port), f"node 0 serving the rendezvous at {port}")
        self.procs += [self._on(ns, f"{i}") for i, ns in enumerate(nodes) if i > 0]
        self.started = len(nodes)

    def _on(self, ns: str, label: str) -> subprocess.Popen:
        return netns.on(ns, self.cmd, self.tmp, f"{self.name}-{label}.log", _env(self.tmp))

    def wait(self, done: object, what: str) -> None:
        def check() -> bool:
            for i, p in enumerate(self.procs):
                assert p.poll() is None, self.output(i)[-3000:]
            return bool(done() if callable(done) else done)

        wait_until(check, 300, what=what)

    def replace(self, *which: int, new: bool = True) -> None:
        """Take nodes ``which`` away (agent and workers SIGKILLed), start a new node in each
        place (``new``; else the job goes on without them)."""
        for i in which:
            os.killpg(self.procs[i].pid, signal.SIGKILL)
            self.procs[i].wait()
        for i in which:
            if new:
                self.procs[i] = self._on(self.nodes[i], f"{self.started}")
                self.started += 1
        if not new:
            self.procs = [p for i, p in enumerate(self.procs) if i not in which]

    def output(self, i: int) -> str:
        logs = sorted(self.tmp.glob(f"{self.name}-*.log"), key=os.path.getmtime)
        return "\n".join(p.read_text() for p in logs)

    def finish(self) -> dict:
        codes = netns.finish(self.procs, timeout=600)
        assert codes == [0] * len(self.procs), self.output(0)[-5000:]
        return torch.load(self.tmp / f"{self.name}.pt", weights_only=False)


def _reference(tmp: Path, nproc: int, *args: str) -> dict:
    """The uninterrupted run on one node, at the same thread count (nodes of one rank train the
    same weights as one node of them all: tests/jobs/launch/test_multinode.py)."""
    (tmp / "reference-log").mkdir()
    job = [str(tmp / "reference"), "--log", str(tmp / "reference-log"), "--out",
           str(tmp / "reference.pt"), *args]  # fmt: skip
    proc = run_job(JOB, *job, nproc=nproc, env=_env(tmp), cwd=tmp, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp / "reference.pt", weights_only=False)


def _lose_node_after_step(
    job: Job, step: int, *which: int, new: bool = True, written: int | None = None
) -> None:
    """Every rank holds after ``step``; nodes ``which`` are taken away and new ones started
    (``new``). With ``written``, not before the disk snapshot of that step, written in the
    background while the ranks go on, is whole."""
    ranks = range(len(job.nodes))
    job.wait(lambda: all(steps_done(job.log, r) >= step for r in ranks), f"step {step}")
    if written is not None:
        marker = job.tmp / job.name / "snapshots" / folders.folder_name(written) / folders.MARKER
        job.wait(marker.exists, f"the disk snapshot of step {written}")
    job.replace(*which, new=new)
    job.hold.touch()


@pytest.fixture
def nodes(tmp_path):
    with netns.two_nodes(f"rp{os.getpid() % 100000}") as made:
        (tmp_path / "shm").mkdir()
        yield made


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize("strategy", ["fsdp", "zero"])
def test_a_node_lost_after_a_step_is_healed_in_place_from_its_copies_bitwise(
    tmp_path, nodes, strategy
):
    (ns_a, addr), (ns_b, _) = nodes
    job_args = ("--strategy", strategy, "--no-sync-bn")
    reference = _reference(tmp_path, 2, *job_args)
    hold = ("--hold-after-step", "15", "--hold-file")
    job = Job(tmp_path, "lost", addr, 29451, [ns_a, ns_b], *job_args, *hold,
              str(tmp_path / "lost-go"))  # fmt: skip
    _lose_node_after_step(job, 15, 1)
    final = job.finish()
    (event,) = _records(tmp_path / "lost", "recover")
    print(f"\n{strategy}: node b lost after step 15, healed in place: {event}")
    # both ranks held after step 15, before its copy: step 14, rank 1's from rank 0's memory
    assert event["replaced"] == [1] and event["step"] == 14
    assert event["source"] == "memory (ranks [1] from rank 0)"
    ran = pids(job.log)
    assert ran[0][0] == ran[0][1] and ran[1][0] != ran[1][1], ran
    assert _same(final, reference) and final["resumed_from"] == 14
    assert rank_differences(tmp_path / "lost.pt", tmp_path / "reference.pt") == {0: [], 1: []}
    # Control: without copies on another node, the same loss goes back to the disk (none: the
    # start).
    job = Job(tmp_path, "off", addr, 29452, [ns_a, ns_b], *job_args, "--replicas", "1", *hold,
              str(tmp_path / "off-go"))  # fmt: skip
    _lose_node_after_step(job, 15, 1)
    final = job.finish()
    (event,) = _records(tmp_path / "off", "recover")
    assert event["source"] == "none" and final["resumed_from"] is None
    assert _same(final, reference)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_node_lost_during_a_copys_transfer_resumes_from_the_copy_before(tmp_path, nodes):
    (ns_a, addr), (ns_b, _) = nodes
    job_args = ("--strategy", "fsdp", "--no-sync-bn")
    reference = _reference(tmp_path, 2, *job_args)
    # rank 1 sends the first 4 KiB of its copy of step 12, and its node is taken away
    job = Job(tmp_path, "cut", addr, 29453, [ns_a, ns_b], *job_args, "--kill-in-transfer", "1",
              "12")  # fmt: skip
    job.wait(lambda: (job.log / "in-transfer-rank1").exists(), "rank 1 in its transfer")
    job.replace(1)
    final = job.finish()
    (event,) = _records(tmp_path / "cut", "recover")
    print(f"\nnode b lost in the transfer of its copy of step 12: {event}")
    # the copy of step 12 on rank 0 was begun, never whole: every rank resumes from step 11
    assert event["step"] == 11 and event["source"] == "memory (ranks [1] from rank 0)"
    lines = (job.log / "steps-rank0.txt").read_text().splitlines()
    done = max(int(step) for attempt, step in map(str.split, lines) if attempt == "0")
    assert done - event["step"] <= 1  # at most one step lost
    assert _same(final, reference)
    # Control: with copies off, the same loss (after step 12) goes back to the disk.
    job = Job(tmp_path, "off", addr, 29454, [ns_a, ns_b], *job_args, "--replicas", "1",
              "--hold-after-step", "12", "--hold-file", str(tmp_path / "off-go"))  # fmt: skip
    _lose_node_after_step(job, 12, 1)
    final = job.finish()
    (event,) = _records(tmp_path / "off", "recover")
    assert event["source"] == "none" and _same(final, reference)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_node_losses_in_a_row_are_each_healed_in_place(tmp_path, nodes):
    (ns_a, addr), (ns_b, _) = nodes
    job_args = ("--strategy", "zero", "--no-sync-bn")
    reference = _reference(tmp_path, 2, *job_args)

    def twice(name: str, port: int, *extra: str) -> tuple[dict, Job]:
        again = tmp_path / f"{name}-again"
        job = Job(tmp_path, name, addr, port, [ns_a, ns_b], *job_args, *extra,
                  "--hold-after-step", "15", "--hold-file", str(tmp_path / f"{name}-go"),
                  "--hold-at", "1", "20", str(again))  # fmt: skip
        _lose_node_after_step(job, 15, 1)
        holding = [job.log / f"holding-1-rank{r}" for r in (0, 1)]
        job.wait(lambda: all(p.exists() for p in holding), "both ranks after step 20, again")
        job.replace(1)
        again.touch()
        return job.finish(), job

    final, job = twice("twice", 29455)
    events = _records(tmp_path / "twice", "recover")
    print(f"\nnode b lost after step 15, its new node after step 20: {events}")
    assert [(e["step"], e["source"]) for e in events] == [
        (14, "memory (ranks [1] from rank 0)"), (19, "memory (ranks [1] from rank 0)")
    ]  # fmt: skip
    ran = pids(job.log)
    assert len(set(ran[0].values())) == 1 and len(set(ran[1].values())) == 3, ran
    assert _same(final, reference)
    # Control: with copies off, each loss goes back to the disk (none: the start).
    final, _ = twice("off", 29456, "--replicas", "1")
    assert [e["source"] for e in _records(tmp_path / "off", "recover")] == ["none", "none"]
    assert _same(final, reference)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_two_of_three_nodes_lost_at_once_are_healed_from_three_copies(tmp_path, nodes):
    """Three nodes of one rank, the third a second agent in node a's namespace; nodes b and c lost
    together after step 15. With three copies the survivor holds both lost ranks' state; with two
    (the control) one lost rank's copies were both on the lost nodes: the disk, named."""
    (ns_a, addr), (ns_b, _) = nodes
    job_args = ("--strategy", "fsdp", "--no-sync-bn", "--global-batch", "24")
    reference = _reference(tmp_path, 3, *job_args)
    hold = ("--hold-after-step", "15", "--hold-file")

    def lose_two(name: str, port: int, copies: str) -> tuple[dict, Job]:
        job = Job(tmp_path, name, addr, port, [ns_a, ns_b, ns_a], *job_args, "--replicas",
                  copies, *hold, str(tmp_path / f"{name}-go"))  # fmt: skip
        _lose_node_after_step(job, 15, 1, 2)
        return job.finish(), job

    final, job = lose_two("three", 29457, "3")
    (event,) = _records(tmp_path / "three", "recover")
    print(f"\nnodes b and c lost after step 15, three copies: {event}")
    survivor = next(r for r, by in pids(job.log).items() if len(set(by.values())) == 1)
    lost = sorted({0, 1, 2} - {survivor})
    assert event["replaced"] == lost and event["step"] == 14
    assert event["source"] == f"memory (ranks {lost} from rank {survivor})"
    assert _same(final, reference)
    # Control: two copies cover one lost node, not two.
    final, job = lose_two("two", 29458, "2")
    (event,) = _records(tmp_path / "two", "recover")
    assert event["source"] == "none" and _same(final, reference)
    assert "more nodes lost at once than replicas=2 covers" in job.output(0)


def _lose_b_for_good(
    tmp: Path,
    nodes: list,
    name: str,
    port: int,
    strategy: str,
    *extra: str,
    written: int | None = None,
) -> tuple[dict, Job]:
    """Three nodes of one rank (the third a second agent in node a's namespace), ``--nnodes 2:3``;
    node b lost after step 15 and no new node: the job goes on at two ranks. Its final state, and
    the job."""
    (ns_a, addr), (ns_b, _) = nodes
    job_args = ("--strategy", strategy, "--no-sync-bn", "--global-batch", "24")
    # past torch's keep-alive (15 s), the lost node is out of the rendezvous the survivors form
    launch = ("--nnodes", "2:3", "--join-timeout", "20", "--rdzv-conf", "last_call_timeout=2")
    job = Job(tmp, name, addr, port, [ns_a, ns_b, ns_a], *job_args, *extra, "--hold-after-step",
              "15", "--hold-file", str(tmp / f"{name}-go"), launch=launch)  # fmt: skip
    _lose_node_after_step(job, 15, 1, new=False, written=written)
    return job.finish(), job


def _resumed_on_two(run_dir: Path) -> list[dict]:
    return [r for r in _records(run_dir, "resume") if r["world_size"] == 2]


DISK_14 = ("--replicas", "1", "--disk-every-steps", "14")
"""Copies off, a disk snapshot of step 14 (the loss waits for it to be whole: written=14)."""


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("strategy, port", [("ddp", 29459), ("fsdp", 29463)])
def test_a_node_lost_with_none_to_replace_it_goes_on_smaller_from_memory_as_from_disk(
    tmp_path, nodes, strategy, port
):
    """Node b of three lost after step 15 and no new node (:func:`_lose_b_for_good`). Past
    ``--join-timeout`` the job restarts on the two left and resumes from the copies in memory taken
    on three ranks (under ``ddp`` node b's rank's own part from node c's copy of it; under ``fsdp``
    its shards, resharded with the others over two ranks), as from a disk snapshot of that step:
    bitwise. The control, copies off, goes back to that disk snapshot."""
    final, job = _lose_b_for_good(tmp_path, nodes, "smaller", port, strategy)
    (resumed,) = _resumed_on_two(tmp_path / "smaller")
    print(f"\nnode b of 3 lost after step 15, none to replace it: {resumed}")
    assert resumed["file"] == "memory (taken on 3 ranks)" and resumed["step"] == 14
    assert "resuming a 3-rank snapshot on 2 ranks" in job.output(0)
    # Control and reference: copies off, a disk snapshot of step 14; the same loss resumes there.
    reference, job = _lose_b_for_good(
        tmp_path, nodes, "disk", port + 1, strategy, *DISK_14, written=14
    )
    (resumed,) = _resumed_on_two(tmp_path / "disk")
    assert resumed["file"].startswith("step-") and resumed["step"] == 14, resumed
    assert _same(final, reference)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.torch_at_least(2, 7, "its fsdp job on the CPU")
def test_a_rank_stopped_in_the_reshards_exchange_is_killed_and_the_same_step_resharded(
    tmp_path, nodes
):
    """Node b of three lost under ``fsdp`` with none to replace it, and rank 1 of the two left
    stopped (SIGSTOP) once it has posted its first piece of the reshard: its stop is named, it is
    killed, and the copies taken on three ranks are resharded again, to the bits of a disk snapshot
    of the same step resumed on two."""
    final, job = _lose_b_for_good(
        tmp_path, nodes, "stopped", 29465, "fsdp", "--stop-in-exchange", "1"
    )
    assert (tmp_path / "stopped-log" / "stopped-in-exchange-rank1").exists()
    output = job.output(0)
    assert "stopped (SIGSTOP)" in output, output[-5000:]
    resumed = _resumed_on_two(tmp_path / "stopped")
    print(f"\nrank 1 stopped in the reshard's exchange: {resumed}")
    assert resumed and all(r["file"] == "memory (taken on 3 ranks)" for r in resumed), resumed
    assert resumed[-1]["step"] == 14
    reference, _ = _lose_b_for_good(tmp_path, nodes, "disk", 29466, "fsdp", *DISK_14, written=14)
    assert _same(final, reference)
