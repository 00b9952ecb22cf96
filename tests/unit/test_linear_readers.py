"""Every reader of a ddpkit format takes time at most O(n log n) in the size of its file, and
refuses a file beyond the size it admits naming the file.

Each adversarial input (chunks, entries, specs, records, lines) is grown 4x, 16x and 64x from a
base, and the reading time t ~ n**k may have k at most 1.3 over the whole range and at most 1.5
between the two largest inputs (a linear reader: 1, n log n about 1.1, a quadratic one: 2, and
closer to 2 the larger n is). Two bounds, each with room: a base that fits a cache reads fast and
made a linear reader's whole-range k 1.16 on a loaded machine (1x 2.3 ms, 4x 18.8 ms, 64x 277 ms),
while a large linear term holds a quadratic reader's last k near 1.5 in some runs (Optuna's replay:
1x 4.1 ms, 16x 157 ms, 64x 1690 ms: whole-range k 1.45). Times are
compared within one run, each the minimum of a few repetitions in CPU time with the garbage
collector off; no wall-clock threshold. The controls run the old quadratic readers (kept here)
through the same assertion, and show it fails.

The timed tests are in the slow tier: each input is read for 200 ms at each size, three times
where a measurement falls outside the bounds, about 45 s in all on the 2-core CI machine.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from ddpkit._errors import ConfigError
from ddpkit.snapshot import _codec as mvalues
from ddpkit.snapshot import _dcp as storage
from ddpkit.snapshot import _folders as folders
from ddpkit.snapshot import _slots as mslot
from ddpkit.snapshot._dcp import check_chunks

GROWTH = (1, 4, 16, 64)
EXPONENT = 1.3
"""Over the whole range of inputs."""
LAST_EXPONENT = 1.5
"""Between the two largest inputs."""


def exponent(sizes: list[int], times_: list[float], i: int, j: int) -> float:
    """k of t ~ n**k between inputs ``i`` and ``j``."""
    return math.log(times_[j] / times_[i]) / math.log(sizes[j] / sizes[i])


def times(read: Callable[[Any], Any], inputs: list[Any]) -> list[float]:
    """The least CPU time of ``read`` on each input over 3 runs or more (until 200 ms are spent, at
    most 30): on a shared machine a wall clock counts the time other processes run, more often the
    longer a run is."""
    out = []
    for value in inputs:
        best, spent, runs = math.inf, 0.0, 0
        gc.collect()
        gc.disable()
        try:
            while runs < 3 or (spent < 0.2 and runs < 30):
                start = time.process_time()
                read(value)
                took = time.process_time() - start
                best, spent, runs = min(best, took), spent + took, runs + 1
        finally:
            gc.enable()
        out.append(best)
    return out


MEASURABLE = 0.002
"""The least time a base input must take: below it, fixed costs and a loaded machine's noise (a
cache miss, a page fault) are a large share of it and the ratio says nothing about growth."""


def assert_linear(
    read: Callable[[Any], Any],
    make: Callable[[int], Any],
    base: int,
    growth=GROWTH,
    most: int | None = None,
    attempts: int = 3,
) -> None:
    """``read`` of ``make(base * g)`` for g in ``growth`` takes time ~ n**k in the input's size,
    k at most EXPONENT over the range and LAST_EXPONENT between the two largest inputs, in one of
    ``attempts`` measurements.

    The base is doubled (up to 16x, and while the largest input stays within ``most``) until reading
    it takes MEASURABLE: a sub-millisecond base failed this on a loaded machine for readers that are
    linear. A linear reader passes once noise spares one measurement (another process on a 2-core
    machine can slow one input several times over); a quadratic one fails every measurement, as
    its exponent is a property of the reader, not of the machine. The controls measure once."""
    made: dict[int, Any] = {}

    def get(n: int) -> Any:
        if n not in made:
            made[n] = make(n)
        return made[n]

    for _ in range(4):
        if times(read, [get(base)])[0] >= MEASURABLE or (
            most is not None and 2 * base * growth[-1] > most
        ):
            break
        base *= 2
    inputs = [get(base * g) for g in growth]
    seen = []
    for _ in range(attempts):
        t = times(read, inputs)
        whole, last = exponent(growth, t, 0, -1), exponent(growth, t, -2, -1)
        if whole <= EXPONENT and last <= LAST_EXPONENT:
            return
        shown = ", ".join(f"{g}x {s * 1e3:.1f} ms" for g, s in zip(growth, t))
        seen.append(
            f"{shown}: t ~ n**{whole:.2f} over the range, n**{last:.2f} between the two largest"
        )
    raise AssertionError(f"superlinear from a base of {base}: " + "; ".join(seen))


# -- the DCP index ---------------------------------------------------------------------------------


def one_element_chunks(n: int, width: int = 64) -> str:
    """The index of one weight of n // width x width stored as n one-element chunks (the issue's
    65,536)."""
    chunks = [{"offsets": [i // width, i % width], "sizes": [1, 1]} for i in range(n)]
    entries = [
        {"fqn": "w", "offset": c["offsets"], "file": "__0_0.distcp", "at": i * 4, "length": 4}
        for i, c in enumerate(chunks)
    ]
    tensors = {"w": {"dtype": "float32", "size": [n // width, width], "chunks": chunks}}
    return json.dumps({"version": None, "tensors": tensors, "storage": entries, "paths": {}})


def read_index(text: str) -> Any:
    return storage.index_from_json(json.loads(text))


def quadratic_check_chunks(fqn: str, size: torch.Size, chunks: list[ChunkStorageMetadata]) -> None:
    """The chunk check before: every pair of chunks compared (4,096 chunks took 8.8 s)."""
    total = sum(c.sizes.numel() for c in chunks)
    if total != size.numel():
        raise storage.BadIndex(
            f"tensor {fqn!r} has chunks covering {total} of its {size.numel()} elements"
        )
    for i, a in enumerate(chunks):
        for b in chunks[i + 1 :]:
            if all(
                ao < bo + bn and bo < ao + an
                for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes)
            ):
                raise storage.BadIndex(f"tensor {fqn!r} has two chunks that overlap")


@pytest.mark.slow
def test_the_dcp_index_is_read_in_time_linear_in_its_chunks():
    assert_linear(read_index, one_element_chunks, 128)


@pytest.mark.slow
def test_control_the_old_pairwise_chunk_check_is_caught(monkeypatch):
    monkeypatch.setattr(
        storage,
        "check_chunks",
        lambda fqn, size, chunks: quadratic_check_chunks(fqn, size, chunks) or chunks,
    )
    read_index(one_element_chunks(256))  # still a reader of the same index: it accepts it
    with pytest.raises(AssertionError, match="superlinear"):
        assert_linear(read_index, one_element_chunks, 64, growth=(1, 4, 16), attempts=1)


def dcp_chunks(size: list[int], chunks: list[tuple[list[int], list[int]]]) -> Any:
    return [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks], torch.Size(size)


@pytest.mark.parametrize(
    "size, chunks, refusal",
    [
        ([4, 4], [([0, 0], [4, 2]), ([0, 2], [4, 2])], None),
        ([4, 4], [([0, 0], [2, 2]), ([0, 2], [2, 2]), ([2, 0], [2, 4])], None),  # not a grid
        ([2, 3, 4], [([0, 0, 0], [1, 3, 4]), ([1, 0, 0], [1, 1, 4]), ([1, 1, 0], [1, 2, 4])], None),
        # empty ones
        ([4, 4], [([0, 0], [4, 2]), ([0, 2], [4, 2]), ([0, 0], [0, 4]), ([4, 4], [0, 0])], None),
        ([0, 4], [([0, 0], [0, 4])], None),
        # The same volume, one element twice and one never: the volumes alone would pass it.
        (
            [2, 2],
            [([0, 0], [1, 2]), ([1, 0], [1, 1]), ([0, 0], [1, 1])],
            "overlap, at element [0, 0]",
        ),
        ([2, 2], [([0, 0], [2, 1]), ([0, 0], [1, 2])], "overlap, at element [0, 0]"),
        (
            [3, 3],
            [([0, 0], [2, 2]), ([1, 1], [2, 2]), ([0, 2], [1, 1])],
            "overlap, at element [1, 1]",
        ),
        ([4, 4], [([0, 0], [3, 4]), ([0, 0], [1, 4])], "overlap, at element [0, 0]"),
        ([4], [([0], [3]), ([2], [1])], "overlap, at element [2]"),
        ([2, 2, 2, 2, 2], [([0] * 5, [1] * 5)] * 32, "split along 5 dimensions"),
        ([2**40, 2**40], [([0, 0], [2**40, 2**40])], "more than 2**63 - 1 elements"),
    ],
)
def test_the_chunk_check_is_exact(size, chunks, refusal):
    found, shape = dcp_chunks(size, chunks)
    if refusal is None:
        assert check_chunks("w", shape, found) == [c for c in found if c.sizes.numel()]
    else:
        with pytest.raises(storage.BadIndex, match=refusal.replace("[", r"\[").replace("*", r"\*")):
            check_chunks("w", shape, found)


def test_the_chunk_check_agrees_with_counting_every_element():
    """Random sets of boxes in a 3x4x5 tensor: refused exactly when some element is not covered
    once."""
    rng = np.random.default_rng(0)
    shape = (3, 4, 5)
    for _ in range(400):
        boxes = []
        for _ in range(int(rng.integers(1, 6))):
            lo = [int(rng.integers(0, s)) for s in shape]
            boxes.append((lo, [int(rng.integers(1, s - o + 1)) for o, s in zip(lo, shape)]))
        cover = np.zeros(shape, dtype=int)
        for lo, n in boxes:
            cover[tuple(slice(o, o + k) for o, k in zip(lo, n))] += 1
        found, size = dcp_chunks(list(shape), boxes)
        try:
            check_chunks("w", size, found)
            accepted = True
        except storage.BadIndex:
            accepted = False
        assert accepted == bool((cover == 1).all()), (boxes, cover)


def test_a_storage_entry_at_no_chunk_is_refused():
    index = json.loads(one_element_chunks(64))
    index["storage"].append(
        {"fqn": "w", "offset": [7, 2**61 + 5], "file": "__0_0.distcp", "at": 0, "length": 4}
    )
    with pytest.raises(
        storage.BadIndex, match=r"storage entry at \[7, 2305843009213693957\] where it has no chunk"
    ):
        storage.index_from_json(index)


def test_a_dcp_index_beyond_its_bound_is_refused_naming_it(tmp_path):
    from ddpkit.snapshot._disk import DiskStore
    from tests.unit.snapshot.folders import save

    save(DiskStore(tmp_path), 3)
    folder = tmp_path / "step-00000003"
    os.truncate(folder / folders.INDEX, storage._INDEX_LIMIT + 1)  # sparse: no disk, and never read
    with pytest.raises(
        ConfigError, match=f"{folder / folders.INDEX} is not an index ddpkit wrote .*more than"
    ):
        storage.read_marked_index(folder)


# -- the snapshot marker ---------------------------------------------------------------------------


def marker_folder(root: Path) -> Callable[[int], folders.Found]:
    def make(n: int) -> folders.Found:
        path = root / f"step-{n:08d}"
        path.mkdir()
        files = {f"rank{i}.pt": {"size": i, "sha256": f"{i:064x}"} for i in range(n)}
        (path / folders.MARKER).write_text(json.dumps({"files": files}))
        return folders.Found(n, path)

    return make


@pytest.mark.slow
def test_the_marker_is_read_in_time_linear_in_its_entries(tmp_path):
    # 8192 entries: 0.9 MiB, under its bound: the base grows instead of the growth
    assert_linear(folders.listed, marker_folder(tmp_path), 512, growth=(1, 4, 16), most=8192)


def test_a_marker_beyond_its_bound_is_refused_naming_it(tmp_path):
    found = marker_folder(tmp_path)(1)
    os.truncate(found.path / folders.MARKER, folders._MARKER_LIMIT + 1)
    with pytest.raises(
        ValueError, match=f"unreadable {folders.MARKER} .{found.path / folders.MARKER} holds"
    ):
        folders.listed(found)


# -- the memory slot -------------------------------------------------------------------------------


def slot_bytes(n: int, shape: list[int] | None = None) -> bytes:
    """A whole slot of n one-element tensors (or one tensor of ``shape``)."""
    specs = (
        [["torch.float32", [1], 64 * i] for i in range(n)]
        if shape is None
        else [["torch.float32", shape, 0]]
    )
    region = bytes(64 * max(n, 1))
    manifest = json.dumps({"specs": specs, "data_size": len(region)}).encode()
    values = json.dumps({"step": 1}).encode()
    mo = mslot.HEADER
    vo = mo + len(manifest)
    do = -(-(vo + len(values)) // 64) * 64
    table = mslot.block_crcs(region)  # the data region's CRC-32Cs, right after it
    body = bytearray(do + len(region) + len(table))
    body[mo:vo], body[vo : vo + len(values)] = manifest, values
    body[do : do + len(region)], body[do + len(region) :] = region, table
    record = mslot.Record(
        1,
        1,
        (mo, len(manifest), zlib.crc32(manifest)),
        (vo, len(values), zlib.crc32(values)),
        (do, len(region), mslot.table_crc(table)),
    )
    body[: len(record.pack())] = record.pack()
    return bytes(body)


@pytest.mark.slow
def test_a_memory_slot_is_read_in_time_linear_in_its_tensors():
    assert_linear(lambda data: mslot.parse_slot(data, "slot"), slot_bytes, 1000)


def many_dims(n: int) -> list[Any]:
    return [["torch.float32", [2**62] * n + [0], 0]]  # no elements, and a product of n large sizes


def read_specs(raw: list[Any]) -> list[int]:
    return [s.nbytes for s in mvalues.checked_specs(raw, 64)]


@pytest.mark.slow
def test_a_slot_manifest_is_checked_in_time_linear_in_its_sizes():
    assert_linear(read_specs, many_dims, 500)


@pytest.mark.slow
def test_control_the_old_product_of_sizes_is_caught(monkeypatch):
    # The size of a spec before: the product of every size, a zero among them or not.
    monkeypatch.setattr(mvalues.Spec, "nbytes", property(lambda s: math.prod(s.shape) * 4))
    with pytest.raises(AssertionError, match="superlinear"):
        assert_linear(read_specs, many_dims, 500, growth=(1, 4, 16), attempts=1)


def test_a_slot_part_beyond_its_bound_is_refused_naming_it(tmp_path):
    data = bytearray(slot_bytes(2))
    record = mslot.Record.unpack(bytes(data[: mslot.HEADER]))
    assert record is not None
    big = mslot.PART_LIMIT + 1
    lied = mslot.Record(
        1, 1, (record.manifest[0], big, record.manifest[2]), record.values, record.data
    )
    data[: len(lied.pack())] = lied.pack()
    path = tmp_path / "run-a-rank0-0.slot"
    path.write_bytes(bytes(data))
    with pytest.raises(mslot.BadSlot, match=f"slot: its manifest holds {big} bytes, more than"):
        mslot.parse_slot(bytes(data), "slot")
    # sparse: the manifest lies inside the file, and is never read
    os.truncate(path, mslot.HEADER + big)
    with pytest.raises(mslot.BadSlot, match=f"{path}: its manifest holds {big} bytes, more than"):
        mslot.read_slot(path)


# -- the search journal ----------------------------------------------------------------------------

needs_optuna = pytest.mark.skipif(
    importlib.util.find_spec("optuna") is None, reason="needs ddpkit[search]"
)
WORKER = "w-1"


def journal_of(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def reports(n: int) -> list[dict[str, Any]]:
    """One trial reporting n intermediate values: each copies every one before it in Optuna's
    replay."""
    head = [
        {"op_code": 0, "worker_id": WORKER, "study_name": "ddpkit", "directions": [1]},
        {
            "op_code": 4,
            "worker_id": WORKER,
            "study_id": 0,
            "datetime_start": "2026-11-25T21:52:36+00:00",
        },
    ]
    steps = [
        {"op_code": 7, "worker_id": WORKER, "trial_id": 0, "step": i, "intermediate_value": 0.5}
        for i in range(n)
    ]
    return head + steps


def journal_maker(root: Path) -> Callable[[int], Path]:
    def make(n: int) -> Path:
        folder = root / f"j{n}"
        folder.mkdir()
        return journal_of(folder / "study.journal", reports(n))

    return make


def read_journal(path: Path) -> None:
    from ddpkit.search._study import check_journal, repair_journal

    repair_journal(path)
    try:
        check_journal(path)
    except ConfigError as err:
        assert "would cost Optuna more than" in str(err), err


@pytest.mark.slow
@needs_optuna
def test_the_search_journal_is_read_in_time_linear_in_its_records(tmp_path, monkeypatch):
    from ddpkit.search import _study as study

    # The floor is a constant allowance (16M entries copied: a fraction of a second); the growth
    # beyond it is what is measured.
    monkeypatch.setattr(study, "_REPLAY_FLOOR", 0)
    assert_linear(read_journal, journal_maker(tmp_path), 250)


@pytest.mark.slow
@needs_optuna
def test_control_a_journal_replayed_without_its_budget_is_caught(tmp_path, monkeypatch):
    from ddpkit.search import _study as study

    monkeypatch.setattr(study, "_REPLAY_FLOOR", 1 << 62)
    # From 1,000 records grown 16x (the same largest journal as the test's 250 grown 64x): Optuna's
    # replay has a large linear part, which from 250 held its whole-range k near 1.45 (1x 4.1 ms,
    # 64x 1690 ms) and a loaded machine once brought it under 1.3; from 1,000 it is about 1.6.
    with pytest.raises(AssertionError, match="superlinear"):
        assert_linear(read_journal, journal_maker(tmp_path), 1000, growth=(1, 4, 16), attempts=1)


@needs_optuna
def test_a_journal_whose_replay_would_be_quadratic_is_refused_naming_it(tmp_path):
    from ddpkit.search._study import check_journal

    path = journal_of(tmp_path / "study.journal", reports(8000))
    with pytest.raises(
        ConfigError,
        match=f"the study's journal {path} would cost Optuna more than .* by line [0-9]+ ",
    ):
        check_journal(path)


@needs_optuna
def test_a_journal_step_past_int_hashing_is_refused_naming_it(tmp_path):
    from ddpkit.search._study import check_journal

    records = reports(2)
    records[-1]["step"] = 2**61 - 1  # the hash of 0: such steps can all share one hash
    path = journal_of(tmp_path / "study.journal", records)
    with pytest.raises(
        ConfigError, match=f"the study's journal {path} is damaged at line 4 of 4: a step"
    ):
        check_journal(path)


@needs_optuna
def test_a_journal_beyond_its_bound_is_refused_naming_it(tmp_path):
    from ddpkit.search._study import JOURNAL_LIMIT, check_journal, repair_journal

    path = journal_of(tmp_path / "study.journal", reports(2))
    os.truncate(path, JOURNAL_LIMIT + 1)  # sparse: never read
    for read in (repair_journal, check_journal):
        with pytest.raises(
            ConfigError, match=f"the study's journal {path} holds {JOURNAL_LIMIT + 1} bytes, more"
        ):
            read(path)


# -- the stream line index -------------------------------------------------------------------------


def line_files(root: Path) -> Callable[[int], Path]:
    """A data file of n lines (a stream builds its line index from it at every open)."""

    def make(n: int) -> Path:
        folder = root / f"l{n}"
        folder.mkdir(mode=0o700)
        data = folder / "data.jsonl"
        data.write_bytes(b'{"i": 0}\n' * n)
        return data

    return make


@pytest.mark.slow
def test_the_line_index_is_built_in_time_linear_in_its_lines(tmp_path):
    from ddpkit.data._stream_sources import indexed_lines

    assert_linear(indexed_lines, line_files(tmp_path), 20_000)


def test_a_line_index_of_more_lines_than_its_file_holds_is_never_read(tmp_path):
    from ddpkit.data._stream_sources import JsonlStream

    data = line_files(tmp_path)(8)
    size = data.stat().st_size
    # A line takes a byte and its newline: more than (size + 1) // 2 offsets cannot be the file's.
    lines = np.stack([np.arange(size) * 2, np.arange(size) * 2 + 1], axis=1).astype(np.int64)
    header = np.array([[3, size], [0, 0]], dtype=np.int64)
    np.concatenate([header, lines]).tofile(data.with_name(".data.jsonl.lines"))
    assert len(JsonlStream(data)) == 8


@needs_optuna
def test_a_journal_line_nested_too_deep_is_refused_naming_it(tmp_path):
    from ddpkit.search._study import check_journal, repair_journal

    path = tmp_path / "study.journal"
    # a RecursionError in json before
    path.write_text(json.dumps(reports(0)[0]) + "\n" + "[" * 200_000 + "\n")
    for read in (repair_journal, check_journal):
        with pytest.raises(
            ConfigError, match=f"the study's journal {path} is damaged at line 2 of 2"
        ):
            read(path)


def test_an_index_nested_too_deep_is_refused_naming_it(tmp_path):
    from ddpkit.snapshot._disk import DiskStore
    from tests.unit.snapshot.folders import save

    save(DiskStore(tmp_path), 3)
    folder = tmp_path / "step-00000003"
    (folder / folders.INDEX).write_text("[" * 200_000)  # a RecursionError in json before
    with pytest.raises(
        ConfigError, match=f"{folder / folders.INDEX} is not an index ddpkit wrote .it is not JSON"
    ):
        storage.read_marked_index(folder)


# -- the codec's sets and dicts --------------------------------------------------------------------

_M = 2**61 - 1  # Python hashes k * (2**61 - 1) as 0: every such integer collides


def colliding_set(n: int) -> Any:
    """The skeleton of a set of n integers of one hash, as a planted values.pt would hold it."""
    return {"s": [{"I": format(k * _M, "x")} for k in range(n)]}


def decode_or_refusal(skeleton: Any) -> None:
    try:
        mvalues.decode(skeleton, [])
    except ValueError:
        pass  # refused: what a save never writes


@pytest.mark.slow
def test_the_codec_decodes_in_time_linear_in_its_input_whatever_the_hashes():
    assert_linear(decode_or_refusal, colliding_set, 500)


@pytest.mark.slow
def test_control_a_set_built_whatever_its_hashes_is_caught(monkeypatch):
    monkeypatch.setattr(mvalues, "_distinct_hashes", lambda pairs: pairs)
    with pytest.raises(AssertionError, match="superlinear"):
        assert_linear(
            decode_or_refusal, colliding_set, 50, growth=(1, 4, 16), most=3200, attempts=1
        )


def test_a_set_of_many_keys_of_one_hash_is_refused_and_a_few_load():
    with pytest.raises(ValueError, match="many of one hash"):
        mvalues.decode(colliding_set(200), [])
    few = mvalues.decode(colliding_set(mvalues.HASH_COLLISIONS), [])  # control: a few load
    assert few == {k * _M for k in range(mvalues.HASH_COLLISIONS)}


def test_a_value_file_with_a_compressed_entry_is_refused_before_it_inflates(tmp_path):
    import zipfile

    good = tmp_path / "values.pt"
    good.write_bytes(mvalues.file_bytes({"m": {}}, [torch.zeros(4)]))
    assert mvalues.read_file(good) == {}  # control: ddpkit's own file, stored
    planted = tmp_path / "planted.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(planted, "w") as dst:
        for entry in src.infolist():
            dst.writestr(entry.filename, src.read(entry), compress_type=zipfile.ZIP_DEFLATED)
    with pytest.raises(mvalues.FormatError, match="is compressed"):
        mvalues.read_file(planted)
