"""A node is lost on evidence, never on its beat's silence alone
(``ddpkit._launch.rendezvous.link``): a node whose agent holds the GIL, 64 nodes on one store under
a CPU hog, are never lost; controls: the same nodes with their agent gone are, each naming the
evidence. No check here needs a thread
scheduled within a time: a healthy node is never lost however long it is starved."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import timedelta

import pytest

from ddpkit._internals.store import serve_new_store
from ddpkit._launch.rendezvous.link import SUSPECT_AFTER, NodeLink, read
from ddpkit.testing import wait_until


@pytest.fixture
def store():
    return serve_new_store("127.0.0.1", timedelta(seconds=60))


def _watch(link: NodeLink, node: int, seconds: float) -> list[dict[int, str]]:
    """``link``'s verdicts on ``node`` at each look for ``seconds`` (a suspect's probe included)."""
    found, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        if verdict := link.lost([node]):
            found.append(verdict)
        time.sleep(0.05)
    return found


_GIL_HOLDER = """
import sys, time
import torch.distributed as dist
from datetime import timedelta
from ddpkit._launch.rendezvous.link import NodeLink, read
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=60))
link = NodeLink(store, "r", 1, 2, "127.0.0.1")
while read(store, "ddpkit/nodes/r/beat/1") is None:  # until it has beaten
    time.sleep(0.05)
print("holding", flush=True)
sys.setswitchinterval(30.0)  # no other thread of this process runs for 30 s
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    pass
sys.setswitchinterval(0.005)
print("released", flush=True)
time.sleep(600)
"""


def test_a_node_whose_agent_holds_the_gil_is_never_lost_and_one_whose_agent_is_gone_is(store):
    server, port = store
    observer = NodeLink(server, "r", 0, 2, "127.0.0.1")
    holder = subprocess.Popen(
        [sys.executable, "-c", _GIL_HOLDER, str(port), str(10 * SUSPECT_AFTER)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline() == "holding\n"
        beat = observer.prefix + "beat/1"
        count = read(observer.store, beat)
        assert count is not None, "node 1 never beat: the test shows nothing"
        # its beat stands still past SUSPECT_AFTER, through several probes (two unanswered in a
        # row would be evidence); its agent's listener still takes each
        assert _watch(observer, 1, 6 * SUSPECT_AFTER) == []
        assert read(observer.store, beat) == count, "the beat moved: the test shows nothing"
        assert holder.stdout.readline() == "released\n"
        # Control: its agent gone, the same silence is a loss, with the evidence.
        holder.kill()
        holder.wait()
        verdict = wait_until(lambda: observer.lost([1]), 60, what="node 1 lost")
        assert "refused a connection" in verdict[1], verdict
    finally:
        holder.kill()
        observer.close()


def test_64_nodes_on_one_store_under_a_cpu_hog_none_is_lost_and_a_gone_one_is(store):
    server, _ = store
    count = 64
    links = [NodeLink(server, "r", n, count, "127.0.0.1") for n in range(count)]
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)
    ]  # every core busy
    try:
        end = time.monotonic() + 6 * SUSPECT_AFTER  # several probes of any suspect
        while time.monotonic() < end:
            for n, link in enumerate(links):  # each node watches the next
                assert link.lost([(n + 1) % count]) == {}, f"node {(n + 1) % count} counted lost"
            time.sleep(0.1)
        # Control: one node's agent gone: it, and only it, is lost.
        links[10].close()
        verdict = wait_until(lambda: links[9].lost([10]), 60, what="node 10 lost")
        assert "refused a connection" in verdict[10]
        assert all(links[n].lost([(n + 1) % count]) == {} for n in range(count) if n != 9)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
        for link in links:
            link.close()
