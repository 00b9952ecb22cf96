"""The stall watch across nodes, for real: two network-namespace nodes of one rank each
(``scripts/netns_nodes.sh``).

Rank 1 stalls after step 5 (``tests/jobs/scripts/stall_job.py``: it sleeps in user code, stops
itself, waits for its loader's worker, or sleeps in a Trainer's callback) while rank 0, on the other
node, waits for it in a collective. Neither node alone sees a rank waiting
for another: the agents judge with each other's summaries in the rendezvous store. Control: the
watch off, where nothing is said and the job ends only at the collective timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.jobs.launch import netns
from tests.jobs.launch.netns import DDPKIT
from tests.jobs.launch.stall_jobs import STALL_JOB

pytestmark = pytest.mark.slow

FLOOR = "3"
COLLECTIVE_TIMEOUT = 10.0  # the control's: with the watch off the job ends only then
ENDED_WITHIN = 20.0  # a job with the watch on (and a 60 s collective timeout) ends within this


@pytest.fixture(scope="module")
def nodes():
    """[(namespace, address), (namespace, address)]: node a (hosts the rendezvous), then node b."""
    with netns.two_nodes(f"sn{os.getpid() % 100000}") as pair:
        yield pair


@dataclass
class Node:
    ns: str
    addr: str
    code: int | None
    lines: list[tuple[float, str]]
    """Each line of its output with the wall time it came out."""

    @property
    def text(self) -> str:
        return "".join(line for _, line in self.lines)

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if re.search(pattern, line)), None)


def _run(
    nodes,
    cwd: Path,
    port: int,
    flags: list[str],
    mode: str = "sleep",
    job_args: tuple[str, ...] = (),
    timeout: float = 240,
) -> tuple[Node, Node, float]:
    """The stall job in ``mode`` on both nodes; (the node of rank 1, the other, when rank 1
    stalled)."""
    env = netns.node_env()
    (_, addr_a), _ = nodes
    argv = [
        *DDPKIT,
        "run",
        "--nnodes",
        "2",
        "--nproc",
        "1",
        "--rdzv-endpoint",
        f"{addr_a}:{port}",
        *flags,
    ]
    procs, outputs, readers = [], [], []
    for ns, _ in nodes:
        folder = cwd / ns
        folder.mkdir(parents=True)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv, STALL_JOB, mode, *job_args],
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        lines: list[tuple[float, str]] = []

        def read(proc: subprocess.Popen = proc, lines: list = lines) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.append((time.time(), line))

        reader = threading.Thread(target=read)
        reader.start()
        procs.append(proc)
        outputs.append(lines)
        readers.append(reader)
    codes = netns.finish(procs, timeout)
    for reader in readers:
        reader.join(timeout=10)
    ran = [
        Node(ns, addr, code, lines)
        for (ns, addr), code, lines in zip(nodes, codes, outputs, strict=True)
    ]
    stalls = [n for n in ran if n.first(rf"rank 1 stalls \({mode}\)")]
    assert len(stalls) == 1, [n.text[-3000:] for n in ran]
    found = stalls[0].first(rf"rank 1 stalls \({mode}\) after step \d+ at ([0-9.]+)")
    assert found is not None
    stalled_at = float(re.search(r" at ([0-9.]+)", found[1])[1])  # type: ignore[index]
    other = next(n for n in ran if n is not stalls[0])
    return stalls[0], other, stalled_at


# mode, rank 1's state and what it was doing (as its agent names them: the step, a pattern, and
# the phase), where rank 0 is (a pattern), the rendezvous port
STALLS = [
    ("sleep", "sleeping", "at step 5, in its loop", "at step 6", 29410),
    ("stop", "stopped (SIGSTOP)", "at step 5, in its loop", "at step 6", 29412),
    # its loader's worker sleeps reading a sample of step 6, fetched ahead of the step
    ("loader", "sleeping", "at step \\d+, loading data", "at step \\d+", 29413),
    # a Trainer's step-end callback sleeps; rank 0 goes on into step 5's agreement and snapshot
    (
        "trainer-sleep",
        "sleeping",
        "at step 5, user code between steps",
        "at step 5, in collective \\w+",
        29414,
    ),
]


@pytest.mark.parametrize(
    ("mode", "state", "doing", "rank0", "port"), STALLS, ids=[s[0] for s in STALLS]
)
def test_a_rank_stalled_on_one_node_is_named_by_its_node_and_awaited_by_the_other(
    nodes, tmp_path, mode, state, doing, rank0, port
):
    """Rank 1 sleeps in user code between steps, stops itself with SIGSTOP (its agent alone can
    tell), waits for its loader's worker, or sleeps in a Trainer's callback."""
    # The Trainer's snapshots go to one folder both nodes reach, as a shared file system would be.
    job_args = ("5", "300", "12", str(tmp_path / "run")) if mode.startswith("trainer") else ()
    b, a, stalled_at = _run(
        nodes,
        tmp_path / "on",
        port,
        ["--stall-timeout", FLOOR, "--collective-timeout", "60"],
        mode,
        job_args,
    )
    named = b.first(r"ddpkit run: rank 1 stalled:")
    assert named is not None, b.text[-5000:]
    headline = named[1]
    assert re.search(rf"\({re.escape(b.addr)}\), {re.escape(state)}, {doing}", headline), headline
    assert re.search(rf"rank 0 on host .*\({re.escape(a.addr)}\) {rank0}", headline), headline
    # The floor (3 s), the polls and the exchange through the store (0.5 s each), the stacks (at
    # most 3 s), on a machine shared by many: far below the collective timeout.
    to_named = named[0] - stalled_at
    assert to_named < 3 + 9, (to_named, b.text[-5000:])
    print(f"\n{mode}: rank 1 named by its node {to_named:.1f} s after it stalled")
    if mode == "trainer-sleep":
        # the collective rank 0 waits in, read from the other node's record in the store
        assert re.search(
            rf"collective \w+ #\d+: rank\(s\) 0 \(host .*\({re.escape(a.addr)}\)\) "
            r"wait in it; rank 1 has not arrived",
            b.text,
        ), b.text[-5000:]

    waits = a.first(r"ddpkit run: waiting for rank 1 on host")
    assert waits is not None, a.text[-5000:]
    assert f"({b.addr}): no progress for" in waits[1], waits[1]
    assert re.search(rf"{re.escape(state)}, {doing}", waits[1]), waits[1]
    assert "its node's agent names it" in a.text

    assert b.code not in (0, None) and a.code not in (0, None), (b.text[-3000:], a.text[-3000:])
    summary = b.text[b.text.rindex("worker(s) failed") :]
    assert "first: rank 1" in summary and "stalled, ended by the stall watch" in summary, summary
    ended = max(t for n in (a, b) for t, _ in n.lines[-1:])
    assert ended - stalled_at < ENDED_WITHIN, (ended - stalled_at, a.text[-3000:])


def test_control_with_the_watch_off_nothing_is_named_until_the_collective_timeout(nodes, tmp_path):
    flags = ["--stall-timeout", "0", "--collective-timeout", str(COLLECTIVE_TIMEOUT)]
    b, a, stalled_at = _run(nodes, tmp_path / "off", 29411, flags)
    for node in (a, b):
        assert "stalled:" not in node.text and "waiting for rank" not in node.text, node.text[
            -3000:
        ]
        assert node.code not in (0, None), node.text[-3000:]
    first_failure = min(t for n in (a, b) for t, line in n.lines if "worker(s) failed" in line)
    assert first_failure - stalled_at >= COLLECTIVE_TIMEOUT - 1, (
        first_failure - stalled_at,
        a.text[-3000:],
    )


@pytest.mark.parametrize(
    ("mode", "port"), [("same-sleep", 29415), ("slow", 29416)], ids=["same-work", "slow"]
)
def test_across_nodes_work_every_rank_does_and_a_slow_rank_end_well(nodes, tmp_path, mode, port):
    """Across two nodes: every rank sleeps 8 s after step 3, rank 1 1.5 s longer (nobody waits past
    the floor: nothing is said); rank 1 computes 8 s while rank 0 waits (named slow by its node, not
    ended). Both jobs end with 0 on both nodes. Control: a rank asleep alone as long
    (`test_a_rank_stalled_on_one_node_is_named...[sleep]`) is ended."""
    b, a, _ = _run(
        nodes, tmp_path / "on", port, ["--stall-timeout", FLOOR, "--collective-timeout", "60"],
        mode, ("3", "8"),
    )  # fmt: skip
    assert b.code == 0 and a.code == 0, (b.text[-3000:], a.text[-3000:])
    for node in (a, b):
        assert "stalled:" not in node.text and "killed (SIGKILL)" not in node.text, node.text[
            -3000:
        ]
    if mode == "slow":
        said = b.first(r"ddpkit run: rank 1 slow:")
        assert said is not None and "it runs" in said[1], b.text[-3000:]
    else:
        assert "slow:" not in a.text + b.text, (a.text[-3000:], b.text[-3000:])


def test_ranks_in_different_torch_collectives_across_nodes_are_named(nodes, tmp_path):
    """Rank 0 (node a) alone calls ``torch.distributed.broadcast`` after step 3 while rank 1 (node
    b) goes on into the next step's all-reduce: node a's agent names the disagreement from node b's
    summary and ends the job within the allowance. Control: the watch off
    (`test_control_with_the_watch_off...`) waits out the collective timeout."""
    b, a, stalled_at = _run(
        nodes, tmp_path / "on", 29417, ["--stall-timeout", FLOOR, "--collective-timeout", "60"],
        "desync", ("3",),
    )  # fmt: skip
    said = a.first(r"ddpkit run: ranks disagree")
    assert said is not None, a.text[-5000:]
    assert "rank 0 (host" in said[1] and "in broadcast #" in said[1], said[1]
    assert "rank 1 (host" in said[1] and "blocked at step 4" in said[1], said[1]
    assert a.code not in (0, None) and b.code not in (0, None)
    ended = max(t for n in (a, b) for t, _ in n.lines[-1:])
    assert ended - stalled_at < ENDED_WITHIN, (ended - stalled_at, a.text[-3000:])
