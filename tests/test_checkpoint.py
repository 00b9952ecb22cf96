"""Folder snapshots: whole or absent, checksummed, pruned, written in the background from a copy; a crash in
the middle of a background write leaves the previous snapshot the newest whole one."""

from __future__ import annotations

import json
import textwrap

import torch

from ddpkit.checkpoint import MARKER, Checkpointer
from ddpkit.snapshot import save_snapshot


def state(step: int) -> tuple[dict, dict]:
    return {"model": {"w": torch.full((4,), float(step))}}, {"step": step, "rng": torch.arange(3)}


def save(ckpt: Checkpointer, step: int) -> None:
    ckpt.save(step, *state(step))


def load(ckpt: Checkpointer, size: int = 4):
    found = ckpt.latest(warn=lambda msg: None)
    sharded, extra = ckpt.load(found, lambda: {"model": {"w": torch.zeros(size)}})
    return found, sharded, extra


def test_layout_marker_and_pruning(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=2)
    for step in (3, 6, 9):
        save(ckpt, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000009"]
    folder = tmp_path / "step-00000009"
    marker = json.loads((folder / MARKER).read_text())
    assert marker["step"] == 9
    assert set(marker["files"]) == {p.name for p in folder.iterdir()} - {MARKER}
    assert {".metadata", "trainer.pt", "__0_0.distcp"} <= set(marker["files"])
    found, sharded, extra = load(ckpt)
    assert found.step == 9 and torch.equal(sharded["model"]["w"], torch.full((4,), 9.0)) and extra["step"] == 9


def test_a_damaged_file_is_named_and_the_snapshot_before_is_used(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=3)
    save(ckpt, 3)
    save(ckpt, 6)
    shard = tmp_path / "step-00000006" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))
    warnings: list[str] = []
    assert ckpt.latest(warn=warnings.append).step == 3
    assert len(warnings) == 1 and "step-00000006" in warnings[0] and "__0_0.distcp" in warnings[0]


def test_a_folder_without_its_marker_does_not_count_and_is_cleared(tmp_path):
    ckpt = Checkpointer(tmp_path)
    save(ckpt, 3)
    save(ckpt, 6)
    (tmp_path / "step-00000006" / MARKER).unlink()  # what a write killed before its marker leaves
    assert ckpt.latest(warn=print).step == 3
    save(ckpt, 9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000009"]


def test_async_save_writes_the_state_as_it_was_when_saved(tmp_path):
    ckpt = Checkpointer(tmp_path, async_write=True)
    sharded, extra = state(3)
    ckpt.save(3, sharded, extra)
    sharded["model"]["w"].add_(100.0)  # training goes on while the write runs
    ckpt.wait()
    assert torch.equal(load(ckpt)[1]["model"]["w"], torch.full((4,), 3.0))
    # Control: a write from the live tensors (no copy) would see the change.
    live = Checkpointer(tmp_path / "live")
    live.save(3, sharded, extra)
    assert load(live)[1]["model"]["w"][0] == 103.0


def test_single_file_snapshots_of_earlier_versions_are_read(tmp_path):
    save_snapshot(tmp_path, 4, {"model": {"w": torch.ones(2)}, "trainer": {"step": 4}})
    ckpt = Checkpointer(tmp_path)
    found = ckpt.latest()
    assert found.legacy and found.step == 4
    sharded, whole = ckpt.load(found, dict)
    assert sharded is None and whole["trainer"]["step"] == 4
    save(ckpt, 8)  # a newer folder snapshot wins
    assert ckpt.latest().step == 8 and not ckpt.latest().legacy


def test_a_crash_during_a_background_write_leaves_the_previous_snapshot(tmp_path, run_python):
    # SIGKILL from the writer thread while it writes step 6's marker (the training thread is already past
    # save()); the folder of step 6 has all its data but no marker, so step 3 is the newest whole snapshot.
    code = textwrap.dedent(f"""
        import os, signal, torch
        import ddpkit.snapshot
        from ddpkit.checkpoint import Checkpointer
        write = ddpkit.snapshot.write_atomic
        def dying(path, data):
            if path.name == "complete.json" and "00000006" in str(path):
                path.with_name(".complete.json.tmp").write_bytes(data[: len(data) // 2])
                os.kill(os.getpid(), signal.SIGKILL)
            write(path, data)
        ddpkit.snapshot.write_atomic = dying
        ckpt = Checkpointer({str(tmp_path)!r}, async_write=True)
        for step in (3, 6):
            ckpt.save(step, {{"model": {{"w": torch.full((1000,), float(step))}}}}, {{"step": step}})
            print("returned from save", step, flush=True)
        ckpt.wait()
        print("not reached")
    """)
    proc = run_python(code)
    assert proc.returncode == -9 and "returned from save 6" in proc.stdout and "not reached" not in proc.stdout
    assert (tmp_path / "step-00000006" / "__0_0.distcp").exists()  # the data was written: the kill was late
    ckpt = Checkpointer(tmp_path)
    found, sharded, _ = load(ckpt, size=1000)
    assert found.step == 3 and sharded["model"]["w"][0] == 3.0
