"""The data fingerprint, fuzzed: datasets and changes to them are generated, and every change that
docs/data.md says is detected is refused by ``load_state_dict`` with the old state, naming the
changed item, before any step; unchanged data resume. A ``Subset``'s indices (nested, over a
``ConcatDataset``), a ``ConcatDataset``'s parts, a JSON Lines file rewritten at the same size with
its modification time put back, an iterable in another order.

Control: the fingerprint as it was (:func:`old_fingerprint`, a copy kept here) missed a ``Subset``
drawn with another seed, an iterable in another order, and a file rewritten at the same size and
time, read at the old offsets. Each example asserts it still misses them.

The default run tries 30 examples per test, the same each time; ``DDPKIT_FUZZ_EXAMPLES=2000`` tries
as many, fresh (as ``tests/unit/test_formats_fuzz.py``).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st
from torch.utils.data import ConcatDataset, Dataset, Subset, TensorDataset

import ddpkit
from ddpkit import ConfigError
from ddpkit.data._fingerprint import changes, digest, shard_items
from ddpkit.data._stream import StreamSamples
from ddpkit.data._stream_sources import HEAD_RECORDS, IterableStream, JsonlStream, indexed_lines
from tests.fuzz import examples

FAST = examples(30)


# -- the fingerprint as it was: the control --------------------------------------------------------

_OLD_INDEX: dict[tuple[str, int, int], np.ndarray] = {}
"""The line indices the old code kept beside each file, trusted while its size and modification time
held."""


def _old_jsonl_shard(path: Path) -> str:
    st_ = path.stat()
    key = (str(path), st_.st_size, st_.st_mtime_ns)
    if key not in _OLD_INDEX:
        _OLD_INDEX[key] = indexed_lines(path)[0]
    lines = _OLD_INDEX[key]
    line_digest = digest(np.ascontiguousarray(lines, dtype=np.int64).view(np.uint8).data)
    return f"{path.name}: {len(lines)} records, {st_.st_size} bytes, line index {line_digest}"


def old_fingerprint(loader: Any) -> dict[str, Any]:
    """The fingerprint before a dataset's layout was in it: the sampler's settings; a map-style
    dataset (wrapped for seeding) by its length alone; a stream by its kind, records, window and
    shards, a JSON Lines file by its line index as kept beside it, an iterable by its record
    count."""
    items = loader.batch_sampler.fingerprint()
    data = loader.dataset
    if not isinstance(data, StreamSamples):
        return items
    stream = data.stream
    if isinstance(stream, JsonlStream):
        shards = [_old_jsonl_shard(p) for p in stream.paths]
    else:
        shards = [f"{type(stream.dataset).__name__}: {stream.num_records} records"]
    kind = {"stream": type(stream).__name__, "records": len(stream), "window": stream.window}
    return items | kind | shard_items(shards) | {"shuffle": data.shuffle}


def one_step(loader: Any) -> dict[str, Any]:
    """The loader's state after its first step."""
    batches = iter(loader)
    next(batches)
    return loader.state_dict()


def check_resume(state: dict[str, Any], loader: Any, detected: str | None) -> None:
    """``detected``: the item the refusal names (None: the resume is accepted, at the saved
    position)."""
    if detected is None:
        loader.load_state_dict(state)
        assert loader.position() == (state["epoch"], state["cursor"])
        return
    with pytest.raises(ConfigError, match="the data changed since the snapshot was taken") as err:
        loader.load_state_dict(state)
    assert loader.position() == (0, 0)  # refused before the position moved: no step taken from it
    message = str(err.value)
    listed = message.split("taken (", 1)[1].split("): resuming", 1)[0]
    assert detected in [item.split(": ", 1)[0] for item in listed.split("; ")], message
    assert "\n" not in message


# -- map-style: Subsets of Subsets of a ConcatDataset ----------------------------------------------


def build(spec: dict[str, Any]) -> Dataset:
    parts = [
        TensorDataset(torch.arange(n) + 1000 * k + spec["shift"])
        for k, n in enumerate(spec["parts"])
    ]
    data: Dataset = ConcatDataset(parts)
    for indices in spec["subsets"]:  # innermost first
        data = Subset(data, indices)
    return data


def paths(spec: dict[str, Any]) -> list[str]:
    """The fingerprint's name of each layer, outermost first; the ConcatDataset's last."""
    return ["dataset" + ".dataset" * k for k in range(len(spec["subsets"]) + 1)]


@st.composite
def layouts(draw: st.DrawFn) -> dict[str, Any]:
    parts = draw(st.lists(st.integers(1, 8), min_size=1, max_size=4))
    subsets, size = [], sum(parts)
    for _ in range(draw(st.integers(0, 2))):
        chosen = draw(st.permutations(range(size)))[: draw(st.integers(1, size))]
        subsets.append(chosen)
        size = len(chosen)
    return {"parts": parts, "subsets": subsets, "shift": 0}


MAP_CHANGES = [
    "none",
    "order",
    "membership",
    "reseeded",
    "part length",
    "parts order",
    "item contents",
]
_SAME_LENGTH = {"order", "membership", "reseeded", "parts order", "item contents"}


def change_layout(
    draw: st.DrawFn, spec: dict[str, Any], kind: str
) -> tuple[dict[str, Any], str | None]:
    """The changed spec and the item whose change names it (None: not detected, by design)."""
    new = {
        "parts": list(spec["parts"]),
        "subsets": [list(s) for s in spec["subsets"]],
        "shift": spec["shift"],
    }
    names = paths(spec)  # outermost first
    if kind in ("order", "membership", "reseeded"):
        assume(new["subsets"])
        layer = draw(st.integers(0, len(new["subsets"]) - 1))  # innermost first
        indices = new["subsets"][layer]
        parent = sum(new["parts"]) if layer == 0 else len(new["subsets"][layer - 1])
        if kind == "order":
            changed = draw(st.permutations(indices))
        elif kind == "membership":
            at, other = draw(st.integers(0, len(indices) - 1)), draw(st.integers(0, parent - 1))
            changed = [*indices[:at], other, *indices[at + 1 :]]
        else:  # another seed, as random_split would draw: the same length
            changed = torch.randperm(
                parent, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))
            )
            changed = changed[: len(indices)].tolist()
        assume(changed != indices)
        new["subsets"][layer] = changed
        return new, names[len(new["subsets"]) - 1 - layer]
    # a part one longer: its Subsets index the same items, the epoch is as long
    if kind == "part length":
        new["parts"][draw(st.integers(0, len(new["parts"]) - 1))] += 1
        return new, names[-1]
    if kind == "parts order":
        assume(len(set(new["parts"])) > 1)
        new["parts"] = draw(st.permutations(new["parts"]))
        assume(new["parts"] != spec["parts"])
        return new, names[-1]
    if kind == "item contents":  # what an index returns is not read: the same layout resumes
        new["shift"] += 7
    return new, None


@pytest.mark.timeout(300)
@FAST
@given(data=st.data())
def test_a_changed_map_style_layout_is_refused_naming_where(data):
    spec = data.draw(layouts())
    kind = data.draw(st.sampled_from(MAP_CHANGES))
    changed, detected = change_layout(data.draw, spec, kind)
    before = ddpkit.build_loader(build(spec), 1, seed=3, num_workers=0)
    state = one_step(before)
    after = ddpkit.build_loader(build(changed), 1, seed=3, num_workers=0)
    if kind in _SAME_LENGTH:  # control: the old fingerprint saw the length alone
        assert changes(old_fingerprint(before), old_fingerprint(after)) == []
    check_resume(state, after, detected)


def test_a_datasets_own_fingerprint_is_kept_under_the_seeding_wrapper():
    class Versioned(Dataset):
        def __init__(self, version: str) -> None:
            self.version = version

        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> int:
            return index

        def fingerprint(self) -> dict[str, Any]:
            return {"version": self.version}

    before = ddpkit.build_loader(Versioned("v1"), 2, num_workers=0)
    state = one_step(before)
    after = ddpkit.build_loader(Versioned("v2"), 2, num_workers=0)
    # Control: the old fingerprint asked the seeding wrapper, which has none.
    assert changes(old_fingerprint(before), old_fingerprint(after)) == []
    check_resume(state, after, "version")
    nested = ddpkit.build_loader(
        ConcatDataset([Versioned("v2"), Versioned("v1")]), 2, num_workers=0
    )
    check_resume(state, nested, "dataset length")
    both = ddpkit.build_loader(ConcatDataset([Versioned("v1"), Versioned("v1")]), 2, num_workers=0)
    other = ddpkit.build_loader(ConcatDataset([Versioned("v1"), Versioned("v3")]), 2, num_workers=0)
    check_resume(one_step(both), other, "dataset.datasets[1] version")


def test_a_large_layout_is_kept_as_one_digest():
    parts = [Subset(TensorDataset(torch.arange(2)), [0, 1]) for _ in range(80)]
    before = ddpkit.build_loader(ConcatDataset(parts), 4, num_workers=0)
    state = one_step(before)
    assert set(state["fingerprint"]) >= {"dataset parts", "dataset layout"}
    turned = Subset(TensorDataset(torch.arange(2)), [1, 0])
    after = ddpkit.build_loader(ConcatDataset([*parts[:79], turned]), 4, num_workers=0)
    check_resume(state, after, "dataset layout")


# -- JSON Lines files rewritten at the same size and time ------------------------------------------


def write_records(path: Path, pads: list[int], values: list[int]) -> bytes:
    text = "".join(
        json.dumps({"id": i, "v": f"{v:03d}", "pad": "x" * p}) + "\n"
        for i, (p, v) in enumerate(zip(pads, values))
    )
    path.write_text(text)
    return text.encode()


JSONL_CHANGES = ["none", "content", "order", "boundaries", "count"]


@pytest.mark.timeout(300)
@FAST
@given(data=st.data())
def test_a_rewritten_jsonl_file_is_refused_and_read_where_its_records_now_lie(
    tmp_path_factory, data
):
    n = data.draw(st.integers(2, 12))
    pads = data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n))
    values = data.draw(st.lists(st.integers(0, 999), min_size=n, max_size=n))
    kind = data.draw(st.sampled_from(JSONL_CHANGES))
    path = tmp_path_factory.mktemp("jsonl") / "data.jsonl"
    write_records(path, pads, values)
    before = ddpkit.build_loader(JsonlStream(path, window=4), 1, num_workers=0, collate_fn=list)
    state, old = one_step(before), old_fingerprint(before)
    assert not path.with_name(".data.jsonl.lines").exists()  # built at every open, kept nowhere
    at = data.draw(st.integers(0, n - 2))
    if kind == "content":
        values[at] = data.draw(st.integers(0, 999).filter(lambda v: v != values[at]))
    elif kind == "order":
        assume((pads[at], values[at]) != (pads[at + 1], values[at + 1]))
        pads[at], pads[at + 1], values[at], values[at + 1] = (
            pads[at + 1],
            pads[at],
            values[at + 1],
            values[at],
        )
    # one byte moved from a record to the next: the same size and line count
    elif kind == "boundaries":
        assume(pads[at] > 0)
        pads[at], pads[at + 1] = pads[at] - 1, pads[at + 1] + 1
    elif kind == "count":
        pads, values = pads + [1], values + [1]
    times = path.stat()
    truth = write_records(path, pads, values)
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))  # as cp -p or tar x leave it
    stream = JsonlStream(path, window=4)
    after = ddpkit.build_loader(stream, 1, num_workers=0, collate_fn=list)
    # control: the old fingerprint, over the index kept for the file's size and time
    if kind != "count":
        assert changes(old, old_fingerprint(after)) == []
    check_resume(state, after, None if kind == "none" else "shard 0")
    # The records are where they now lie, not where the kept index said (the ids are at their
    # lines).
    expected = [json.loads(line) for line in truth.decode().splitlines()]
    assert stream.read(0, np.arange(len(stream))) == expected
    # control: at the offsets kept for the file's size and time, cut in the wrong places
    if kind == "boundaries":
        stale = _OLD_INDEX[(str(path), times.st_size, times.st_mtime_ns)]
        assert [truth[a:b] for a, b in stale.tolist()] != truth.splitlines()


# -- an iterable in another order ------------------------------------------------------------------


@pytest.mark.timeout(300)
@FAST
@given(data=st.data())
def test_an_iterable_in_another_order_is_refused(data):
    records = data.draw(st.lists(st.integers(-50, 50), min_size=2, max_size=40))
    kind = data.draw(st.sampled_from(["none", "order", "content"]))
    if kind == "order":
        changed = data.draw(st.permutations(records))
    elif kind == "content":
        at = data.draw(st.integers(0, len(records) - 1))
        changed = [*records[:at], records[at] + 1, *records[at + 1 :]]
    else:
        changed = list(records)
    assume(kind == "none" or changed != records)
    before = ddpkit.build_loader(
        IterableStream(records, window=4), 1, num_workers=0, collate_fn=list
    )
    state = one_step(before)
    after = ddpkit.build_loader(
        IterableStream(changed, window=4), 1, num_workers=0, collate_fn=list
    )
    # control: the count alone
    assert changes(old_fingerprint(before), old_fingerprint(after)) == []
    check_resume(state, after, None if kind == "none" else "shard 0")


def test_an_iterable_reordered_past_its_first_records_is_not_seen():
    # The documented limit: only the first HEAD_RECORDS records are read at construction.
    records = list(range(HEAD_RECORDS + 20))
    tail = records[HEAD_RECORDS:]
    random.Random(0).shuffle(tail)
    before = ddpkit.build_loader(
        IterableStream(records, window=4), 1, num_workers=0, collate_fn=list
    )
    state = one_step(before)
    after = ddpkit.build_loader(
        IterableStream(records[:HEAD_RECORDS] + tail, window=4), 1, num_workers=0
    )
    check_resume(state, after, None)
    # control: the same change within them is refused
    swapped = [records[1], records[0], *records[2:]]
    check_resume(
        state, ddpkit.build_loader(IterableStream(swapped, window=4), 1, num_workers=0), "shard 0"
    )
