"""In-place recovery's parts on real ranks: cutting a worker's collective links with real gloo
processes (and the control: gloo's own abort leaves the wait), a ``DeviceMesh``'s groups too, a
group being made let go by the cut of the store's connections, torch's group count after a group
made half-way, and the writer groups of a world made again."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import torch
import torch.distributed as dist

from ddpkit._launch.recover import worker as recovering
from ddpkit.testing import run_on_ranks


def _pending_all_reduce(cut: bool) -> str:
    """Rank 0 starts an all-reduce on a new group that rank 1 never joins; rank 1 cuts its links to
    the group (``cut``), or aborts it as gloo offers, or destroys it (the control, which cuts them
    after rank 0 has looked). How rank 0's all-reduce stood once rank 1 had done so."""
    dist.barrier()  # the default group's links made (gloo may make them at first use): not cut
    recovering.note_links()
    group = dist.new_group(backend="gloo")
    dist.barrier()  # both ranks have made the group: a cut while rank 0 still makes it fails that
    # the store's connections are not cut here (the test's end waits on the store)
    os.environ["MASTER_PORT"] = "1"
    if dist.get_rank() == 1:
        if cut:
            recovering.sever()
        else:  # gloo's abort, where it has one (torch 2.7 on); before, the group destroyed
            backend = group._get_backend(torch.device("cpu"))
            if hasattr(backend, "abort"):
                backend.abort()
            else:
                dist.destroy_process_group(group)
        dist.barrier()  # done: rank 0 looks
        if not cut:
            dist.barrier()  # rank 0 has looked
            recovering.sever()
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


def _all_reduce_on_a_mesh(noted: bool) -> str:
    """A 2 x 2 ``DeviceMesh``'s groups (torch's ``device_mesh`` keeps its own binding of
    ``new_group``), made after ``note_links`` (``noted``) or before it; rank 1 cuts its links, and
    rank 0's all-reduce on the mesh's group of ranks 0 and 1 ends how?"""
    from torch.distributed.device_mesh import init_device_mesh

    dist.barrier()  # the default group's links made: not cut
    if noted:
        recovering.note_links()
    group = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b")).get_group("b")
    if not noted:
        recovering.note_links()
    pair = dist.get_rank() - dist.get_rank() % 2
    assert dist.get_process_group_ranks(group) == [pair, pair + 1]  # a group of its own, not WORLD
    dist.barrier()
    os.environ["MASTER_PORT"] = "1"  # the store's connections not cut (the test's end waits on it)
    if dist.get_rank() == 1:
        recovering.sever()
        dist.barrier()
        if not noted:  # its links not cut: rank 0's all-reduce completes with it
            dist.all_reduce(torch.ones(4), group=group)
        return ""
    dist.barrier()
    if dist.get_rank() != 0:
        return ""
    try:
        dist.all_reduce(torch.ones(4), group=group)
    except RuntimeError as err:
        return "timed out" if "Timed out" in str(err) else "raised"
    return "completed"


def test_the_cut_reaches_a_device_meshs_group():
    assert run_on_ranks(_all_reduce_on_a_mesh, 4, (True,))[0] == "raised"
    # Control: a mesh made before its maker was wrapped keeps its links through the cut.
    assert run_on_ranks(_all_reduce_on_a_mesh, 4, (False,))[0] == "completed"


def _group_never_joined(cut: bool) -> str:
    """Rank 0 makes a new group rank 1 never joins (it waits on the store for rank 1's address);
    another thread of rank 0 cuts its links (``cut``). How rank 0's ``new_group`` ended."""
    import datetime

    dist.barrier()
    if dist.get_rank() == 1:
        dist.barrier()
        return ""
    if cut:
        threading.Thread(target=recovering.sever, daemon=True).start()  # before or during
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


_HALF_MADE = """
import datetime, os, sys
import torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from ddpkit._internals.groups import reset_process_groups
rank, port, reset = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "reset"
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
if rank == 1:  # its first group made half-way: rank 0 is not there yet
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("early", store), rank=1,
                                world_size=2, timeout=datetime.timedelta(seconds=1))
    except Exception:
        pass
    print("count", c10d._world.group_count, flush=True)
    if reset:
        reset_process_groups()
    store.set("ready", "1")
store.wait(["ready"])
dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=8))
t = torch.ones(1)
dist.all_reduce(t)
print("sum", float(t), flush=True)
"""


def _two_ranks_after_a_half_made_group(reset: bool) -> list[str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _HALF_MADE, str(r), str(port), "reset" if reset else "-"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )  # fmt: skip
        for r in (0, 1)
    ]
    return [p.communicate(timeout=120)[0] for p in procs]


def test_a_group_made_half_way_is_counted_and_the_reset_names_the_next_one_as_the_peers():
    out = _two_ranks_after_a_half_made_group(reset=True)
    assert "count 1" in out[1] and all("sum 2.0" in o for o in out), out
    # Control: torch's count left at 1, rank 1 names its next group otherwise than rank 0 does,
    # and neither meets the other before the group's timeout.
    out = _two_ranks_after_a_half_made_group(reset=False)
    assert "count 1" in out[1] and not any("sum" in o for o in out), out


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
