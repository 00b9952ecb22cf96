"""Folder snapshots across processes: a crash in the middle of a background write leaves the
previous snapshot the newest whole one; a full disk is named on every rank, with the same
message."""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit.snapshot._disk import (
    PER_RANK,
    DiskStore,
    SnapshotWriteError,
)
from ddpkit.testing import run_on_ranks
from tests.tmpfs import fill, small_tmpfs


def state(step: int) -> tuple[dict, dict]:
    return {"model": {"w": torch.full((4,), float(step))}}, {"step": step, "rng": torch.arange(3)}


def load(ckpt: DiskStore, size: int = 4):
    found = ckpt.latest(warn=lambda msg: None)
    sharded, extra = ckpt.load(found, lambda: {"model": {"w": torch.zeros(size)}})
    return found, sharded, extra


@pytest.mark.heavy
def test_a_crash_during_a_background_write_leaves_the_previous_snapshot(tmp_path, run_python):
    # SIGKILL from the writer thread while it writes step 6's marker (the training thread is already
    # past save()); the folder of step 6 has all its data but no marker, so step 3 is the newest
    # whole snapshot.
    code = textwrap.dedent(f"""
        import os, signal, torch
        import ddpkit._fs
        from ddpkit.snapshot._disk import DiskStore
        write = ddpkit._fs.write_atomic
        def dying(path, data, **kw):
            if path.name == "complete.json" and "00000006" in str(path):
                path.with_name(".complete.json.dead.tmp").write_bytes(data[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            write(path, data, **kw)
        ddpkit._fs.write_atomic = dying
        ckpt = DiskStore({str(tmp_path)!r}, async_write=True)
        for step in (3, 6):
            model = {{"w": torch.full((1000,), float(step))}}
            ckpt.save(step, {{"model": model}}, {{"step": step}})
            print("returned from save", step, flush=True)
        ckpt.wait()
        print("not reached")
    """)
    proc = run_python(code)
    assert (
        proc.returncode == -9
        and "returned from save 6" in proc.stdout
        and "not reached" not in proc.stdout
    )
    # the data was written: the kill was late
    assert (tmp_path / "step-00000006" / "__0_0.distcp").exists()
    ckpt = DiskStore(tmp_path)
    found, sharded, _ = load(ckpt, size=1000)
    assert found.step == 3 and sharded["model"]["w"][0] == 3.0


BIG = 50_000  # floats: 200 kB, more than a file's write buffer, as real states are


def _fill_and_save(fs: str) -> list[str]:
    """Each rank's own 200 kB; rank 0 fills the disk between a snapshot and the next, written in the
    training thread and then in the background: the message each rank raised, each time."""
    rt = ddpkit.init()

    def state(step: int) -> dict:
        return {PER_RANK: {"model": {"w": torch.full((BIG,), float(step + rt.rank))}}}

    checkpointers = [
        DiskStore(Path(fs) / f"async-{a}", group=rt.group, async_write=a) for a in (False, True)
    ]
    for ckpt in checkpointers:
        ckpt.save(3, state(3), {"step": 3})
        ckpt.wait()
    messages = []
    for ckpt in checkpointers:
        if rt.rank == 0:
            fill(Path(fs), leave=BIG)
        torch.distributed.barrier()
        try:
            ckpt.save(6, state(6), {"step": 6})
            ckpt.wait()
        except SnapshotWriteError as err:
            messages.append(str(err))
    return messages


def test_a_full_disk_stops_every_rank_with_the_same_message(tmp_path):
    with small_tmpfs(tmp_path / "fs", "2m") as fs:
        ranks = run_on_ranks(functools.partial(_fill_and_save, str(fs)), 2)
    for sync_or_async in range(2):
        messages = {rank: ranks[rank][sync_or_async] for rank in range(2)}
        print(messages[0])
        assert messages[0].removesuffix(" (written in the background)") == messages[1].removesuffix(
            " (written in the background)"
        )
        assert "no space left on device" in messages[0] and "is whole and untouched" in messages[0]
