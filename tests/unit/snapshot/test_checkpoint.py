"""Folder snapshots in one process: whole or absent, checksummed, pruned, written in the background
from a copy; a tampered folder runs no code on load; a full disk (a real tmpfs) is named, with the
previous snapshot left whole."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ddpkit._errors import ConfigError
from ddpkit.snapshot import _dcp as dcp_files
from ddpkit.snapshot._disk import (
    INDEX,
    MARKER,
    VALUES,
    DiskStore,
    SnapshotWriteError,
)
from tests.tmpfs import fill, small_tmpfs
from tests.unit.snapshot.folders import load, reseal, save, state


def test_layout_marker_and_pruning(tmp_path):
    ckpt = DiskStore(tmp_path, keep_last=2)
    for step in (3, 6, 9):
        save(ckpt, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000006", "step-00000009"]
    folder = tmp_path / "step-00000009"
    marker = json.loads((folder / MARKER).read_text())
    assert marker["step"] == 9
    assert set(marker["files"]) == {p.name for p in folder.iterdir()} - {MARKER}
    assert {".metadata", "values.pt", "__0_0.distcp"} <= set(marker["files"])
    found, sharded, extra = load(ckpt)
    assert (
        found.step == 9
        and torch.equal(sharded["model"]["w"], torch.full((4,), 9.0))
        and extra["step"] == 9
    )


def test_a_damaged_file_is_named_and_the_snapshot_before_is_used(tmp_path):
    ckpt = DiskStore(tmp_path, keep_last=3)
    save(ckpt, 3)
    save(ckpt, 6)
    shard = tmp_path / "step-00000006" / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))
    warnings: list[str] = []
    assert ckpt.latest(warn=warnings.append).step == 3
    assert len(warnings) == 1 and "step-00000006" in warnings[0] and "__0_0.distcp" in warnings[0]


def test_a_folder_without_its_marker_does_not_count_and_is_cleared(tmp_path):
    ckpt = DiskStore(tmp_path)
    save(ckpt, 3)
    save(ckpt, 6)
    (tmp_path / "step-00000006" / MARKER).unlink()  # what a write killed before its marker leaves
    assert ckpt.latest(warn=print).step == 3
    save(ckpt, 9)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000009"]


def _stray(snapshots, kind: str, other_run) -> str:
    """Put a folder named like a snapshot newer than the run's, that is not one, into
    ``snapshots``; what its warning names."""
    stray = snapshots / "step-00000099"
    if kind == "copy":  # cp -a step-00000002 step-00000099
        shutil.copytree(snapshots / "step-00000002", stray, symlinks=True)
        return "records step 2"
    if kind == "link":  # to another run's snapshot
        DiskStore(other_run, keep_last=3).save(2, *state(2))
        stray.symlink_to(other_run / "step-00000002", target_is_directory=True)
        return "is a link"
    if kind == "unpadded":  # a copy given a name ddpkit never gives, its marker made to agree
        stray = snapshots / "step-99"
        shutil.copytree(snapshots / "step-00000002", stray)
        marker = json.loads((stray / MARKER).read_text())
        (stray / MARKER).write_text(json.dumps(marker | {"step": 99}))
        return "step-00000099"
    shutil.copytree(snapshots / "step-00000002", stray)
    marker = stray / MARKER
    marker.write_bytes(marker.read_bytes()[:20])
    return f"unreadable {MARKER}"


@pytest.mark.parametrize("kind", ["copy", "link", "unpadded", "unreadable-marker"])
def test_a_folder_named_like_a_newer_snapshot_that_is_not_one_is_never_loaded_nor_kept(
    tmp_path, kind
):
    snapshots, other_run = tmp_path / "snapshots", tmp_path / "other-run"
    ckpt = DiskStore(snapshots, keep_last=3)
    for step in (2, 4, 6):
        save(ckpt, step)
    named = _stray(snapshots, kind, other_run)
    stray = next(p for p in snapshots.iterdir() if p.name.endswith("99"))
    warnings: list[str] = []
    found = ckpt.latest(warn=warnings.append)
    assert found.step == 6 and found.path == snapshots / "step-00000006"
    assert len(warnings) == 1 and str(stray) in warnings[0] and named in warnings[0], warnings
    assert [f.step for f in ckpt.candidates()] == [6, 4, 2]
    sharded, extra = ckpt.load(found, lambda: {"model": {"w": torch.zeros(4)}})
    assert extra["step"] == 6 and torch.equal(sharded["model"]["w"], torch.full((4,), 6.0))
    # The stray is left as it is (newer than any snapshot: each resume names it); the prune keeps
    # the newest 3 whole snapshots, never counting it among them.
    save(ckpt, 8)
    assert sorted(p.name for p in snapshots.iterdir()) == sorted(
        ["step-00000004", "step-00000006", "step-00000008", stray.name]
    )
    # Control: a whole snapshot newer than the stray is loaded, and the prune then removes the
    # stray, older than it, as it would an old snapshot (a link loses only itself).
    save(ckpt, 120)
    warnings.clear()
    assert ckpt.latest(warn=warnings.append).step == 120 and not warnings
    assert sorted(p.name for p in snapshots.iterdir()) == [
        "step-00000006",
        "step-00000008",
        "step-00000120",
    ]
    if kind == "link":  # never followed: the other run's snapshot is whole
        assert DiskStore(other_run).latest(warn=warnings.append).step == 2 and not warnings


def test_a_marker_that_records_another_step_is_named_and_the_snapshot_before_is_used(tmp_path):
    ckpt = DiskStore(tmp_path, keep_last=3)
    save(ckpt, 3)
    save(ckpt, 6)
    marker = tmp_path / "step-00000006" / MARKER
    recorded = json.loads(marker.read_text())
    marker.write_text(json.dumps(recorded | {"step": 7}))
    warnings: list[str] = []
    assert ckpt.latest(warn=warnings.append).step == 3
    assert len(warnings) == 1 and "step-00000006" in warnings[0] and "records step 7" in warnings[0]
    # Control: the marker as written.
    marker.write_text(json.dumps(recorded))
    assert ckpt.latest(warn=warnings.append).step == 6 and len(warnings) == 1


def test_a_partial_folder_of_any_step_is_cleared_without_a_warning(tmp_path):
    ckpt = DiskStore(tmp_path, keep_last=3)
    for step in (2, 4, 6):
        save(ckpt, step)
    for partial in ("step-00000005", "step-00000099"):  # a write killed before its marker
        (tmp_path / partial).mkdir()
        shutil.copy(tmp_path / "step-00000006" / VALUES, tmp_path / partial)
    warnings: list[str] = []
    assert ckpt.latest(warn=warnings.append).step == 6 and not warnings
    save(ckpt, 8)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000004",
        "step-00000006",
        "step-00000008",
    ]


def test_async_save_writes_the_state_as_it_was_when_saved(tmp_path):
    ckpt = DiskStore(tmp_path, async_write=True)
    sharded, extra = state(3)
    ckpt.save(3, sharded, extra)
    sharded["model"]["w"].add_(100.0)  # training goes on while the write runs
    ckpt.wait()
    assert torch.equal(load(ckpt)[1]["model"]["w"], torch.full((4,), 3.0))
    # Control: a write from the live tensors (no copy) would see the change.
    live = DiskStore(tmp_path / "live")
    live.save(3, sharded, extra)
    assert load(live)[1]["model"]["w"][0] == 103.0


class RunsCode:
    """Unpickling this object creates the file ``path``: what a tampered snapshot could do
    instead."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_crafted_dcp_index_is_never_unpickled(tmp_path):
    ckpt = DiskStore(tmp_path / "snapshots")
    save(ckpt, 3)
    folder, ran = tmp_path / "snapshots" / "step-00000003", tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(RunsCode(ran)))
    reseal(folder)
    found, sharded, extra = load(ckpt)  # reads the JSON index; .metadata is left alone
    assert (
        not ran.exists()
        and found.step == 3
        and torch.equal(sharded["model"]["w"], torch.full((4,), 3.0))
    )
    # Control: torch's own reader unpickles .metadata, and the code runs.
    with contextlib.suppress(BaseException):
        dcp.load({"model": {"w": torch.zeros(4)}}, checkpoint_id=folder)
    assert ran.exists()


def test_a_crafted_non_tensor_item_is_never_unpickled(tmp_path):
    ran = tmp_path / "ran"
    # Control: DCP stores a non-tensor value as a pickle, and its default planner runs it on load.
    stock = tmp_path / "stock"
    dcp.save({"w": torch.ones(4), "hp": RunsCode(ran)}, checkpoint_id=stock)
    assert not ran.exists()
    dcp.load({"w": torch.zeros(4), "hp": None}, checkpoint_id=stock)
    assert ran.exists()
    ran.unlink()
    # ddpkit's planner refuses the same item (reached only past the JSON index, which admits no such
    # item).
    with open(stock / ".metadata", "rb") as f:
        trusted = pickle.load(f)  # written by this test: safe to unpickle here
    with pytest.raises(BaseException, match="not a tensor: refusing to unpickle it"):
        dcp.load(
            {"w": torch.zeros(4), "hp": None},
            storage_reader=dcp_files.Reader(stock, trusted),
            planner=dcp_files.TensorsOnlyPlanner(),
        )
    assert not ran.exists()
    # A snapshot whose index declares an item that is not a tensor is refused by name.
    ckpt = DiskStore(tmp_path / "snapshots")
    save(ckpt, 3)
    folder = tmp_path / "snapshots" / "step-00000003"
    index = json.loads((folder / INDEX).read_text())
    index["tensors"]["hp"] = {"bytes": True}
    (folder / INDEX).write_text(json.dumps(index))
    reseal(folder)
    with pytest.raises(
        ConfigError, match="is not an index ddpkit wrote .item 'hp' is not a tensor"
    ):
        load(ckpt)
    # A tensor entry pointing at a pickle instead of tensor data: torch's weights_only loader
    # refuses it.
    payload = io.BytesIO()
    torch.save(RunsCode(ran), payload)
    (folder / "__0_0.distcp").write_bytes(payload.getvalue())
    del index["tensors"]["hp"]
    index["storage"][0].update(at=0, length=len(payload.getvalue()))
    (folder / INDEX).write_text(json.dumps(index))
    reseal(folder)
    with pytest.raises(
        RuntimeError, match="loading snapshot .* failed: .*Weights only load failed"
    ):
        load(ckpt)
    assert not ran.exists()
    torch.load(folder / "__0_0.distcp", weights_only=False)  # control: unpickled, it runs
    assert ran.exists()


@pytest.mark.parametrize(
    "change, refusal",
    [
        ({"file": "../../elsewhere"}, "not a data file of the folder"),
        ({"offset": ["0"]}, "not a list of non-negative integers"),
        ({"fqn": ["model.w"]}, "a storage entry names no tensor of the index"),
    ],
)
def test_an_index_pointing_outside_its_folder_or_malformed_is_refused(tmp_path, change, refusal):
    ckpt = DiskStore(tmp_path)
    save(ckpt, 3)
    folder = tmp_path / "step-00000003"
    index = json.loads((folder / INDEX).read_text())
    index["storage"][0].update(change)
    (folder / INDEX).write_text(json.dumps(index))
    reseal(folder)
    with pytest.raises(ConfigError, match=refusal):
        load(ckpt)


def test_a_trainer_state_holding_code_or_of_another_format_is_refused(tmp_path):
    ckpt = DiskStore(tmp_path / "snapshots")
    save(ckpt, 3)
    folder, ran = tmp_path / "snapshots" / "step-00000003", tmp_path / "ran"
    good = (folder / VALUES).read_bytes()
    torch.save(
        {"format": 2, "world_size": 1, "values": {}, "differences": [{}], "extra": RunsCode(ran)},
        folder / VALUES,
    )
    reseal(folder)
    with pytest.raises(
        ConfigError, match="values.pt holds objects other than tensors and plain values"
    ):
        load(ckpt)
    assert not ran.exists()
    torch.load(folder / VALUES, weights_only=False)  # control: unpickled, it runs
    assert ran.exists()
    # A folder of another format (here: format 2's values, plain data) is refused by name.
    torch.save(
        {"format": 2, "world_size": 1, "values": {}, "differences": [{}], "extra": {"step": 3}},
        folder / VALUES,
    )
    reseal(folder)
    with pytest.raises(
        ConfigError,
        match="written by another version of ddpkit.*format 2, this version reads format "
        "3.*resume=False",
    ):
        load(ckpt)
    # Values that the codec never writes (an unknown tag), in a file of this format: refused by
    # name.
    torch.save({"format": 3, "values": '{"zz": 1}', "tensors": []}, folder / VALUES)
    reseal(folder)
    with pytest.raises(ConfigError, match="values.pt holds values that ddpkit never writes"):
        load(ckpt)
    (folder / VALUES).write_bytes(good)  # control: the file as written loads
    reseal(folder)
    load(ckpt)


BIG = 50_000  # floats: 200 kB, more than a file's write buffer, as real states are


@pytest.mark.parametrize("async_write", [False, True], ids=["sync", "async"])
def test_a_full_disk_is_named_and_the_previous_snapshot_stays_whole(tmp_path, async_write):
    with small_tmpfs(tmp_path / "fs", "1m") as fs:
        ckpt = DiskStore(fs / "snapshots", async_write=async_write)
        ckpt.save(3, {"model": {"w": torch.full((BIG,), 3.0)}}, {"step": 3})
        ckpt.wait()
        fill(fs, leave=BIG)  # room for part of the next snapshot
        with pytest.raises(SnapshotWriteError) as info:
            ckpt.save(6, {"model": {"w": torch.full((BIG,), 6.0)}}, {"step": 6})
            ckpt.wait()
        message = str(info.value)
        print(message)
        assert (
            "no space left on device" in message
            and f"snapshot {fs / 'snapshots' / 'step-00000006'} " in message
        )
        assert f"the previous snapshot, {fs / 'snapshots' / 'step-00000003'}, is whole" in message
        assert ("(written in the background)" in message) == async_write
        assert not (fs / "snapshots" / "step-00000006").exists()  # nothing half-written is left
        found, sharded, extra = load(ckpt, size=BIG)
        assert found.step == 3 and torch.equal(sharded["model"]["w"], torch.full((BIG,), 3.0))
        # Control: torch's own writer, on the same disk filling up, does not say why.
        fill(fs, leave=BIG)
        with pytest.raises(BaseException) as stock:
            dcp.save({"w": torch.ones(BIG)}, checkpoint_id=fs / "stock")
        print(f"torch's own writer: {str(stock.value).strip().splitlines()[-1]}")
        assert "no space" not in str(stock.value).lower()


def test_a_snapshot_folder_that_cannot_be_made_is_named(tmp_path):
    ckpt = DiskStore(tmp_path)
    save(ckpt, 3)
    (tmp_path / "step-00000006").write_text("a file where the folder goes")
    with pytest.raises(
        SnapshotWriteError,
        match=r"step-00000006 was not written: File exists \(rank 0 writing "
        r"step-00000006\).*the previous snapshot, .*step-00000003, is whole",
    ):
        save(ckpt, 6)
    assert ckpt.latest().step == 3


def test_shared_tensors_are_each_written_by_one_rank_with_the_bytes_spread_evenly():
    from ddpkit.snapshot._disk import stored_parts, writer_of_shared

    sizes = [(("model", f"w{i}"), 4 * (i % 7 + 1)) for i in range(50)]
    writer = writer_of_shared(sizes, 4)
    # every rank the same answer, in any order
    assert writer == writer_of_shared(list(reversed(sizes)), 4)
    assert sorted(writer) == sorted(p for p, _ in sizes)
    loads = [sum(n for p, n in sizes if writer[p] == r) for r in range(4)]
    assert max(loads) - min(loads) <= max(n for _, n in sizes), loads
    # A state: the shared tensors split without overlap over the ranks, each rank's own part kept by
    # it.
    state = {
        "model": {f"w{i}": torch.zeros(i + 1) for i in range(9)},
        "per_rank": {"model": {"b": torch.ones(1)}},
    }
    parts = [stored_parts(state, r, replicated_over=3)[0] for r in range(3)]
    shared = [set(p["model"]) - {"b"} for p in parts]
    assert set().union(*shared) == {f"w{i}" for i in range(9)} and sum(map(len, shared)) == 9
    assert "b" in parts[0]["model"] and "b" in parts[1]["per_rank"]["rank1"]["model"]
    # not replicated: all
    assert stored_parts(state, 1)[0]["model"].keys() == {f"w{i}" for i in range(9)}


def test_a_ranks_own_values_are_a_file_of_its_own_read_back_only_when_the_marker_lists_it(tmp_path):
    ckpt = DiskStore(tmp_path / "snapshots")
    ckpt.save(3, *state(3), own={"streams": torch.arange(3), "seed": 7})
    found = ckpt.latest(warn=lambda msg: None)
    (own,) = ckpt.read_own(found, [0])
    assert own["seed"] == 7 and torch.equal(own["streams"], torch.arange(3))
    # digested, checked by latest()
    assert "rank0.pt" in json.loads((found.path / MARKER).read_text())["files"]
    with pytest.raises(ConfigError, match="holds no values of rank 1"):
        ckpt.read_own(found, [1])
    ran = tmp_path / "ran"
    torch.save(RunsCode(ran), found.path / "rank0.pt")
    reseal(found.path)
    with pytest.raises(
        ConfigError, match="rank0.pt holds objects other than tensors and plain values"
    ):
        ckpt.read_own(found, [0])
    assert not ran.exists()
