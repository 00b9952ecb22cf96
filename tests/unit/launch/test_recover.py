"""In-place recovery's parts in one process: the agent's decisions on faked workers (pure logic:
which ranks are replaced, when it waits, when it gives the failure back and why), a stopped worker
with a real process, and the agents of two nodes on one real store, each node's loss judged on
evidence (its agent gone from its address). Its parts on real ranks (a worker's collective links
cut, torch's group count after a group made half-way) are in
``tests/jobs/launch/test_recover.py``."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpkit._errors import PREEMPTED_EXIT_CODE, ConfigError
from ddpkit._launch.recover import inplace as recover
from ddpkit._launch.recover import nodes
from ddpkit._launch.recover import worker as recovering
from ddpkit._launch.rendezvous.link import SUSPECT_AFTER, NodeLink
from ddpkit.testing import wait_until


def test_a_failed_runs_holders_are_let_go_newest_first_and_a_gone_one_is_skipped():
    from ddpkit.distributed import _runtime as lifetime

    let_go: list[str] = []

    class Holder:
        def __init__(self, name: str) -> None:
            self.name = name
            self.done = lifetime.hold(name, self.release)

        def release(self) -> None:
            let_go.append(self.name)

    a, b, gone = Holder("a"), Holder("b"), Holder("gone")
    del gone  # collected: held weakly, nothing left to let go
    closed = Holder("closed")
    closed.done()  # let go by itself
    broken = lifetime.hold("broken", lambda: 1 / 0)
    assert lifetime.release_all() == ["broken: ZeroDivisionError: division by zero"]
    assert let_go == ["b", "a"] and lifetime.release_all() == []
    del a, b, broken


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


# -- the agent's decisions, one node -----------------------------------------------------------


class FakeWorkers:
    """The agent as :class:`~ddpkit._launch.recover.inplace.InPlace` sees it
    (:class:`~ddpkit._launch.recover.inplace.Workers`): each rank's exit code, pid and kills."""

    def __init__(
        self, codes: dict[int, int | None], restarts: int = 2, pids: dict[int, int] | None = None
    ) -> None:
        self.codes, self.restarts, self.max, self.replaced = codes, restarts, restarts, []
        self.killed: list[tuple[list[int], str]] = []
        self._pids = pids or {r: 1_000_000 + r for r in codes}  # no such processes
        self.stalled = False

    def exit_codes(self) -> dict[int, int | None]:
        return dict(self.codes)

    def pids(self) -> dict[int, int]:
        return {r: self._pids[r] for r in self.codes}

    def restarts_left(self) -> int:
        return self.restarts

    def restarts_used(self) -> int:
        return self.max - self.restarts

    def use_restart(self) -> None:
        self.restarts -= 1

    def restarts_from(self, used: int) -> None:
        self.restarts = self.max - used

    def stop_restarting(self) -> None:
        self.restarts = 0

    def replace_worker(self, rank: int, env: dict[str, str]) -> None:
        self.replaced.append((rank, env["TORCHELASTIC_RESTART_COUNT"]))
        self.codes[rank] = None

    def kill(self, ranks: list[int], why: str) -> None:
        self.killed.append((ranks, why))
        for r in ranks:
            if self._pids[r] < 1_000_000:
                os.kill(self._pids[r], signal.SIGKILL)

    def stall_ended(self) -> bool:
        return self.stalled

    def went_on(self) -> None:
        pass


def in_place(tmp_path: Path, ranks: list[int], **kw) -> recover.InPlace:
    place = recover.InPlace(tmp_path, **kw)
    place.start(recover.Round("127.0.0.1", ranks))
    return place


def wait(folder: Path, rank: int, generation: int = 1) -> None:
    record = {"rank": rank, "pid": 1_000_000 + rank, "error": "x", "left": 1.0, "torn_down": 2.0}
    (folder / f"wait-{generation}.{rank}").write_text(json.dumps(record))


def test_the_agent_replaces_the_exited_rank_once_every_other_rank_waits(tmp_path, capsys):
    agent, place = FakeWorkers({0: None, 1: -9, 2: None}), in_place(tmp_path, [0, 1, 2])
    assert place.poll(agent)  # rank 1 killed: torchrun must not look
    assert (tmp_path / "incident").read_text() == "1" and agent.replaced == []
    wait(tmp_path, 0)
    assert place.poll(agent) and agent.replaced == []  # rank 2 has not left yet
    wait(tmp_path, 2)
    assert place.poll(agent)
    go = json.loads((tmp_path / "go-1").read_text())
    assert go["replaced"] == [1] and go["restart_count"] == 1 and agent.replaced == [(1, "1")]
    assert not (tmp_path / "incident").exists() and agent.restarts == 1
    assert (tmp_path / "last").read_text() == "1"  # before the replacement looks for its record
    assert "replaced rank 1 (killed by SIGKILL); rank(s) 0, 2 go on" in capsys.readouterr().err
    assert not place.poll(agent)  # all running again: torchrun looks


@pytest.mark.parametrize(
    ("codes", "restarts", "stalled", "why"),
    [
        ({0: None, 1: -9, 2: PREEMPTED_EXIT_CODE}, 2, False, "a rank was pre-empted"),
        ({0: None, 1: -9, 2: 0}, 2, False, "a rank had already finished"),
        ({0: None, 1: -9, 2: None}, 0, False, "no restart left"),
        ({0: None, 1: -9, 2: None}, 2, True, "the stall watch ended the attempt"),
    ],
)
def test_the_agent_gives_the_failure_back_to_torchrun_saying_why(
    tmp_path, codes, restarts, stalled, why
):
    agent, place = FakeWorkers(codes, restarts), in_place(tmp_path, [0, 1, 2])
    agent.stalled = stalled
    assert not place.poll(agent)
    assert why in place.fallback and (tmp_path / "end-1").read_text() == place.fallback
    assert agent.replaced == [] and place.ended


def test_a_rank_that_does_not_leave_in_time_is_killed_and_replaced(tmp_path):
    agent, place = FakeWorkers({0: None, 1: -9}), in_place(tmp_path, [0, 1], timeout=0.0)
    assert place.poll(agent) and [r for r, _ in agent.killed] == [[0]]
    assert "did not leave their step within 0 s" in agent.killed[0][1]
    agent.codes[0] = -9  # the agent's SIGKILL
    assert place.poll(agent) and len(agent.killed) == 1  # once
    assert json.loads((tmp_path / "go-1").read_text())["replaced"] == [0, 1]
    # Control: with time left, the agent waits for it.
    (tmp_path / "x").mkdir()
    agent, place = FakeWorkers({0: None, 1: -9}), in_place(tmp_path / "x", [0, 1], timeout=60.0)
    assert place.poll(agent) and agent.killed == [] and not place.fallback


def _state(pid: int) -> str:
    """The process's state letter (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


@pytest.fixture
def sleeper():
    """A real process that sleeps (stands for a healthy worker)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_stopped_worker_is_a_failure_killed_and_replaced(tmp_path, sleeper):
    agent = FakeWorkers({0: None, 1: None}, pids={0: 1_000_000, 1: sleeper.pid})
    place = in_place(tmp_path, [0, 1], timeout=600.0)
    assert not place.poll(agent)  # running
    os.kill(sleeper.pid, signal.SIGSTOP)
    # stopped for STOPPED_AFTER seconds: a failure, without waiting the leave timeout
    wait_until(lambda: place.poll(agent) and agent.killed, 60, what="the stopped rank killed")
    assert agent.killed == [([1], agent.killed[0][1])] and "stopped (SIGSTOP)" in agent.killed[0][1]
    agent.codes[1] = sleeper.wait()
    assert agent.codes[1] == -signal.SIGKILL
    wait(tmp_path, 0)
    assert place.poll(agent) and agent.replaced == [(1, "1")]


def test_control_a_worker_stopped_for_a_moment_runs_on(tmp_path, sleeper):
    agent = FakeWorkers({0: None, 1: None}, pids={0: 1_000_000, 1: sleeper.pid})
    place = in_place(tmp_path, [0, 1], timeout=600.0)
    os.kill(sleeper.pid, signal.SIGSTOP)
    wait_until(lambda: _state(sleeper.pid) == "T", 60, what="the worker stopped")
    assert not place.poll(agent)  # seen stopped: not yet a failure
    os.kill(sleeper.pid, signal.SIGCONT)
    wait_until(lambda: _state(sleeper.pid) != "T", 60, what="the worker continued")
    time.sleep(recover.STOPPED_AFTER)  # past the bound, continued: its stop is forgotten
    assert not place.poll(agent) and agent.killed == [] and place.incident is None


def test_in_place_recovery_needs_a_restart_budget_and_covers_several_nodes(tmp_path, monkeypatch):
    from ddpkit._launch.cli.options import LaunchConfig
    from ddpkit._launch.cli.run import in_place_recovery
    from ddpkit.distributed import _channels as channels
    from ddpkit.distributed import _runtime as runtime

    monkeypatch.setenv(channels.JOB_DIR_ENV, str(tmp_path))
    with pytest.raises(ConfigError, match="--max-restarts N"):
        in_place_recovery(LaunchConfig(script="x.py", recover="in-place"))
    assert not runtime.recovers_in_place()
    cfg = LaunchConfig(
        script="x.py", recover="in-place", max_restarts=1, nnodes="2",
        rdzv_endpoint="127.0.0.1:29400", join_timeout=7.0, node_timeout=9.0,
    )  # fmt: skip
    found = in_place_recovery(cfg)
    assert found is not None and found.join_timeout == 7 and found.node_timeout == 9
    assert runtime.recovers_in_place()  # the workers see it
    with pytest.raises(ConfigError, match="recover"):
        LaunchConfig(script="x.py", recover="sideways")  # type: ignore[arg-type]


def test_a_worker_whose_agent_is_gone_stops_waiting_for_its_word(tmp_path, monkeypatch):
    from ddpkit.distributed import _channels as channels

    monkeypatch.setenv(channels.JOB_DIR_ENV, str(tmp_path))
    (tmp_path / "recover").mkdir()
    (tmp_path / "owner").write_text(f"{os.getppid()} 0\n")  # its agent: this process's parent
    monkeypatch.setattr(recovering, "note_links", lambda: None)
    monkeypatch.setattr(channels, "serve", lambda name=None: False)
    recovering.start()
    left: list = []
    waiting = threading.Thread(target=lambda: left.append(recovering.leave(RuntimeError("x"))))
    waiting.start()
    wait_until(lambda: (tmp_path / "recover" / "wait-1.0").exists(), 60, what="the worker's word")
    waiting.join(0.3)
    assert waiting.is_alive()  # its agent lives: it waits for the go or the end
    (tmp_path / "recover" / "end-1").write_text("why")
    waiting.join()
    assert left == [False]
    # with its agent gone it does not wait
    (tmp_path / "owner").write_text(f"{os.getppid() + 1} 0\n")
    (tmp_path / "recover" / "last").write_text("1")
    assert not recovering.leave(RuntimeError("x"))
    assert (tmp_path / "recover" / "wait-2.0").exists()


@pytest.mark.parametrize("replacement", [True, False], ids=["replacement", "control-fresh-worker"])
def test_a_replacement_counts_the_recovery_it_starts_in_as_handled(
    tmp_path, monkeypatch, replacement
):
    """A worker started inside recovery 1 (its restart count the go record's) while the incident
    is still open does not cut its fresh links. Control: a worker of another attempt (a whole
    restart) that finds a recovery under way cuts them at once."""
    from ddpkit.distributed import _channels as channels

    monkeypatch.setenv(channels.JOB_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1" if replacement else "2")
    folder = tmp_path / "recover"
    folder.mkdir()
    (folder / "last").write_text("1")
    (folder / "go-1").write_text(json.dumps({"recovery": 1, "restart_count": 1}))
    (folder / "incident").write_text("1")  # the agent closes it once it has forked replacements
    cuts: list[int] = []
    monkeypatch.setattr(recovering, "sever", lambda: cuts.append(1))
    monkeypatch.setattr(recovering, "note_links", lambda: None)
    monkeypatch.setattr(channels, "serve", lambda name=None: False)
    recovering.start()
    assert cuts == ([] if replacement else [1])
    recovering._sever_for(2)  # the next failure is one for it
    assert len(cuts) == (1 if replacement else 2)


# -- across nodes: two agents' InPlace on one real store, each node's workers faked --------------


_NODES: list[Node] = []


@pytest.fixture
def store():
    """A real store served in this process, gone with the links of the test's nodes at its end: a
    rank forked by a later test of this process must find no store thread (a server's or a beat's)
    whose state it would copy half-way."""
    import gc
    from datetime import timedelta

    from ddpkit._internals.store import serve_new_store

    served = serve_new_store("127.0.0.1", timedelta(seconds=30))[0]
    yield served
    while _NODES:
        _NODES.pop().close()
    del served
    gc.collect()


class Node:
    """Node ``n`` of 2 in round ``r``: its link (beating, reachable at 127.0.0.1), its faked
    workers (``ranks``, by global rank) and its agent's InPlace."""

    def __init__(
        self, store, tmp_path: Path, n: int, ranks: list[int], node_timeout: float = 30.0, **kw
    ) -> None:
        (tmp_path / f"node{n}").mkdir()
        self.folder = tmp_path / f"node{n}"
        self.link = NodeLink(store, "r", n, 2, "127.0.0.1", node_timeout)
        _NODES.append(self)
        self.workers = FakeWorkers({r: None for r in ranks})
        self.place = recover.InPlace(self.folder, node_timeout=node_timeout, **kw)
        self.waiting = 0
        self.place.start(recover.Round("127.0.0.1", ranks, self.link, lambda: self.waiting))

    def poll(self) -> bool:
        return self.place.poll(self.workers)

    def lose(self) -> None:
        """This node lost: its agent gone (its beat stops, its address refuses)."""
        self.link.close()

    def close(self) -> None:
        self.link.close()


def until(condition, what: str) -> None:
    wait_until(condition, 120, what=what, interval=0.02, max_interval=0.1)  # a hang guard


def settled(*nodes_: Node):
    """Polls each node once; True once none recovers any more."""

    def look() -> bool:
        for node in nodes_:
            node.poll()
        return all(node.place.incident is None for node in nodes_)

    return look


def offered(store, node: Node):
    """Polls the deciding node once; True once it offered a lost node's place."""

    def look() -> bool:
        node.poll()
        return store.check([nodes.KEY + "vacant"])

    return look


def join(store, **kw):
    kw = {"wait": 5.0, "join_timeout": 60.0, "node_timeout": 30.0} | kw
    return nodes.join(store, "127.0.0.1", 1, **kw)


def test_across_nodes_a_worker_lost_on_one_node_is_recovered_by_both_agents(store, tmp_path):
    a, b = Node(store, tmp_path, 0, [0, 1]), Node(store, tmp_path, 1, [2, 3])
    assert not a.poll() and not b.poll()  # healthy
    assert a.place.running and b.place.running  # "healthy" without torchrun's own look
    b.workers.codes[3] = -9  # rank 3 killed
    assert b.poll()
    # node a's agent hears of it from the store and has its ranks leave
    assert a.poll() and (a.folder / "incident").read_text() == "1"
    wait(a.folder, 0)
    wait(a.folder, 1)
    wait(b.folder, 2)
    until(settled(a, b), "both agents to go on")
    go_a, go_b = (json.loads((n.folder / "go-1").read_text()) for n in (a, b))
    assert go_a == go_b and go_a["replaced"] == [3] and go_a["lost_nodes"] == []
    assert b.workers.replaced == [(3, "1")] and a.workers.replaced == []
    assert a.workers.restarts == b.workers.restarts == 1
    assert (a.folder / "last").read_text() == (b.folder / "last").read_text() == "1"
    a.close(), b.close()


def test_a_lost_node_is_judged_on_evidence_and_a_new_node_takes_its_place(store, tmp_path):
    a, b = Node(store, tmp_path, 0, [0], join_timeout=60.0), Node(store, tmp_path, 1, [1])
    assert not a.poll() and not b.poll()
    b.lose()  # no worker of a has failed: its beat stands still, its address refuses
    until(a.poll, "node a to find node b lost")
    assert (a.folder / "incident").read_text() == "1"
    wait(a.folder, 0)
    until(offered(store, a), "node b's place offered")
    places: list = []
    joiner = threading.Thread(target=lambda: places.append(join(store)))
    joiner.start()
    until(lambda: store.check([nodes.KEY + "1/claim/1"]), "the claim")
    until(settled(a), "node a to go on once the new node claimed the place")
    joiner.join()
    (place,) = places
    assert place.node == 1 and place.nodes == 2 and place.round_name == "r"
    assert place.go["replaced"] == [1] and place.go["lost_nodes"] == [1]
    assert json.loads((a.folder / "go-1").read_text()) == place.go
    # the new node's agent starts its workers in the recovery, at its count
    (tmp_path / "c").mkdir()
    c, workers = recover.InPlace(tmp_path / "c"), FakeWorkers({1: None})
    c.joined_start(place, workers)
    assert json.loads((tmp_path / "c" / "go-1").read_text()) == place.go
    assert c.generation == 1 and workers.restarts_used() == 1
    # beating from its claim (its workers not started yet): never counted lost
    watched = time.monotonic()
    while time.monotonic() - watched < 3 * SUSPECT_AFTER:
        assert not a.poll(), "the new node counted lost while it beats"
        time.sleep(0.05)
    # Control: once its agent is gone, it is.
    place.link.close()
    until(a.poll, "node a to count the gone new node lost")
    a.close()


def test_a_node_whose_agent_is_there_is_not_lost_however_long_its_beat_stands_still(
    store, tmp_path
):
    """A busy or starved agent (its beat's thread held, its address answering): never counted lost
    while --node-timeout has not passed. Control: past --node-timeout, it is."""
    a, b = Node(store, tmp_path, 0, [0]), Node(store, tmp_path, 1, [1])
    assert not a.poll() and not b.poll()
    b.link._stop.set()  # its beat stands still; its listener takes probes as the kernel does
    b.link._thread.join()
    watched = time.monotonic()
    while time.monotonic() - watched < 4 * SUSPECT_AFTER:
        assert not a.poll() and a.place.incident is None, "a reachable node counted lost"
        time.sleep(0.05)
    a.close(), b.close()
    # Control: the same silence past --node-timeout.
    (tmp_path / "t").mkdir()
    a, b = Node(store, tmp_path / "t", 0, [0], 2.0), Node(store, tmp_path / "t", 1, [1], 2.0)
    assert not a.poll() and not b.poll()
    b.link._stop.set()
    until(a.poll, "node a to count node b lost past --node-timeout")
    lost = a.place.agreement.lost([1]) if a.place.agreement else {}
    assert "--node-timeout" in lost.get(1, ""), lost
    a.close(), b.close()


def _given_back(store, tmp_path) -> Node:
    """Nodes a (deciding) and b; b is lost, nobody takes its place within a's --join-timeout, and a
    gives the recovery back. Node a."""
    a, b = Node(store, tmp_path, 0, [0], join_timeout=0.2), Node(store, tmp_path, 1, [1])
    assert not a.poll() and not b.poll()
    b.lose()
    wait(a.folder, 0)
    until(lambda: not a.poll() and a.place.ended, "node a to give the failure back")
    return a


def test_control_a_lost_node_nobody_replaces_gives_the_failure_back_naming_it(store, tmp_path):
    a = _given_back(store, tmp_path)
    assert "no new node took the place of lost node(s) 1 within --join-timeout" in a.place.fallback
    assert (a.folder / "end-1").read_text() == a.place.fallback
    # a new node arriving now finds no place: torch's rendezvous takes it in at the restart
    assert join(store, wait=0.0, join_timeout=1.0) is None
    a.close()


def test_a_node_counted_lost_that_speaks_after_all_keeps_its_place(store, tmp_path):
    a = Node(store, tmp_path, 0, [0], node_timeout=1.5)
    b = Node(store, tmp_path, 1, [1], node_timeout=1.5)
    assert not a.poll() and not b.poll()
    b.link._stop.set()  # its beat stands still past --node-timeout (an agent stopped a while)
    wait(a.folder, 0)
    until(offered(store, a), "node b's place offered")
    wait(b.folder, 1)  # it speaks
    until(settled(a, b), "both agents to go on")
    go = json.loads((a.folder / "go-1").read_text())
    assert go["lost_nodes"] == [] and go["replaced"] == [] and not b.place.ended
    assert join(store, wait=0.0, join_timeout=1.0) is None  # the place was withdrawn
    a.close(), b.close()


def test_a_node_that_finished_is_not_waited_for_and_the_failure_is_given_back(store, tmp_path):
    a, b = Node(store, tmp_path, 0, [0]), Node(store, tmp_path, 1, [1])
    assert not a.poll() and not b.poll()
    b.link.close(finished=True)  # node b's workers succeeded; its agent waits at torch's exit
    a.workers.codes[0] = -9  # then rank 0 fails (in its last save, say)
    until(lambda: not a.poll() and a.place.ended, "node a to give the failure back")
    assert a.place.fallback == "node(s) 1 had already finished"
    a.close()


def test_a_node_that_never_says_what_its_ranks_did_is_not_waited_for_forever(
    store, tmp_path, monkeypatch
):
    monkeypatch.setattr(recover, "WORD_GRACE", 0.0)
    a = Node(store, tmp_path, 0, [0], timeout=0.0, node_timeout=1.0)
    b = Node(store, tmp_path, 1, [1], node_timeout=1.0)
    assert not a.poll() and not b.poll()
    wait(a.folder, 0)  # node b's agent beats but never polls again (stuck elsewhere)
    until(lambda: not a.poll() and a.place.ended, "node a to give the failure back")
    assert "node(s) 1 did not say what their ranks did within" in a.place.fallback
    a.close(), b.close()


def _lose_b(store, tmp_path, **kw) -> Node:
    """Nodes a (deciding) and b; b is lost and a offers its place. Node a."""
    a, b = Node(store, tmp_path, 0, [0], **kw), Node(store, tmp_path, 1, [1])
    assert not a.poll() and not b.poll()
    b.lose()
    wait(a.folder, 0)
    until(offered(store, a), "node b's place offered")
    return a


def test_two_new_nodes_at_one_address_one_takes_the_place_the_other_is_told(store, tmp_path):
    a = _lose_b(store, tmp_path, join_timeout=600.0)
    found: list = []

    def start() -> None:
        try:
            found.append(join(store))
        except ConfigError as err:
            found.append(err)

    joiners = [threading.Thread(target=start) for _ in range(2)]
    for t in joiners:
        t.start()
    until(lambda: len(found) == 1, "one new node turned away")
    until(settled(a), "node a to go on with the other")
    for t in joiners:
        t.join()
    (place,) = [f for f in found if isinstance(f, nodes.Joined)]
    (refused,) = [f for f in found if isinstance(f, ConfigError)]
    assert place.node == 1 and "was taken by another new node" in str(refused)
    place.link.close(), a.close()


def test_a_new_node_waiting_in_torchs_rendezvous_ends_the_offer_at_once(store, tmp_path):
    a = _lose_b(store, tmp_path, join_timeout=600.0)
    a.waiting = 1
    until(lambda: not a.poll() and a.place.ended, "node a to give the failure back")
    assert a.place.fallback == recover.NODE_WAITING
    a.close()


def test_a_new_node_started_before_the_loss_waits_for_the_place_and_takes_it(store, tmp_path):
    a = Node(store, tmp_path, 0, [0], join_timeout=600.0)
    b = Node(store, tmp_path, 1, [1])
    assert not a.poll() and not b.poll()
    # Control: with no job running at its full size, a new node goes to torch's rendezvous.
    job = store.get(nodes.KEY + "job")
    store.delete_key(nodes.KEY + "job")
    assert join(store, wait=0.0) is None
    store.set(nodes.KEY + "job", job)
    places: list = []
    joiner = threading.Thread(target=lambda: places.append(join(store)))
    joiner.start()  # every node's agent answers: the new node waits for a place
    joiner.join(1.0)
    assert joiner.is_alive() and places == []
    b.lose()  # now node b is lost
    wait(a.folder, 0)
    until(settled(a), "node a to go on with the new node")
    joiner.join()
    (place,) = places
    assert place.node == 1 and place.go["lost_nodes"] == [1]
    place.link.close(), a.close()


def test_a_new_node_after_the_recovery_was_given_back_joins_the_whole_restart_at_once(
    store, tmp_path, capfd
):
    a = _given_back(store, tmp_path)
    # node b's place judged (its agent gone), waited for past --node-timeout without the given back
    # seen: torch's rendezvous, where node a waits for the whole restart, would time out meanwhile
    found: list = []
    late = threading.Thread(
        target=lambda: found.append(join(store, node_timeout=3600.0)), daemon=True
    )
    late.start()
    until(lambda: not late.is_alive(), "the new node to go to torch's rendezvous")
    assert found == [None]
    assert "was given back (no new node took the place" in capfd.readouterr().err
    a.close()


def test_control_an_old_given_back_recovery_does_not_send_a_new_node_away(store, tmp_path):
    a = _given_back(store, tmp_path)
    # the job restarted whole since, in another round: the recovery given back is of the past
    job = json.loads(store.get(nodes.KEY + "job"))
    store.set(nodes.KEY + "job", json.dumps(job | {"round": "after-the-restart"}))
    found: list = []
    joiner = threading.Thread(
        target=lambda: found.append(join(store, wait=0.0, node_timeout=2.0)), daemon=True
    )
    joiner.start()
    joiner.join(1.0)
    assert joiner.is_alive() and found == []  # it waits for the verdict on the node not answering
    joiner.join()
    assert found == [None]
    a.close()


def test_a_new_node_whose_jobs_store_stops_answering_says_so_and_goes_on(tmp_path, capfd):
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=1))
    client.set(nodes.KEY + "job", json.dumps({"round": "r", "size": 2}))
    del server  # the node serving the rendezvous is lost
    assert join(client, wait=0.0, join_timeout=1.0, node_timeout=1.0) is None
    err = capfd.readouterr().err
    assert "the job's store stopped answering while this node waited for a place" in err, err
    assert "Traceback" not in err


def test_a_new_node_is_probed_where_its_claim_says_never_at_the_lost_nodes_address(store, tmp_path):
    a = _lose_b(store, tmp_path, join_timeout=600.0)
    lost = json.loads(store.get(nodes.KEY + "vacant"))
    g = lost["recovery"]
    # a new node that claimed the place and stopped before its link beats (SIGSTOP, or no core):
    # its listener is up, the kernel takes the probes' connections
    listener = socket.create_server(("127.0.0.1", 0))
    claim = f"127.0.0.1 {listener.getsockname()[1]} {os.getpid()} token"
    assert store.compare_set(f"{nodes.KEY}{g}/claim/1", "", claim) == claim.encode()
    until(settled(a), "node a to go on with the new node")
    beat = lambda: a.link._beats.get(1)  # noqa: E731
    # node a looks until a probe of node 1 has been answered (the beat stands still meanwhile)
    until(lambda: (a.poll() or True) and beat() is not None and beat().probed > 0
          and not beat().probing, "a probe of the new node")  # fmt: skip
    assert a.link.lost([1]) == {}, "the new node judged by the lost node's address"
    # Control: its listener gone (the new node died after its claim), it is lost on that evidence.
    listener.close()
    until(lambda: 1 in a.link.lost([1]), "the new node, gone, counted lost")
    assert "refused a connection at 127.0.0.1" in a.link.lost([1])[1]
    a.close()


def test_the_job_store_lost_ends_this_nodes_workers_naming_it(store, tmp_path):
    a, b = Node(store, tmp_path, 0, [0]), Node(store, tmp_path, 1, [1])
    assert not a.poll() and not b.poll()

    class Gone:
        def __getattr__(self, name: str):
            raise RuntimeError("Connection reset by peer")

    a.place.agreement.store = Gone()  # type: ignore[union-attr]
    a.place.node_timeout = 0.5
    a.workers.codes[0] = -9
    assert a.poll()  # once: no verdict yet
    until(lambda: not a.poll(), "node a to end its workers past --node-timeout")
    assert "the job's rendezvous store does not answer this node" in a.place.fallback
    assert a.place.left_job() and a.workers.restarts == 0
    assert a.workers.killed == [([0], "ended: this node leaves the job")]
    a.close(), b.close()


def test_a_node_refused_a_place_leaves_the_rendezvous_open():
    from ddpkit._launch.rendezvous.backend import WorkersStoreHandler

    closed: list = []
    inner = SimpleNamespace(shutdown=lambda: closed.append(True) or True)
    handler = WorkersStoreHandler(inner, "127.0.0.1", None)  # type: ignore[arg-type]
    assert handler.shutdown() and closed == []  # never of the job: torch's close is not called
    handler._member = True
    assert handler.shutdown() and closed == [True]


def test_a_job_on_all_its_nodes_restarts_for_no_node_waiting_in_torchs_rendezvous(tmp_path):
    from ddpkit._launch.rendezvous.backend import WorkersStoreHandler

    inner = SimpleNamespace(num_nodes_waiting=lambda: 1)
    place = recover.InPlace(tmp_path)
    handler = WorkersStoreHandler(inner, "127.0.0.1", None, place, max_nodes=2)  # type: ignore[arg-type]
    handler._size = 2
    assert handler.num_nodes_waiting() == 0 and handler.nodes_waiting() == 1
    # Control: below its size the job takes the waiting node in at a restart, as torch does.
    handler._size = 1
    assert handler.num_nodes_waiting() == 1
