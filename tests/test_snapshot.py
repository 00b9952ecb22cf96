"""Snapshots are whole or absent; a damaged one is named and skipped for the one before it."""

from __future__ import annotations

import json

import pytest
import torch

from ddpkit.snapshot import list_snapshots, load_latest, save_snapshot


def state(step: int) -> dict:
    return {"step": step, "w": torch.full((4,), float(step)), "rng": (3, tuple(range(5)), None)}


def test_newest_whole_snapshot_is_loaded_and_old_ones_pruned(tmp_path):
    for step in (3, 6, 9, 12):
        save_snapshot(tmp_path, step, state(step), keep_last=2)
    assert [s.step for s in list_snapshots(tmp_path)] == [12, 9]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000009.json", "step-00000009.pt", "step-00000012.json", "step-00000012.pt"
    ]
    info, loaded = load_latest(tmp_path)
    assert info.step == 12 and torch.equal(loaded["w"], torch.full((4,), 12.0))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_snapshot_is_reported_by_name_and_skipped(tmp_path, damage):
    save_snapshot(tmp_path, 3, state(3), keep_last=3)
    info = save_snapshot(tmp_path, 6, state(6), keep_last=3)
    data = info.path.read_bytes()
    if damage == "truncate":
        info.path.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        info.path.write_bytes(data[:-10] + bytes(b ^ 0xFF for b in data[-10:]))
    else:
        info.path.unlink()
    warnings: list[str] = []
    found, loaded = load_latest(tmp_path, warn=warnings.append)
    assert found.step == 3 and loaded["step"] == 3
    assert len(warnings) == 1 and "step-00000006.pt" in warnings[0]


def test_a_write_killed_before_its_manifest_leaves_the_previous_snapshot(tmp_path):
    save_snapshot(tmp_path, 3, state(3))
    # what a kill leaves: a half temporary file, and a whole .pt whose manifest was never written
    (tmp_path / ".step-00000009.pt.tmp").write_bytes(b"half")
    torch.save(state(6), tmp_path / "step-00000006.pt")
    assert [s.step for s in list_snapshots(tmp_path)] == [3]
    assert load_latest(tmp_path)[0].step == 3
    # the next save clears the debris
    save_snapshot(tmp_path, 12, state(12))
    names = {p.name for p in tmp_path.iterdir()}
    assert ".step-00000009.pt.tmp" not in names and "step-00000006.pt" not in names


def test_no_snapshot_and_unreadable_manifest(tmp_path):
    assert load_latest(tmp_path / "missing") is None
    (tmp_path / "step-00000001.json").write_text("{not json")
    assert load_latest(tmp_path) is None


def test_snapshots_load_without_running_pickled_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("this ran",))

    save_snapshot(tmp_path, 1, {"obj": Evil()})
    with pytest.raises(Exception, match="[Ww]eights only"):
        load_latest(tmp_path)


def test_manifest_records_size_and_checksum(tmp_path):
    info = save_snapshot(tmp_path, 5, state(5))
    meta = json.loads((tmp_path / "step-00000005.json").read_text())
    assert meta == {"step": 5, "file": "step-00000005.pt", "size": info.size, "sha256": info.sha256}
    assert info.path.stat().st_size == info.size
