"""Every format ddpkit reads, fuzzed: the snapshot marker, the DCP index, a memory slot (record,
manifest, values and tensor bytes), the search journal and the stream line index, truncated,
flipped, spliced and made to lie about sizes, offsets, chunks and paths. Each mutation is refused
with a message naming the file, or loads exactly what was saved; never a hang (each test has a time
limit), never a different state.

The default run tries 40 mutations per test (seconds); ``DDPKIT_FUZZ_EXAMPLES=2000`` tries as many
as asked. (``config.json`` in a run directory is written for people and tools, and read by no part
of ddpkit.)
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ddpkit._errors import ConfigError
from ddpkit.snapshot import _slots as mslot
from ddpkit.snapshot._disk import INDEX, MARKER, DiskStore
from tests.fuzz import examples
from tests.unit.snapshot.folders import reseal, save
from tests.unit.snapshot.slots import save as save_slot
from tests.unit.snapshot.slots import store

FAST = examples(40)


# -- mutations of bytes ----------------------------------------------------------------------------


@st.composite
def byte_mutation(draw: st.DrawFn, size: int) -> tuple[str, int, int, bytes]:
    """(kind, at, length, payload): truncate at, flip a byte at, splice payload over [at, at +
    length)."""
    kind = draw(st.sampled_from(["truncate", "flip", "splice"]))
    at = draw(st.integers(0, max(size - 1, 0)))
    length = draw(st.integers(0, 64))
    payload = draw(st.binary(max_size=64))
    return kind, at, length, payload


def mutate(data: bytes, mutation: tuple[str, int, int, bytes]) -> bytes:
    kind, at, length, payload = mutation
    at = min(at, max(len(data) - 1, 0))
    if kind == "truncate":
        return data[:at]
    if kind == "flip":
        return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :] if data else data
    return data[:at] + payload + data[at + length :]


# -- the snapshot marker ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory) -> Path:
    """Two whole snapshots, steps 3 and 6, to copy into each example."""
    folder = tmp_path_factory.mktemp("snapshots")
    ckpt = DiskStore(folder, keep_last=3)
    save(ckpt, 3)
    save(ckpt, 6)
    return folder


def fresh(snapshots: Path, tmp: Path) -> Path:
    target = tmp / "snapshots"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(snapshots, target)
    return target


def load_latest(folder: Path) -> tuple[int | None, list[str], torch.Tensor | None]:
    """(step loaded, warnings, w) or the refusal raised, from whatever the folder now holds."""
    ckpt = DiskStore(folder)
    warnings: list[str] = []
    found = ckpt.latest(warn=warnings.append)
    if found is None:
        return None, warnings, None
    state, extra = ckpt.load(found, lambda: {"model": {"w": torch.zeros(4)}})
    assert extra["step"] == found.step
    return found.step, warnings, state["model"]["w"]


def check_outcome(folder: Path, what: str) -> None:
    """Refused naming the file, or the newest whole snapshot loaded exactly as saved."""
    try:
        step, warnings, w = load_latest(folder)
    except (ConfigError, RuntimeError) as err:
        assert "step-00000006" in str(err), f"{what}: a refusal that names no file: {err}"
        return
    if step == 6:
        assert not warnings, f"{what}: step 6 loaded after a warning: {warnings}"
    else:
        assert step == 3 and warnings and "step-00000006" in warnings[0], (what, step, warnings)
    assert w is not None and torch.equal(w, torch.full((4,), float(step))), (
        f"{what}: another state loaded: {w}"
    )


name_lies = st.sampled_from(
    [
        "../../../../../../../../../../../../dev/zero",
        "/dev/zero",
        "..",
        ".",
        "",
        "a/b",
        "x\x00y",
        "values.pt/",
    ]
)
entry_lies = st.one_of(
    st.none(),
    st.integers(-5, 10**12),
    st.dictionaries(
        st.sampled_from(["size", "sha256"]), st.one_of(st.integers(-1, 10**6), st.text(max_size=70))
    ),
)


@pytest.mark.timeout(60)
@FAST
@given(mutation=byte_mutation(400))
def test_marker_bytes_mutated(tmp_path_factory, snapshots, mutation):
    folder = fresh(snapshots, tmp_path_factory.mktemp("m"))
    marker = folder / "step-00000006" / MARKER
    marker.write_bytes(mutate(marker.read_bytes(), mutation))
    check_outcome(folder, f"marker {mutation}")


@pytest.mark.timeout(60)
@FAST
@given(name=name_lies, entry=entry_lies, replace=st.booleans())
def test_marker_lies_about_names_and_sizes(tmp_path_factory, snapshots, name, entry, replace):
    folder = fresh(snapshots, tmp_path_factory.mktemp("m"))
    marker_path = folder / "step-00000006" / MARKER
    marker = json.loads(marker_path.read_text())
    if replace:  # a listed file's entry made to lie
        marker["files"]["values.pt"] = entry
    else:
        marker["files"][name] = entry if entry is not None else {"size": 0, "sha256": "0" * 64}
    marker_path.write_text(json.dumps(marker))
    check_outcome(folder, f"marker {name!r}: {entry!r}")


# -- the DCP index ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@FAST
@given(mutation=byte_mutation(600))
def test_index_bytes_mutated_and_resealed(tmp_path_factory, snapshots, mutation):
    folder = fresh(snapshots, tmp_path_factory.mktemp("i"))
    index = folder / "step-00000006" / INDEX
    index.write_bytes(mutate(index.read_bytes(), mutation))
    reseal(folder / "step-00000006")  # whoever edits the folder can rewrite the checksums too
    check_outcome(folder, f"index {mutation}")


ints = st.one_of(st.integers(-3, 12), st.just(2**62), st.text(max_size=3), st.none())


@pytest.mark.timeout(60)
@FAST
@given(
    chunks=st.lists(
        st.fixed_dictionaries(
            {"offsets": st.lists(ints, max_size=2), "sizes": st.lists(ints, max_size=2)}
        ),
        max_size=3,
    ),
    size=st.lists(ints, max_size=2),
    storage=st.fixed_dictionaries(
        {
            "at": ints,
            "length": ints,
            "file": st.sampled_from(["__0_0.distcp", "../x", "values.pt", "__9_9.distcp"]),
        }
    ),
    which=st.sampled_from(["chunks", "size", "storage"]),
)
def test_index_lies_about_chunks_sizes_and_offsets(
    tmp_path_factory, snapshots, chunks, size, storage, which
):
    folder = fresh(snapshots, tmp_path_factory.mktemp("i"))
    path = folder / "step-00000006" / INDEX
    index = json.loads(path.read_text())
    if which == "chunks":
        index["tensors"]["model.w"]["chunks"] = chunks
    elif which == "size":
        index["tensors"]["model.w"]["size"] = size
    else:
        index["storage"][0].update(storage)
    path.write_text(json.dumps(index))
    reseal(folder / "step-00000006")
    check_outcome(folder, f"index {which}: {chunks, size, storage}")


# -- memory slots ----------------------------------------------------------------------------------

SAVED = [torch.linspace(-1, 1, 40).reshape(5, 8), torch.arange(7), torch.tensor([True, False])]


class Bytes(bytes):
    """A slot's bytes, shown short in a failing example's report."""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes>"


@pytest.fixture(scope="module")
def slot_bytes(tmp_path_factory) -> bytes:
    folder = tmp_path_factory.mktemp("slots")
    save_slot(store(folder), 4, SAVED, {"note": [1, 2.5, "x"]})
    (path,) = folder.glob("*.slot")
    return Bytes(path.read_bytes())


def check_slot(path: Path, what: str) -> None:
    try:
        got = mslot.read_slot(path, data=True)
    except mslot.BadSlot as err:
        assert str(path) in str(err), f"{what}: a refusal that names no file: {err}"
        return
    if got is None:  # not whole: never found
        return
    record, manifest, values, data = got
    tensors = mslot.tensors_of(data, record, manifest)
    assert values["values"] == {"note": [1, 2.5, "x"]} and values["step"] == 4, what
    if [(t.dtype, t.shape) for t in tensors] != [(t.dtype, t.shape) for t in SAVED]:
        # Another layout than the state's: the Trainer refuses it before it copies anything (every
        # tensor of its state present, of its shape and dtype: ddpkit.snapshot._memory.MemoryStore).
        return
    assert all(torch.equal(a, b) for a, b in zip(tensors, SAVED)), (
        f"{what}: other values in the same layout"
    )


def slot_regions(data: bytes) -> dict[str, tuple[int, int]]:
    record = mslot.Record.unpack(data[: mslot.HEADER])
    assert record is not None
    return {
        "record": (0, 128),
        "manifest": record.manifest[:2],
        "values": record.values[:2],
        "tensors": record.data[:2],
        "anywhere": (0, len(data)),
    }


@pytest.mark.timeout(60)
@FAST
@given(
    data=st.data(), region=st.sampled_from(["record", "manifest", "values", "tensors", "anywhere"])
)
def test_slot_bytes_mutated(tmp_path_factory, slot_bytes, data, region):
    start, length = slot_regions(slot_bytes)[region]
    kind, at, n, payload = data.draw(byte_mutation(max(length, 1)))
    mutation = (kind, start + at, n, payload)
    path = tmp_path_factory.mktemp("s") / "run-a-rank0-0.slot"
    path.write_bytes(mutate(slot_bytes, mutation))
    check_slot(path, f"slot {region} {mutation}")


json_lies = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=8)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@pytest.mark.timeout(60)
@FAST
@given(
    key=st.sampled_from(
        ["specs", "data_size", "spec-offset", "spec-shape", "spec-dtype", "values"]
    ),
    lie=json_lies,
)
def test_slot_manifest_and_values_lie_with_valid_crcs(tmp_path_factory, slot_bytes, key, lie):
    raw = bytearray(slot_bytes)
    record = mslot.Record.unpack(slot_bytes[: mslot.HEADER])
    assert record is not None
    part = "values" if key == "values" else "manifest"
    off, length, _ = getattr(record, part)
    doc = json.loads(raw[off : off + length])
    if key == "values":
        doc["values"] = lie
    elif key.startswith("spec-"):
        doc["specs"][0][["spec-dtype", "spec-shape", "spec-offset"].index(key)] = lie
    else:
        doc[key] = lie
    text = json.dumps(doc).encode()
    room = (record.values[0] if part == "manifest" else record.data[0]) - off
    if len(text) > room:
        return  # would overwrite the next part: other mutations cover that
    raw[off : off + len(text)] = text
    parts = {"manifest": record.manifest, "values": record.values}
    parts[part] = (off, len(text), zlib.crc32(text))
    lied = mslot.Record(record.begin, record.end, parts["manifest"], parts["values"], record.data)
    raw[: len(lied.pack())] = lied.pack()
    path = tmp_path_factory.mktemp("s") / "run-a-rank0-0.slot"
    path.write_bytes(bytes(raw))
    if key == "values":
        # The store's own checks stop here; what the Trainer reads of the values is checked where it
        # reads them (tests/jobs/snapshot/test_memory_slot_damage.py). The slot must still never be
        # read as other tensors.
        try:
            got = mslot.read_slot(path, data=True)
        except mslot.BadSlot as err:
            assert str(path) in str(err)
            return
        assert got is not None
        assert all(
            torch.equal(a, b)
            for a, b in zip(mslot.tensors_of(got[3], got[0], got[1]), SAVED, strict=True)
        )
        return
    check_slot(path, f"manifest {key}={lie!r}")


# -- the search journal ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def journal_bytes(tmp_path_factory) -> bytes:
    from ddpkit.search._config import SearchConfig
    from ddpkit.search._study import JOURNAL, open_search_study

    folder = tmp_path_factory.mktemp("journal")
    study = open_search_study(
        SearchConfig(n_trials=3, search_dir=str(folder)), {}, create=True
    ).study
    for i in range(2):
        trial = study.ask()
        trial.suggest_float("lr", 1e-3, 1.0)
        study.tell(trial, float(i))
    return (folder / JOURNAL).read_bytes()


@pytest.mark.timeout(60)
@FAST
@given(mutation=byte_mutation(900), whole_line=st.booleans())
def test_journal_mutated(tmp_path_factory, journal_bytes, mutation, whole_line):
    from ddpkit.search._config import SearchConfig
    from ddpkit.search._study import JOURNAL, open_search_study, repair_journal

    folder = tmp_path_factory.mktemp("j")
    data = mutate(journal_bytes, mutation)
    if whole_line:  # the mutation kept to records: every line ends with its newline
        data = data if data.endswith(b"\n") or not data else data + b"\n"
    (folder / JOURNAL).write_bytes(data)
    try:
        repair_journal(folder / JOURNAL)  # what a search does first, under its lock
        study = open_search_study(
            SearchConfig(n_trials=3, search_dir=str(folder)), {}, create=True
        ).study
    except ConfigError as err:
        assert str(folder / JOURNAL) in str(err), f"{mutation}: a refusal that names no file: {err}"
        return
    # Opened: a prefix of the records, or records that still replay (a value changed is a valid
    # journal).
    assert len(study.trials) <= 2


# -- the stream line index -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stream_file(tmp_path_factory) -> tuple[Path, bytes, np.ndarray]:
    """A data file, a line index as the previous cache kept it beside the file (a header of
    version, size, content digest and checksum, then the offsets), and its true line index."""
    from ddpkit.data._fingerprint import digest
    from ddpkit.data._stream_sources import indexed_lines

    folder = tmp_path_factory.mktemp("stream")
    path = folder / "data.jsonl"
    path.write_text("".join(json.dumps({"i": i, "x": "y" * (i % 7)}) + "\n" for i in range(64)))
    truth, content = indexed_lines(path)
    as_int = int.from_bytes(bytes.fromhex(content), "little", signed=True)
    checksum = np.frombuffer(bytes.fromhex(digest(truth.view(np.uint8).data)), np.int64)[0]
    header = [[3, path.stat().st_size], [as_int, checksum]]
    return path, np.concatenate([np.array(header, np.int64), truth]).tobytes(), truth


@pytest.mark.timeout(60)
@FAST
@given(mutation=byte_mutation(1100))
def test_line_index_mutated(tmp_path_factory, stream_file, mutation):
    from ddpkit.data._stream_sources import JsonlStream

    source, cache, truth = stream_file
    folder = tmp_path_factory.mktemp("l")
    path = folder / source.name
    shutil.copy2(source, path)  # the same size, time and content: the header still matches
    (folder / f".{path.name}.lines").write_bytes(mutate(cache, mutation))
    try:
        got = JsonlStream(path).lines[0]
    except (ConfigError, ValueError, OSError) as err:
        assert path.name in str(err), f"{mutation}: a refusal that names no file: {err}"
        return
    assert np.array_equal(got, truth), f"{mutation}: the line index lies about where records are"
