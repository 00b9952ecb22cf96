"""In-place recovery's parts: cutting a worker's collective links with real gloo processes (and the
control: gloo's own abort leaves the wait), and the agent's decisions on a fake worker group (pure
logic: which ranks are replaced, when it waits, when it gives the failure back and why)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ddpkit._errors import PREEMPTED_EXIT_CODE, ConfigError
from ddpkit._launch.recover import inplace as recover
from ddpkit.testing import run_on_ranks


def _pending_all_reduce(cut: bool) -> str:
    """Rank 0 starts an all-reduce on a new group that rank 1 never joins; rank 1 cuts its links to
    the group (``cut``), or aborts it as gloo offers, or destroys it (the control, which cuts them
    after rank 0 has looked). How rank 0's all-reduce stood once rank 1 had done so."""
    dist.barrier()  # the default group's links made (gloo may make them at first use): not cut
    recover.note_links()
    group = dist.new_group(backend="gloo")
    dist.barrier()  # both ranks have made the group: a cut while rank 0 still makes it fails that
    # the store's connections are not cut here (the test's end waits on the store)
    os.environ["MASTER_PORT"] = "1"
    if dist.get_rank() == 1:
        if cut:
            recover.sever()
        else:  # gloo's abort, where it has one (torch 2.7 on); before, the group destroyed
            backend = group._get_backend(torch.device("cpu"))
            if hasattr(backend, "abort"):
                backend.abort()
            else:
                dist.destroy_process_group(group)
        dist.barrier()  # done: rank 0 looks
        if not cut:
            dist.barrier()  # rank 0 has looked
            recover.sever()
        return ""
    work = dist.all_reduce(torch.ones(4), group=group, async_op=True)
    dist.barrier()
    looked = "pending" if not work.is_completed() else "completed"
    if not cut:
        dist.barrier()
    try:
        work.wait()
    except RuntimeError:
        return f"{looked}, then raised" if not cut else "raised"
    return "completed"


def test_cutting_a_ranks_links_ends_its_peers_pending_gloo_collective_and_abort_does_not():
    assert run_on_ranks(_pending_all_reduce, 2, (True,))[0] == "raised"
    # Control: after gloo's abort on rank 1, rank 0 still waits; rank 1's cut ends it.
    assert run_on_ranks(_pending_all_reduce, 2, (False,))[0] == "pending, then raised"


class FakeAgent:
    """The agent as :class:`~ddpkit._launch.recover.inplace.InPlace` sees it: each rank's exit
    code."""

    def __init__(self, codes: dict[int, int | None], restarts: int = 2) -> None:
        self.codes, self.restarts, self.max, self.replaced = codes, restarts, restarts, []
        self.stall = None
        self.stopped: list[list[int]] = []

    def worker_processes(self):
        return {r: SimpleNamespace(poll=lambda r=r: self.codes[r]) for r in self.codes}

    def restarts_left(self) -> int:
        return self.restarts

    def use_restart(self) -> None:
        self.restarts -= 1

    def restarts_used(self) -> int:
        return self.max - self.restarts

    def replace_worker(self, worker, env) -> None:
        self.replaced.append((worker.global_rank, env["TORCHELASTIC_RESTART_COUNT"]))
        self.codes[worker.global_rank] = None

    def stop_late(self, ranks, group, waited) -> None:
        self.stopped.append(ranks)

    def recovered(self) -> None:
        pass

    def stop_restarting(self) -> None:
        self.restarts = 0

    def process_context(self):
        return SimpleNamespace(envs={0: {"MASTER_ADDR": "127.0.0.1"}})


def group(n: int) -> SimpleNamespace:
    return SimpleNamespace(workers=[SimpleNamespace(global_rank=r, local_rank=r) for r in range(n)])


def wait(folder: Path, rank: int, generation: int = 1) -> None:
    record = {"rank": rank, "pid": 1, "error": "x", "left": 1.0, "torn_down": 2.0}
    (folder / f"wait-{generation}.{rank}").write_text(json.dumps(record))


def test_the_agent_replaces_the_exited_rank_once_every_other_rank_waits(tmp_path, capsys):
    agent, place = FakeAgent({0: None, 1: -9, 2: None}), recover.InPlace(tmp_path)
    assert place.poll(agent, group(3))  # rank 1 killed: torchrun must not look
    assert (tmp_path / "incident").read_text() == "1" and agent.replaced == []
    wait(tmp_path, 0)
    assert place.poll(agent, group(3)) and agent.replaced == []  # rank 2 has not left yet
    wait(tmp_path, 2)
    assert place.poll(agent, group(3))
    go = json.loads((tmp_path / "go-1").read_text())
    assert go["replaced"] == [1] and go["restart_count"] == 1 and agent.replaced == [(1, "1")]
    assert not (tmp_path / "incident").exists() and agent.restarts == 1
    assert "replaced rank 1 (killed by SIGKILL); rank(s) 0, 2 go on" in capsys.readouterr().err
    assert not place.poll(agent, group(3))  # all running again: torchrun looks


@pytest.mark.parametrize(
    ("codes", "restarts", "why"),
    [
        ({0: None, 1: -9, 2: PREEMPTED_EXIT_CODE}, 2, "a rank was pre-empted"),
        ({0: None, 1: -9, 2: 0}, 2, "a rank had already finished"),
        ({0: None, 1: -9, 2: None}, 0, "no restart left"),
    ],
)
def test_the_agent_gives_the_failure_back_to_torchrun_saying_why(tmp_path, codes, restarts, why):
    agent, place = FakeAgent(codes, restarts), recover.InPlace(tmp_path)
    assert not place.poll(agent, group(3))
    assert why in place.fallback and (tmp_path / "end-1").read_text() == place.fallback
    assert agent.replaced == [] and place.ended


def test_a_rank_that_does_not_leave_in_time_is_stopped_and_replaced(tmp_path):
    agent, place = FakeAgent({0: None, 1: -9}), recover.InPlace(tmp_path, timeout=0.0)
    assert place.poll(agent, group(2)) and agent.stopped == [[0]]
    agent.codes[0] = -9  # the agent's SIGKILL
    assert place.poll(agent, group(2)) and agent.stopped == [[0]]  # once
    assert json.loads((tmp_path / "go-1").read_text())["replaced"] == [0, 1]
    # Control: with time left, the agent waits for it.
    (tmp_path / "x").mkdir()
    agent, place = FakeAgent({0: None, 1: -9}), recover.InPlace(tmp_path / "x", timeout=60.0)
    assert place.poll(agent, group(2)) and agent.stopped == [] and not place.fallback


def test_in_place_recovery_needs_a_restart_budget_and_covers_several_nodes(tmp_path, monkeypatch):
    from ddpkit._launch.cli.options import LaunchConfig
    from ddpkit._launch.cli.run import in_place_recovery

    monkeypatch.setenv(recover.DIR_ENV, "")  # set by the agent's side: put back after the test

    with pytest.raises(ConfigError, match="--max-restarts N"):
        in_place_recovery(LaunchConfig(script="x.py", recover="in-place"), tmp_path)
    cfg = LaunchConfig(
        script="x.py", recover="in-place", max_restarts=1, nnodes="2",
        rdzv_endpoint="127.0.0.1:29400", join_timeout=7.0,
    )  # fmt: skip
    found = in_place_recovery(cfg, tmp_path)
    assert found is not None and found.join_timeout == 7
    with pytest.raises(ConfigError, match="recover"):
        LaunchConfig(script="x.py", recover="sideways")  # type: ignore[arg-type]


def test_a_failed_runs_folder_locks_are_released_for_the_run_again(tmp_path):
    from ddpkit._fs import lock

    def claim() -> lock.FolderLock:
        held = lock.FolderLock(tmp_path, what="run_dir", job="job", user="run", hazard="h")
        held.acquire()
        return held

    first = claim()  # a Snapshots the failed run left open holds it
    with pytest.raises(ConfigError, match="in use by another job"):  # control: not released
        claim()
    lock.release_all()
    claim().release()
    assert first._fd is None


def _group_never_joined(cut: bool) -> str:
    """Rank 0 makes a new group rank 1 never joins (it waits on the store for rank 1's address);
    another thread of rank 0 cuts its links (``cut``). How rank 0's ``new_group`` ended."""
    import datetime
    import threading

    dist.barrier()
    if dist.get_rank() == 1:
        dist.barrier()
        return ""
    if cut:
        threading.Thread(target=recover.sever, daemon=True).start()  # before or during: the same
    try:
        dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=3))
        ended = "made"
    except Exception as err:  # noqa: BLE001 -- torch's error types vary by version
        ended = "timed out" if "timeout" in str(err).lower() or "timed out" in str(err) else "cut"
    dist.barrier()
    return ended


def test_a_group_being_made_is_let_go_by_the_cut_of_the_stores_connections():
    assert run_on_ranks(_group_never_joined, 2, (True,))[0] == "cut"
    # Control: without the cut it waits on the store until the group's timeout.
    assert run_on_ranks(_group_never_joined, 2, (False,))[0] == "timed out"


def _writer_groups_across_worlds() -> tuple[bool, float]:
    import ddpkit
    from ddpkit.snapshot._disk import writer_group

    first = writer_group(None)
    ddpkit.shutdown()
    ddpkit.init(backend="gloo")
    second = writer_group(None)
    t = torch.ones(1)
    dist.all_reduce(t, group=second)  # the group of the world made again works
    return second is first, float(t)


def test_a_world_made_again_gets_new_writer_groups():
    # A recovery in place (and shutdown() then init()) makes the world again: a writer group cached
    # from the first one would pair this rank with connections that are gone.
    assert run_on_ranks(_writer_groups_across_worlds, 2) == [(False, 2.0), (False, 2.0)]


# Across nodes: two agents' InPlace on one real store, each node's workers faked (pure logic).


class NodeAgent(FakeAgent):
    """One node's agent: ``codes`` by local rank, its workers' global ranks ``ranks``."""

    def __init__(self, ranks: list[int], codes: dict[int, int | None]) -> None:
        super().__init__(codes)
        self.ranks = ranks

    def replace_worker(self, worker, env) -> None:
        self.replaced.append((worker.global_rank, env["TORCHELASTIC_RESTART_COUNT"]))
        self.codes[worker.local_rank] = None


@pytest.fixture
def store():
    from datetime import timedelta

    from ddpkit._internals.store import serve_new_store

    return serve_new_store("127.0.0.1", timedelta(seconds=30))[0]


def node(store, tmp_path: Path, name: str, n: int, ranks: list[int], **kw):
    """(agent, its worker group, its InPlace) of node ``n`` of 2."""
    handler = SimpleNamespace(base=store, addr="127.0.0.1", round_name="ddpkit/round/t")
    workers = [SimpleNamespace(global_rank=r, local_rank=i) for i, r in enumerate(ranks)]
    grp = SimpleNamespace(
        workers=workers, spec=SimpleNamespace(rdzv_handler=handler), group_rank=n,
        group_world_size=2, store=handler,
    )  # fmt: skip
    (tmp_path / name).mkdir()
    agent = NodeAgent(ranks, {i: None for i in range(len(ranks))})
    return agent, grp, recover.InPlace(tmp_path / name, **kw)


def until(condition, what: str) -> None:
    import time

    deadline = time.monotonic() + 60  # a hang guard, not a bound on the time taken
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def settled(*nodes):
    """Polls each (agent, worker group, InPlace) once; True once none recovers any more."""

    def look() -> bool:
        for agent, grp, place in nodes:
            place.poll(agent, grp)
        return all(place.incident is None for _, _, place in nodes)

    return look


def offered(store, agent, grp, place):
    """Polls the deciding agent once; True once it offered a lost node's place."""

    def look() -> bool:
        place.poll(agent, grp)
        return store.check([recover.KEY + "vacant"])

    return look


def test_across_nodes_a_worker_lost_on_one_node_is_recovered_by_both_agents(store, tmp_path):
    agent_a, group_a, a = node(store, tmp_path, "a", 0, [0, 1])
    agent_b, group_b, b = node(store, tmp_path, "b", 1, [2, 3])
    assert not a.poll(agent_a, group_a) and not b.poll(agent_b, group_b)  # healthy
    assert a.running and b.running  # the agent answers "healthy" without torchrun's own look
    agent_b.codes[1] = -9  # rank 3 killed
    assert b.poll(agent_b, group_b)
    # node a's agent hears of it from the store and has its ranks leave
    assert a.poll(agent_a, group_a) and (tmp_path / "a" / "incident").read_text() == "1"
    wait(tmp_path / "a", 0)
    wait(tmp_path / "a", 1)
    wait(tmp_path / "b", 2)

    until(settled((agent_a, group_a, a), (agent_b, group_b, b)), "both agents to go on")
    go_a, go_b = (json.loads((tmp_path / n / "go-1").read_text()) for n in "ab")
    assert go_a == go_b and go_a["replaced"] == [3] and go_a["lost_nodes"] == []
    assert agent_b.replaced == [(3, "1")] and agent_a.replaced == []
    assert agent_a.restarts == agent_b.restarts == 1
    assert (tmp_path / "a" / "last").read_text() == (tmp_path / "b" / "last").read_text() == "1"
    a.finished(), b.finished()


def test_a_lost_node_is_seen_by_its_beat_and_a_new_node_takes_its_place(store, tmp_path):
    import threading

    agent_a, group_a, a = node(store, tmp_path, "a", 0, [0], join_timeout=60.0)
    agent_b, group_b, b = node(store, tmp_path, "b", 1, [1])
    assert not a.poll(agent_a, group_a) and not b.poll(agent_b, group_b)
    b.finished(succeeded=False)  # node b gone silent: its beat stops, no worker of a has failed
    until(lambda: a.poll(agent_a, group_a), "node a to see node b lost by its beat")
    assert (tmp_path / "a" / "incident").read_text() == "1"
    wait(tmp_path / "a", 0)

    until(offered(store, agent_a, group_a, a), "node b's place offered")
    places: list = []
    joiner = threading.Thread(
        target=lambda: places.append(recover.join(store, "127.0.0.1", 1, 5.0, 60.0))
    )
    joiner.start()
    # the new node claims the place and beats as node b before node a looks again
    beat = recover.KEY + "beat/ddpkit/round/t/1"
    before = int(store.get(beat))
    until(lambda: store.check([recover.KEY + "1/claim/1"]), "the claim")
    until(lambda: int(store.get(beat)) > before + 1, "the new node's beat")

    until(settled((agent_a, group_a, a)), "node a to go on once the new node claimed the place")
    joiner.join()
    (place,) = places
    assert place.node == 1 and place.nodes == 2 and place.round_name == "ddpkit/round/t"
    assert place.go["replaced"] == [1] and place.go["lost_nodes"] == [1]
    assert json.loads((tmp_path / "a" / "go-1").read_text()) == place.go
    (tmp_path / "c").mkdir()
    c = recover.InPlace(tmp_path / "c")
    assert json.loads(c.joined(place, group_b.store).read_text()) == place.go
    assert c.generation == 1 and c.nodes is place.link
    # the new node beats from its claim (its workers not started yet): never counted lost again
    import time

    watched = time.monotonic()
    while time.monotonic() - watched < 3 * recover.LOST_AFTER:
        assert not a.poll(agent_a, group_a), "the new node counted lost while it beats"
        time.sleep(0.05)
    # Control: once it stops beating, it is.
    c.finished(succeeded=False)
    until(lambda: a.poll(agent_a, group_a), "node a to count the silent new node lost")
    a.finished()


def test_control_a_lost_node_nobody_replaces_gives_the_failure_back_naming_it(store, tmp_path):
    agent_a, group_a, a = node(store, tmp_path, "a", 0, [0], join_timeout=0.2)
    agent_b, group_b, b = node(store, tmp_path, "b", 1, [1])
    assert not a.poll(agent_a, group_a) and not b.poll(agent_b, group_b)
    b.finished(succeeded=False)
    wait(tmp_path / "a", 0)
    until(lambda: not a.poll(agent_a, group_a), "node a to give the failure back")
    assert "no new node took the place of lost node(s) 1 within --join-timeout" in a.fallback
    assert (tmp_path / "a" / "end-1").read_text() == a.fallback and a.ended
    # a new node arriving now finds no place: torch's rendezvous takes it in at the restart
    assert recover.join(store, "127.0.0.1", 1, 0.0, 1.0) is None
    a.finished()


def test_a_node_counted_lost_that_speaks_after_all_keeps_its_place(store, tmp_path):
    agent_a, group_a, a = node(store, tmp_path, "a", 0, [0])
    agent_b, group_b, b = node(store, tmp_path, "b", 1, [1])
    assert not a.poll(agent_a, group_a) and not b.poll(agent_b, group_b)
    b.nodes._stop.set()  # its beat stands still (an agent starved of a core), its node is alive
    wait(tmp_path / "a", 0)

    until(offered(store, agent_a, group_a, a), "node b's place offered")
    wait(tmp_path / "b", 1)

    until(settled((agent_a, group_a, a), (agent_b, group_b, b)), "both agents to go on")
    go = json.loads((tmp_path / "a" / "go-1").read_text())
    assert go["lost_nodes"] == [] and go["replaced"] == [] and not b.ended
    assert recover.join(store, "127.0.0.1", 1, 0.0, 1.0) is None  # the place was withdrawn
    a.finished(), b.finished()


def test_a_node_that_finished_is_not_waited_for_and_the_failure_is_given_back(store, tmp_path):
    agent_a, group_a, a = node(store, tmp_path, "a", 0, [0])
    agent_b, group_b, b = node(store, tmp_path, "b", 1, [1])
    assert not a.poll(agent_a, group_a) and not b.poll(agent_b, group_b)
    b.finished()  # node b's workers succeeded; its agent waits at torch's exit barrier
    agent_a.codes[0] = -9  # then rank 0 fails (in its last save, say)
    until(lambda: not a.poll(agent_a, group_a), "node a to give the failure back")
    assert a.fallback == "node(s) 1 had already finished" and a.ended
    a.finished()


def test_a_node_that_never_says_what_its_ranks_did_is_not_waited_for_forever(
    store, tmp_path, monkeypatch
):
    monkeypatch.setattr(recover, "GRACE", 0.0)
    agent_a, group_a, a = node(store, tmp_path, "a", 0, [0], timeout=0.0)
    agent_b, group_b, b = node(store, tmp_path, "b", 1, [1])
    assert not a.poll(agent_a, group_a) and not b.poll(agent_b, group_b)
    wait(tmp_path / "a", 0)  # node b's agent beats but never polls again (stuck elsewhere)
    until(lambda: not a.poll(agent_a, group_a), "node a to give the failure back")
    assert "node(s) 1 did not say what their ranks did within" in a.fallback
    a.finished(), b.finished()


def _lose_b(store, tmp_path, **kw):
    """Nodes a (deciding) and b; b goes silent and a offers its place. (agent, group, InPlace)
    of node a."""
    agent_a, group_a, a = node(store, tmp_path, "a", 0, [0], **kw)
    agent_b, group_b, b = node(store, tmp_path, "b", 1, [1])
    assert not a.poll(agent_a, group_a) and not b.poll(agent_b, group_b)
    b.finished(succeeded=False)
    wait(tmp_path / "a", 0)
    until(offered(store, agent_a, group_a, a), "node b's place offered")
    return agent_a, group_a, a


def test_two_new_nodes_at_one_address_one_takes_the_place_the_other_is_told(store, tmp_path):
    import threading

    agent_a, group_a, a = _lose_b(store, tmp_path, join_timeout=600.0)
    found: list = []

    def start() -> None:
        try:
            found.append(recover.join(store, "127.0.0.1", 1, 5.0, 60.0))
        except ConfigError as err:
            found.append(err)

    joiners = [threading.Thread(target=start) for _ in range(2)]
    for t in joiners:
        t.start()
    until(lambda: len(found) == 1, "one new node turned away")
    until(settled((agent_a, group_a, a)), "node a to go on with the other")
    for t in joiners:
        t.join()
    (place,) = [f for f in found if isinstance(f, recover.Joined)]
    (refused,) = [f for f in found if isinstance(f, ConfigError)]
    assert place.node == 1 and "was taken by another new node" in str(refused)
    place.link.close(), a.finished()


def test_a_new_node_waiting_in_torchs_rendezvous_ends_the_offer_at_once(store, tmp_path):
    agent_a, group_a, a = _lose_b(store, tmp_path, join_timeout=600.0)
    group_a.spec.rdzv_handler.nodes_waiting = lambda: 1
    until(lambda: not a.poll(agent_a, group_a), "node a to give the failure back")
    assert a.fallback == recover.NODE_WAITING and a.ended
    a.finished()


def test_a_worker_whose_agent_is_gone_stops_waiting_for_its_word(tmp_path, monkeypatch):
    import threading

    monkeypatch.setenv(recover.DIR_ENV, str(tmp_path))
    monkeypatch.setenv("DDPKIT_AGENT_PID", str(os.getppid()))
    monkeypatch.setattr(recover, "_handled", 0)  # the recoveries this process cut its links for
    left: list = []
    waiting = threading.Thread(target=lambda: left.append(recover.leave(RuntimeError("x"))))
    waiting.start()
    until(lambda: (tmp_path / "wait-1.0").exists(), "the worker's word")
    waiting.join(0.3)
    assert waiting.is_alive()  # its agent lives: it waits for the go or the end
    (tmp_path / "end-1").write_text("why")
    waiting.join()
    assert left == [None]
    # with its agent gone it does not wait
    monkeypatch.setenv("DDPKIT_AGENT_PID", str(os.getppid() + 1))
    (tmp_path / "last").write_text("1")
    assert recover.leave(RuntimeError("x")) is None and (tmp_path / "wait-2.0").exists()


def test_a_node_refused_a_place_leaves_the_rendezvous_open():
    from ddpkit._launch.rendezvous.backend import WorkersStoreHandler

    closed: list = []
    inner = SimpleNamespace(shutdown=lambda: closed.append(True) or True)
    handler = WorkersStoreHandler(inner, "127.0.0.1", None)  # type: ignore[arg-type]
    assert handler.shutdown() and closed == []  # never of the job: torch's close is not called
    handler._member = True
    assert handler.shutdown() and closed == [True]


def test_a_new_node_started_before_the_loss_waits_for_the_place_and_takes_it(store, tmp_path):
    import threading

    agent_a, group_a, a = node(store, tmp_path, "a", 0, [0], join_timeout=600.0)
    agent_b, group_b, b = node(store, tmp_path, "b", 1, [1])
    assert not a.poll(agent_a, group_a) and not b.poll(agent_b, group_b)
    # Control: with no job running at its full size, a new node goes to torch's rendezvous.
    job = store.get(recover.KEY + "job")
    store.delete_key(recover.KEY + "job")
    assert recover.join(store, "127.0.0.1", 1, 0.0, 60.0) is None
    store.set(recover.KEY + "job", job)
    places: list = []
    joiner = threading.Thread(
        target=lambda: places.append(recover.join(store, "127.0.0.1", 1, 5.0, 60.0))
    )
    joiner.start()  # node b still beats: the new node waits for a place
    joiner.join(3 * (recover.LOST_AFTER + recover.BEAT))  # past its look at the beats
    assert joiner.is_alive() and places == []
    b.finished(succeeded=False)  # now node b is lost
    wait(tmp_path / "a", 0)
    until(settled((agent_a, group_a, a)), "node a to go on with the new node")
    joiner.join()
    (place,) = places
    assert place.node == 1 and place.go["lost_nodes"] == [1]
    place.link.close(), a.finished()


def test_a_job_on_all_its_nodes_restarts_for_no_node_waiting_in_torchs_rendezvous():
    from ddpkit._launch.rendezvous.backend import WorkersStoreHandler

    inner = SimpleNamespace(num_nodes_waiting=lambda: 1)
    place = SimpleNamespace(incident=None)
    handler = WorkersStoreHandler(inner, "127.0.0.1", None, place, max_nodes=2)  # type: ignore[arg-type]
    handler._size = 2
    assert handler.num_nodes_waiting() == 0 and handler.nodes_waiting() == 1
    # Control: below its size the job takes the waiting node in at a restart, as torch does.
    handler._size = 1
    assert handler.num_nodes_waiting() == 1
