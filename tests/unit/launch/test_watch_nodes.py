"""The stall watch across nodes: the decision on hand-made summaries, their encoding, and the
exchange through the nodes' links on a real store (in this process). The jobs across two
network-namespace nodes are in ``tests/jobs/launch/test_stalls_nodes.py``."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from ddpkit._launch.rendezvous.link import NodeLink, read
from ddpkit._launch.watch import stall as watch
from ddpkit._launch.watch import verdict as watch_nodes
from ddpkit._launch.watch.verdict import View, decide, decode, encode
from ddpkit.distributed._progress import MAGIC, RECORD, Phase
from ddpkit.testing import wait_until


def view(rank: int, node: int, *, step: int, idle: float, phase: int = Phase.LOOP, coll: int = 0,
         allowance: float = 3.0, state: str = "S") -> View:  # fmt: skip
    return View(
        rank,
        node,
        f"host{node}",
        0,
        100 + rank,
        step,
        coll,
        phase,
        "all_reduce",
        idle,
        allowance,
        state,
    )


# One rank per node: rank 1 (node 1) sleeps after step 5, rank 0 (node 0) waits for it in step 6.
STALLED = view(1, 1, step=5, idle=4.0)
WAITING = view(0, 0, step=6, idle=4.0)


def test_the_stalled_ranks_node_names_it_and_the_waiting_node_names_whom_it_waits_for():
    job = [WAITING, STALLED]
    on_b, on_a = decide(1, job), decide(0, job)
    assert on_b.stalled == [STALLED] and on_b.waited_for == []
    assert on_a.stalled == [] and on_a.waited_for == [STALLED]
    # Control: each node judging its own ranks alone (the watch before it read the other nodes'
    # summaries) names nobody on either node.
    assert decide(1, [STALLED]) == watch_nodes.Judged()
    assert decide(0, [WAITING]) == watch_nodes.Judged()


def test_no_verdict_within_the_allowance_nor_when_all_are_at_one_place():
    assert decide(1, [WAITING, view(1, 1, step=5, idle=2.9)]).stalled == []
    # a long evaluation everywhere
    same = [view(0, 0, step=5, idle=100.0), view(1, 1, step=5, idle=100.0)]
    assert decide(0, same) == decide(1, same) == watch_nodes.Judged()
    unmarked = [WAITING, view(1, 1, step=-1, idle=100.0)]  # a rank not yet at its first mark
    assert decide(0, unmarked) == watch_nodes.Judged()


def test_a_rank_nobody_waits_for_is_not_stalled():
    # rank 0 goes on (it marked 0.5 s ago): nobody waits for rank 1 yet
    busy = view(0, 0, step=6, idle=0.5)
    assert decide(0, [busy, STALLED]).waited_for == []
    assert decide(1, [busy, STALLED]).stalled == []
    # control: once rank 0 has waited past rank 1's allowance, rank 1 is named
    assert decide(1, [WAITING, STALLED]).stalled == [STALLED]


def test_behind_in_collectives_across_nodes():
    # rank 0 waits in all_reduce #12 on node 0; rank 1 on node 1 has entered 11 at the same step.
    job = [
        view(0, 0, step=5, coll=12, phase=Phase.COLLECTIVE, idle=5.0),
        view(1, 1, step=5, coll=11, idle=5.0),
    ]
    assert [v.rank for v in decide(1, job).stalled] == [1]
    assert [v.rank for v in decide(0, job).waited_for] == [1]


def test_a_summary_is_small_and_reads_back():
    views = [view(r, 2, step=7, idle=1.234, phase=Phase.COLLECTIVE, coll=40) for r in range(8)]
    data = encode(2, "node-b (10.0.0.2)", 17, {3}, views)
    assert len(data) < 700, len(data)  # eight ranks
    summary = decode(data)
    assert (
        summary is not None and summary.node == 2 and summary.count == 17 and summary.named == {3}
    )
    back = summary.views[0]
    got = (back.rank, back.host, back.step, back.coll, back.op, back.idle)
    assert got == (0, "node-b (10.0.0.2)", 7, 40, "all_reduce", 1.2)
    for bad in (
        b"",
        b"not json",
        b'{"v": 2}',
        b'{"v":1,"n":0,"h":"x","c":1,"x":[],"r":[[1,2]]}',
        b"x" * 70000,
    ):
        assert decode(bad) is None, bad


def test_the_waiting_node_ends_the_job_only_when_the_stalled_ranks_agent_stays_silent(tmp_path):
    waiting = watch.Watch(tmp_path, watch.StallPolicy(floor=3.0), None)
    assert waiting.grace == 10.0
    assert waiting.overdue([STALLED], set(), 100.0) == []
    assert waiting.overdue([STALLED], {1}, 111.0) == []  # its agent named it: left to that agent
    assert waiting.overdue([STALLED], set(), 109.0) == []  # within the grace
    assert waiting.overdue([STALLED], set(), 110.5) == [STALLED]  # silent past the grace
    assert waiting.overdue([], set(), 111.0) == []  # it moved on: the wait starts again
    assert waiting.overdue([STALLED], set(), 112.0) == []


@pytest.fixture
def store():
    server = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    yield dist.PrefixStore("torch.rendezvous.job.1", server)


def _until(condition, timeout: float = 30.0) -> None:
    # the exchange's thread writes and reads on its own turn
    wait_until(condition, timeout, interval=0.02, max_interval=0.02)


def test_two_links_see_each_others_summary_and_a_watch_ages_a_silent_node(store, tmp_path):
    a, b = NodeLink(store, "r", 0, 2), NodeLink(store, "r", 1, 2)
    try:
        a.publish(encode(0, "host0", 1, set(), [WAITING]), want=True)
        b.publish(encode(1, "host1", 1, set(), [STALLED]), want=True)
        _until(lambda: 1 in a.summaries() and 0 in b.summaries())
        w = watch.Watch(tmp_path, watch.StallPolicy(floor=3.0), None)
        w.connect(a, 0, 2)
        assert [v.rank for v in w._views()[0]] == [1]
        # Node 1's agent says nothing new: its rank's idle time grows on node 0's clock.
        first = w._views()[0][0].idle
        _until(lambda: w._views()[0][0].idle > first + 0.2)
        # It names rank 1, then its ranks exit: the summary says so, and node 0 no longer counts
        # them.
        b.publish(encode(1, "host1", 2, {1}, [STALLED]), want=True)
        _until(lambda: w._views()[1] == {1})
        b.close(last=encode(1, "host1", 3, {1}, []))
        _until(lambda: w._views()[0] == [])
    finally:
        a.close()
        b.close()


def test_a_store_that_is_gone_never_reaches_the_watch():
    import subprocess
    import sys

    serve = (
        "import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', 0, is_master=True, "
        "wait_for_workers=False); print(s.port, flush=True); time.sleep(600)"
    )
    host = subprocess.Popen([sys.executable, "-c", serve], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
        link = NodeLink(client, "r", 0, 2)
        link.publish(encode(0, "host0", 1, set(), [WAITING]), want=True)
        _until(lambda: read(client, "ddpkit/nodes/r/beat/0") is not None)  # it beat
        host.kill()  # the store's host is gone
        host.wait()

        def gone() -> bool:
            try:
                read(link.store, "ddpkit/nodes/r/beat/1")
            except Exception:  # noqa: BLE001  (torch's or the bound's)
                return True
            return False

        _until(gone)
        assert link.summaries() == {}
        link.close()  # returns: every operation of its threads is bounded
    finally:
        host.kill()
        host.wait()


def _record(folder: Path, rank: int, step: int, seq: int) -> None:
    folder.mkdir(exist_ok=True)
    data = RECORD.pack(MAGIC, 100 + rank, 1, Phase.LOOP, seq, step, step, 0, -1, -1, 0.0, 0.1, 0.0)
    (folder / f"rank{rank}.progress").write_bytes(data)


def _still(pid: int) -> tuple[int, int]:
    """A rank's activity that never moves: its record alone tells."""
    return 0, 0


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_two_nodes_watches_name_the_rank_and_the_wait(store, tmp_path, capsys):
    """Two agents' watches of one rank each, through one store: node 1's names rank 1 with node 0's
    rank in its summary; node 0's says it waits for rank 1 on host1. Control: the same watches not
    connected (each node judging alone, as before) say nothing."""
    clock = Clock()
    policy = watch.StallPolicy(floor=3.0, on_stall="warn")
    watches = []
    for node in (0, 1):
        w = watch.Watch(tmp_path / f"n{node}", policy, None, clock=clock, activity=_still)
        w.start_attempt({node: (0, 100 + node)})
        w.host = f"host{node}"
        watches.append(w)
    _record(tmp_path / "n0", 0, step=6, seq=30)
    _record(tmp_path / "n1", 1, step=5, seq=25)

    def poll_all(t: float) -> list:
        clock.now = t
        out = []
        for n, w in enumerate(watches):
            w._next_poll = 0.0
            out.append(w.poll({n}))
        return out

    poll_all(1000.0)
    assert poll_all(1004.0) == [None, None]  # control: not connected
    assert "stalled" not in capsys.readouterr().err

    links = [NodeLink(store, "r", n, 2) for n in (0, 1)]
    for n, w in enumerate(watches):
        w.connect(links[n], n, 2)
    try:
        _until(lambda: bool(poll_all(1005.0)) and all(w._warned for w in watches))
        err = capsys.readouterr().err
        assert (
            "ddpkit run: rank 1 stalled: no progress for 5.0 s (allowed 3.0 s) on host host1" in err
        ), err
        assert "rank 0 on host host0 at step 6" in err, err
        assert "ddpkit run: waiting for rank 1 on host host1: no progress for" in err, err
        assert "its node's agent names it" in err, err
        # After the job's end, node 0's summary says where rank 1 was, from node 1's word.
        assert "rank 1 on host host1 at step 5" in watches[0].where(), watches[0].where()
    finally:
        for w, link in zip(watches, links):
            w.disconnect()
            link.close()


def test_a_rank_its_agent_named_is_reported_before_this_nodes_ranks_spend_their_allowance():
    # The named rank's agent waits for the other nodes to say where their ranks are before it kills
    # it.
    waiting = view(0, 0, step=6, idle=1.0)
    assert decide(0, [waiting, STALLED], named={1}).waited_for == [STALLED]
    # control: not named, and this node's rank within its allowance
    assert decide(0, [waiting, STALLED]).waited_for == []


class _Heard:
    """A link that read the other nodes' summaries: each says which ranks its own wait for."""

    def __init__(self, heard: dict[int, frozenset[int]]) -> None:
        self.heard = {n: encode(n, "h", 1, set(), [], said) for n, said in heard.items()}

    def summaries(self) -> dict[int, tuple[bytes, float]]:
        return {n: (data, 0.0) for n, data in self.heard.items()}


def test_the_named_ranks_agent_ends_it_once_every_other_node_has_said_where_its_ranks_wait(
    tmp_path,
):
    link = watch.Watch(tmp_path, watch.StallPolicy(), None)
    assert link.heard([1])  # one node: nobody to hear
    link.link = _Heard({0: frozenset(), 2: frozenset({1})})  # type: ignore[assignment]
    assert not link.heard([1])  # node 0 has not said so yet
    link.link = _Heard({0: frozenset({1}), 2: frozenset({1})})  # type: ignore[assignment]
    assert link.heard([1])


@pytest.mark.parametrize("named", [set(), {1}], ids=["silent", "control-named"])
def test_a_waiting_node_ends_its_own_workers_when_the_stalled_ranks_agent_stays_silent(
    store, tmp_path, named
):
    """Node 1's summary (written by hand: its agent says nothing more) shows rank 1 stalled; node
    0's rank (a real process) waits. Past the grace node 0's agent kills its own worker, ending the
    job. Control: node 1's agent named rank 1, so node 0 leaves the ending to it."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        clock = Clock()
        clock.now = 1000.0
        w = watch.Watch(tmp_path, watch.StallPolicy(floor=3.0), None, clock=clock, activity=_still)
        w.start_attempt({0: (0, child.pid)})
        data = RECORD.pack(MAGIC, child.pid, 1, Phase.LOOP, 30, 6, 6, 0, -1, -1, 0.0, 0.1, 0.0)
        (tmp_path / "rank0.progress").write_bytes(data)
        store.set("ddpkit/nodes/r/summary/1", encode(1, "host1", 1, named, [STALLED]))
        link = NodeLink(store, "r", 0, 2)
        w.connect(link, 0, 2)

        def poll(t: float):
            clock.now = t
            w._next_poll = 0.0
            return w.poll({0})

        poll(1000.0)
        _until(lambda: (poll(1004.0), w.said)[1] == {1})  # said once it read node 1's summary
        assert poll(1004.0 + 9.0) is None and child.poll() is None  # within the grace
        stall = poll(1004.0 + 10.5)
        if named:
            assert stall is None and child.poll() is None
        else:
            assert stall is not None and stall.ranks == [0]
            assert "its node's agent has not named it 10 s after" in "\n".join(stall.report)
            assert child.wait(timeout=30) == -9
    finally:
        w.disconnect()
        link.close()
        child.kill()
        child.wait()


def test_two_nodes_stalled_at_one_place_are_each_named_by_their_own_node():
    job = [WAITING, STALLED, view(2, 2, step=5, idle=4.0)]
    assert [v.rank for v in decide(1, job).stalled] == [1] and [
        v.rank for v in decide(2, job).stalled
    ] == [2]
    assert [v.rank for v in decide(0, job).waited_for] == [1, 2]
    # node 1 names its own rank, and says nothing of rank 2 until node 2's agent names it
    assert decide(1, job).waited_for == [] and [
        v.rank for v in decide(1, job, named={2}).waited_for
    ] == [2]


def _in(rank: int, node: int, op: str, *, coll: int = 2, idle: float = 4.0) -> View:
    """Rank ``rank`` of node ``node`` waiting in collective ``op`` #``coll`` at step 5."""
    v = view(rank, node, step=5, idle=idle, phase=Phase.COLLECTIVE, coll=coll)
    return View(**{**v.__dict__, "op": op})


def test_ranks_in_one_collective_under_different_ops_are_named_at_once():
    # A Trainer: rank 1 calls an extra barrier in a step-end callback while rank 0 enters the log
    # window's all_gather; both records say collective #2, at step 5.
    job = [_in(0, 0, "all_gather"), _in(1, 0, "barrier")]
    verdict = decide(0, job)
    assert [v.rank for v in verdict.stalled] == [1], verdict
    assert [(v.rank, v.op) for v in verdict.disagree] == [(0, "all_gather"), (1, "barrier")]
    assert watch_nodes.disagreement_words(verdict.disagree) == (
        "ranks disagree on collective #2: rank 0 in all_gather, rank 1 in barrier: a collective "
        "called on some ranks only, or in another order (each rank's stack shows where it called "
        "its own)"
    )
    # Control: every rank in the same op (a collective the network holds up) is left to the
    # collective timeout, as before.
    same = [_in(0, 0, "all_gather"), _in(1, 0, "all_gather")]
    assert decide(0, same) == watch_nodes.Judged()
    # Within the allowance (rank 1 has just entered): nothing yet.
    assert decide(0, [_in(0, 0, "all_gather"), _in(1, 0, "barrier", idle=2.0)]).stalled == []


def test_of_ranks_that_disagree_those_off_the_common_op_are_named():
    # rank 0 alone calls a barrier (`if rank == 0: ddpkit.barrier()`), the other three the step's
    # all_reduce
    job = [_in(0, 0, "barrier")] + [_in(r, 0, "all_reduce") for r in (1, 2, 3)]
    assert [v.rank for v in decide(0, job).stalled] == [0]
    words = watch_nodes.disagreement_words(watch_nodes.disagreement(job))
    assert "#2: rank 0 in barrier, ranks 1, 2, 3 in all_reduce:" in words, words
    # one that waits in collective #1 while the others wait in #2: every rank waits in another
    # one, none the most common; those off the lowest rank's are named
    behind = [_in(0, 0, "all_gather"), _in(1, 0, "barrier"), _in(2, 0, "all_gather", coll=1)]
    assert [v.rank for v in decide(0, behind).stalled] == [1, 2]


def test_ranks_that_disagree_across_nodes_are_named_by_their_node_and_waited_for_by_the_other():
    job = [_in(0, 0, "all_gather"), _in(1, 1, "barrier")]
    on_a, on_b = decide(0, job), decide(1, job)
    assert [v.rank for v in on_b.stalled] == [1] and on_b.waited_for == []
    assert on_a.stalled == [] and [v.rank for v in on_a.waited_for] == [1]
    assert [v.rank for v in on_a.disagree] == [v.rank for v in on_b.disagree] == [0, 1]
    words = watch_nodes.disagreement_words(on_a.disagree, hosts=True)
    assert "rank 0 (host host0) in all_gather, rank 1 (host host1) in barrier" in words, words
    # Control: the same op on both nodes, all idle: neither node names nor waits.
    same = [_in(0, 0, "all_gather"), _in(1, 1, "all_gather")]
    assert decide(0, same) == decide(1, same) == watch_nodes.Judged()


# -- verdicts from evidence: who waits, and whether the rank waited for can progress ---------------


def _w(rank: int, *, step: int, idle: float, quiet: float = -1.0, phase: int = Phase.LOOP,
       coll: int = 0, op: str = "all_reduce", numel: int = -1,
       state: str = "S") -> View:  # fmt: skip
    v = view(rank, 0, step=step, idle=idle, phase=phase, coll=coll, state=state)
    return View(**{**v.__dict__, "op": op, "quiet": quiet, "numel": numel})


def test_a_rank_the_others_wait_for_that_runs_is_slow_and_one_that_does_not_is_stalled():
    waiting = _w(0, step=6, idle=10.0, phase=Phase.COLLECTIVE, coll=9)
    runs = _w(1, step=5, idle=10.0, quiet=0.3, coll=8)  # no mark for 10 s, its CPU moves
    verdict = decide(0, [waiting, runs])
    assert verdict.stalled == [] and verdict.slow == [runs] and verdict.waited == 10.0
    # control: the same rank with nothing moving for 10 s
    still = _w(1, step=5, idle=10.0, quiet=10.0, coll=8)
    assert decide(0, [waiting, still]).stalled == [still]


def test_work_every_rank_does_finished_a_few_seconds_apart_is_no_stall():
    # rank 1 is still in a 35 s pause every rank took; rank 0 finished it 2 s ago and waits
    finished = _w(0, step=5, idle=2.0, phase=Phase.COLLECTIVE, coll=9)
    pausing = _w(1, step=5, idle=35.0, quiet=35.0, phase=Phase.USER, coll=8)
    assert decide(0, [finished, pausing]) == watch_nodes.Judged(waited=2.0)
    # control: rank 0 waiting past rank 1's allowance: rank 1 is named
    assert decide(0, [_w(0, step=5, idle=3.5, phase=Phase.COLLECTIVE, coll=9), pausing]).stalled


def test_a_rank_ahead_that_runs_waits_for_nobody():
    ahead = _w(0, step=7, idle=30.0, quiet=0.2)  # no mark, but it computes (a long hand validation)
    behind = _w(1, step=5, idle=30.0, quiet=30.0)
    assert decide(0, [ahead, behind]).stalled == []


def test_a_stopped_rank_is_stalled_at_once_whatever_its_allowance():
    stopped = _w(1, step=5, idle=0.5, state="T")
    assert decide(0, [_w(0, step=6, idle=0.5), stopped]).stalled == [stopped]
    # control: the same rank sleeping
    assert decide(0, [_w(0, step=6, idle=0.5), _w(1, step=5, idle=0.5)]).stalled == []


def test_a_collective_against_ddps_all_reduce_disagrees():
    # rank 0 logs with an extra all_reduce (#5); rank 1 went on into DDP's all-reduce of the next
    # step's gradients, after collective #4
    extra = _w(0, step=5, idle=5.0, phase=Phase.COLLECTIVE, coll=5, numel=1)
    ddp = _w(1, step=6, idle=5.0, phase=Phase.GRADIENT_SYNC, coll=4)
    verdict = decide(0, [extra, ddp])
    assert [v.rank for v in verdict.disagree] == [0, 1] and verdict.stalled
    words = watch_nodes.disagreement_words(verdict.disagree)
    assert "rank 0 in all_reduce #5 of 1 elements" in words, words
    assert "rank 1 in DDP's all-reduce of the gradients (after collective #4)" in words, words


def test_one_op_of_different_sizes_disagrees_and_of_one_size_is_left_to_the_timeout():
    job = [
        _w(0, step=5, idle=5.0, phase=Phase.COLLECTIVE, coll=3, numel=3),
        _w(1, step=5, idle=5.0, phase=Phase.COLLECTIVE, coll=3, numel=2),
    ]
    assert [v.rank for v in decide(0, job).disagree] == [0, 1]
    same = [job[0], _w(1, step=5, idle=5.0, phase=Phase.COLLECTIVE, coll=3, numel=3)]
    assert decide(0, same) == watch_nodes.Judged()


def test_the_rank_behind_in_a_collective_the_others_went_past_while_they_block_disagrees():
    # rank 0 alone broadcasts (#4); rank 1, a step ahead, blocks in a DDP built by hand
    # (unmarked)
    alone = _w(0, step=3, idle=5.0, phase=Phase.COLLECTIVE, coll=4, op="broadcast", numel=3)
    blocked = _w(1, step=4, idle=5.0, quiet=5.0, coll=3)
    verdict = decide(0, [alone, blocked])
    assert [v.rank for v in verdict.stalled] == [0] and len(verdict.disagree) == 2
    words = watch_nodes.disagreement_words(verdict.disagree)
    assert "rank 0 in broadcast #4 of 3 elements, rank 1 blocked at step 4" in words, words
    # control: the rank behind is outside any collective (asleep in user code) while the other
    # waits in one: a stall of the rank behind, not a disagreement
    sleeping = _w(0, step=3, idle=5.0, quiet=5.0, phase=Phase.USER, coll=3)
    waits = _w(1, step=4, idle=5.0, phase=Phase.COLLECTIVE, coll=4)
    verdict = decide(0, [sleeping, waits])
    assert verdict.disagree == [] and verdict.stalled == [sleeping]


def _p2p(rank: int, op: str, peer: int, idle: float = 4.0) -> View:
    """Rank ``rank`` blocked in point-to-point ``op`` with ``peer`` at step 5."""
    v = view(rank, 0, step=5, idle=idle, phase=Phase.POINT_TO_POINT, coll=2)
    return View(**{**v.__dict__, "op": op, "peer": peer})


def test_ranks_that_wait_for_each_other_through_a_point_to_point_call_are_a_deadlock():
    both = [_p2p(0, "recv", 1), _p2p(1, "recv", 0)]
    verdict = decide(0, both)
    assert [v.rank for v in verdict.stalled] == [0, 1] == [v.rank for v in verdict.disagree]
    assert watch_nodes.deadlock_words(verdict.disagree).startswith(
        "ranks 0, 1 wait for each other: rank 0 in recv from rank 1, rank 1 in recv from rank 0: "
        "a deadlock"
    )
    # a recv from a rank that waits in a collective the receiver never enters
    mixed = [_p2p(0, "recv", 1), _in(1, 0, "all_reduce")]
    assert [v.rank for v in watch_nodes.deadlock(mixed)] == [0, 1]
    # Controls: a recv whose peer computes (not blocked) waits for it, no deadlock; a recv from
    # a rank idle in its own code names that rank, behind; nor within the allowance.
    busy = view(1, 0, step=5, idle=4.0)
    busy = View(**{**busy.__dict__, "quiet": 0.5})
    assert watch_nodes.deadlock([_p2p(0, "recv", 1), busy]) == []
    idle = view(1, 0, step=5, idle=4.0)
    assert watch_nodes.deadlock([_p2p(0, "recv", 1), idle]) == []
    assert [v.rank for v in decide(0, [_p2p(0, "recv", 1), idle]).stalled] == [1]
    assert watch_nodes.deadlock([_p2p(0, "recv", 1, 1.0), _p2p(1, "recv", 0, 1.0)]) == []


def test_a_rank_marked_past_ddps_all_reduce_is_not_in_a_collective():
    # in DDP's wait at its backward's end: in a collective; past it, in its loop: not
    in_sync = view(0, 0, step=5, idle=4.0, phase=Phase.GRADIENT_SYNC)
    past = view(0, 0, step=5, idle=4.0, phase=Phase.LOOP)
    assert in_sync.in_collective and not past.in_collective
    barrier = _in(1, 0, "barrier", coll=3)
    assert watch_nodes.disagreement([past, barrier]) == []
    assert [v.rank for v in decide(0, [past, barrier]).stalled] == [0]
