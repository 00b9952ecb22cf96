"""Files ddpkit reads that lie, each refused with a message naming the file: a snapshot marker
naming files outside its folder or that are not regular files, a DCP index whose chunks do not cover
its tensors, a memory slot whose tensor bytes changed or whose manifest places a tensor past its
data region, a search journal edited by hand."""

from __future__ import annotations

import json
import os
import struct
import zlib

import pytest
import torch

from ddpkit._errors import ConfigError
from ddpkit.snapshot import _slots as ms
from ddpkit.snapshot import _slots as mslot
from ddpkit.snapshot._disk import INDEX, MARKER, DiskStore
from tests.unit.snapshot.folders import load, reseal, save
from tests.unit.snapshot.slots import save as save_slot
from tests.unit.snapshot.slots import store

# -- the snapshot marker ---------------------------------------------------------------------------


def _point_marker_at(folder, name: str, size: int = 0) -> None:
    marker = json.loads((folder / MARKER).read_text())
    marker["files"][name] = {"size": size, "sha256": "0" * 64}
    (folder / MARKER).write_text(json.dumps(marker))


@pytest.mark.timeout(30)  # the check used to read /dev/zero for ever
@pytest.mark.parametrize(
    "name",
    ["../../../../../../../../../../dev/zero", "/dev/zero", "..", "sub/file"],
    ids=["dotdot-dev-zero", "absolute", "parent", "separator"],
)
def test_a_marker_naming_a_file_outside_its_folder_is_refused_by_name(tmp_path, name):
    ckpt = DiskStore(tmp_path, keep_last=3)
    save(ckpt, 3)
    save(ckpt, 6)
    _point_marker_at(tmp_path / "step-00000006", name)
    warnings: list[str] = []
    assert ckpt.latest(warn=warnings.append).step == 3
    assert (
        len(warnings) == 1
        and "step-00000006" in warnings[0]
        and "not a file of the folder" in warnings[0]
    )
    assert repr(name) in warnings[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["link-to-device", "link-inside", "fifo", "folder"])
def test_a_marker_listing_a_link_a_device_a_fifo_or_a_folder_is_refused_by_name(tmp_path, kind):
    ckpt = DiskStore(tmp_path, keep_last=3)
    save(ckpt, 3)
    save(ckpt, 6)
    folder = tmp_path / "step-00000006"
    if kind == "link-to-device":
        (folder / "extra.bin").symlink_to("/dev/zero")
    elif kind == "link-inside":
        # even a link to a file of the folder
        (folder / "extra.bin").symlink_to(folder / "values.pt")
    elif kind == "fifo":
        os.mkfifo(folder / "extra.bin")
    else:
        (folder / "extra.bin").mkdir()
    _point_marker_at(folder, "extra.bin")
    warnings: list[str] = []
    assert ckpt.latest(warn=warnings.append).step == 3
    assert len(warnings) == 1 and "extra.bin that is not a regular file" in warnings[0], warnings


def test_a_marker_that_is_itself_a_link_to_a_device_is_refused(tmp_path):
    ckpt = DiskStore(tmp_path, keep_last=3)
    save(ckpt, 3)
    save(ckpt, 6)
    marker = tmp_path / "step-00000006" / MARKER
    marker.unlink()
    marker.symlink_to("/dev/zero")
    warnings: list[str] = []
    assert ckpt.latest(warn=warnings.append).step == 3
    assert "unreadable complete.json" in warnings[0]


def test_an_index_not_listed_in_the_marker_is_refused(tmp_path):
    ckpt = DiskStore(tmp_path)
    save(ckpt, 3)
    folder = tmp_path / "step-00000003"
    marker = json.loads((folder / MARKER).read_text())
    del marker["files"][INDEX]
    (folder / MARKER).write_text(json.dumps(marker))
    (folder / INDEX).unlink()
    # never read: it is not one of the files the marker vouches for
    (folder / INDEX).symlink_to("/dev/zero")
    with pytest.raises(
        ConfigError, match=f"{INDEX} is not an index ddpkit wrote .{MARKER} does not list it"
    ):
        load(ckpt)


# -- the DCP index ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "chunks, refusal",
    [
        ([], "covering 0 of its 4 elements"),
        ([{"offsets": [0], "sizes": [2]}], "covering 2 of its 4 elements"),
        ([{"offsets": [2], "sizes": [4]}], "that lies outside it"),
        (
            [{"offsets": [0], "sizes": [2]}, {"offsets": [1], "sizes": [2]}],
            "covering 4 of its 4|two chunks that overlap",
        ),
        ([{"offsets": [0, 0], "sizes": [4, 1]}], "another number of dimensions"),
    ],
    ids=["no-chunks", "half", "outside", "overlap", "dimensions"],
)
def test_an_index_whose_chunks_do_not_cover_each_tensor_exactly_is_refused_naming_file_and_key(
    tmp_path, chunks, refusal
):
    ckpt = DiskStore(tmp_path)
    save(ckpt, 3)
    folder = tmp_path / "step-00000003"
    index = json.loads((folder / INDEX).read_text())
    index["tensors"]["model.w"]["chunks"] = chunks
    (folder / INDEX).write_text(json.dumps(index))
    reseal(folder)
    with pytest.raises(
        ConfigError, match=f"{folder / INDEX} is not an index ddpkit wrote .tensor 'model.w'"
    ) as info:
        load(ckpt)
    assert any(part in str(info.value) for part in refusal.split("|")), str(info.value)


def test_a_chunk_that_no_data_file_holds_is_refused(tmp_path):
    ckpt = DiskStore(tmp_path)
    save(ckpt, 3)
    folder = tmp_path / "step-00000003"
    index = json.loads((folder / INDEX).read_text())
    index["storage"] = [e for e in index["storage"] if e["fqn"] != "model.w"]
    (folder / INDEX).write_text(json.dumps(index))
    reseal(folder)
    with pytest.raises(
        ConfigError, match="tensor 'model.w' has a chunk at .0. that no data file holds"
    ):
        load(ckpt)


# -- memory slots ----------------------------------------------------------------------------------


def _newest(st: ms.Slots) -> ms.Found:
    return max(st.found(), key=lambda f: f.step)


def test_a_slot_whose_tensor_bytes_changed_is_refused_naming_it(tmp_path):
    st = store(tmp_path)
    save_slot(st, 1, [torch.full((16,), -0.098)])
    save_slot(st, 2, [torch.full((16,), -0.099)])
    newest = _newest(st)
    raw = bytearray(newest.path.read_bytes())
    record = mslot.Record.unpack(bytes(raw[: mslot.HEADER]))
    assert record is not None
    # one weight, as a stray write would
    raw[record.data[0] : record.data[0] + 4] = struct.pack("<f", 999.9)
    newest.path.write_bytes(bytes(raw))
    # The record, manifest and values still check: the slot is found, and refused when its tensors
    # are read.
    assert sorted(f.step for f in st.found()) == [1, 2]
    with pytest.raises(
        mslot.BadSlot, match=f"{newest.path}: its tensors' bytes fail their checksum"
    ):
        mslot.read_slot(newest.path, data=True)
    older = min(st.found(), key=lambda f: f.step)
    # control: the slot before is whole, and loads as saved
    got = mslot.read_slot(older.path, data=True)
    assert got is not None and torch.equal(
        mslot.tensors_of(got[3], got[0], got[1])[0], torch.full((16,), -0.098)
    )


@pytest.mark.parametrize(
    "lie, refusal",
    [
        (
            lambda m, size: m["specs"][0].__setitem__(2, size + 64),
            "lies past the end of the data region",
        ),
        (
            lambda m, size: m["specs"][0].__setitem__(1, [2, 8, 1000]),
            "lies past the end of the data region",
        ),
        (lambda m, size: m["specs"][0].__setitem__(0, "torch.object"), "unknown dtype"),
        (lambda m, size: m["specs"][0].__setitem__(2, 3), "not an aligned position"),
        (lambda m, size: m.__setitem__("data_size", size * 2), "data size is not its record's"),
    ],
    ids=["offset", "shape", "dtype", "misaligned", "data-size"],
)
def test_a_manifest_that_lies_with_a_valid_crc_is_refused_before_any_tensor_is_viewed(
    tmp_path, lie, refusal
):
    st = store(tmp_path)
    save_slot(st, 1, [torch.ones(2, 8), torch.zeros(3)])
    (found,) = st.found()
    raw = bytearray(found.path.read_bytes())
    record = mslot.Record.unpack(bytes(raw[: mslot.HEADER]))
    assert record is not None
    off, length, _ = record.manifest
    manifest = json.loads(raw[off : off + length])
    lie(manifest, record.data[1])
    text = json.dumps(manifest).encode()
    raw[off : off + len(text)] = text
    lied = mslot.Record(
        record.begin, record.end, (off, len(text), zlib.crc32(text)), record.values, record.data
    )
    raw[: len(lied.pack())] = lied.pack()
    found.path.write_bytes(bytes(raw))
    with pytest.raises(mslot.BadSlot, match=f"{found.path}: .*{refusal}"):
        mslot.read_slot(found.path, data=True)


# -- the search journal ----------------------------------------------------------------------------


@pytest.fixture
def journal(tmp_path):
    from ddpkit.search._config import SearchConfig
    from ddpkit.search._study import JOURNAL, open_search_study

    cfg = SearchConfig(n_trials=2, search_dir=str(tmp_path))
    study = open_search_study(cfg, {}, create=True).study
    study.set_user_attr("a", 1)
    study.ask()
    return cfg, tmp_path / JOURNAL


@pytest.mark.parametrize(
    "line, what",
    [
        (b"{}", "op_code None is not one of Optuna's operations"),
        (b'{"op_code": 99, "worker_id": "w"}', "op_code 99 is not one of Optuna's operations"),
        (b'{"op_code": 4, "worker_id": "w"}', "Optuna cannot replay it"),
        (b"[1, 2]", "a JSON list, not an object"),
    ],
    ids=["empty", "unknown-op", "missing-fields", "list"],
)
def test_a_hand_edited_journal_is_refused_naming_the_file_and_line(journal, line, what):
    from ddpkit.search._study import open_search_study

    cfg, path = journal
    lines = path.read_bytes().split(b"\n")[:-1]
    lines.insert(2, line)  # the third of five lines
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ConfigError) as info:
        open_search_study(cfg, {}, create=False)
    message = str(info.value)
    assert f"journal {path} is damaged at line 3 of {len(lines)}: {what}" in message, message
    assert "database server" not in message
