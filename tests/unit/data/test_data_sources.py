"""Which sources a stream can read: an iterable that is its own iterator, one whose passes differ,
and a ``datasets`` stream that splits itself among loader workers are refused at once; a callable
giving a fresh iterator works. And a stream's fingerprint: what in its files decides where each
record lies."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

import ddpkit
from ddpkit import ConfigError
from ddpkit.data import _stream_sources as source_checks
from ddpkit.data._stream_sources import IterableStream, JsonlStream, TokenStream


def records(n: int = 40):
    yield from range(n)


def trained(stream, workers: int = 0, epochs: int = 2) -> list[list[int]]:
    loader = ddpkit.build_loader(stream, 4, seed=2, num_workers=workers, collate_fn=list)
    return [sorted(i for batch in loader for i in batch) for _ in range(epochs)]


def test_a_generator_object_is_refused_and_a_generator_function_works():
    with pytest.raises(
        ConfigError, match="a generator is its own iterator, spent after one pass"
    ) as err:
        IterableStream(records(), 40)
    assert "pass a callable that returns a fresh iterator" in str(err.value) and "\n" not in str(
        err.value
    )
    assert trained(IterableStream(records, 40, window=8)) == [list(range(40))] * 2
    assert len(IterableStream(records, window=8)) == 40  # counted by a pass of its own
    assert trained(IterableStream(list(range(40)), window=8), workers=2) == [list(range(40))] * 2


def test_control_a_generator_object_used_to_fail_only_in_the_second_epoch(monkeypatch):
    monkeypatch.setattr(source_checks, "is_factory", lambda source: False)
    monkeypatch.setattr(source_checks, "head_digest", lambda start, count: "")
    loader = ddpkit.build_loader(
        IterableStream(records(), 40, window=8), 4, num_workers=0, collate_fn=list
    )
    assert sorted(i for batch in loader for i in batch) == list(range(40))
    # blaming a split, wrongly
    with pytest.raises(ConfigError, match="the stream ended after 0 records"):
        list(loader)


class Rewinds(IterableDataset):
    """Its own iterator, rewound by ``__iter__``: re-iterable."""

    def __iter__(self):
        self.i = 0
        return self

    def __next__(self):
        self.i += 1
        if self.i > 20:
            raise StopIteration
        return self.i - 1


class DoesNotRewind(Rewinds):
    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self


class Reshuffles(IterableDataset):
    """A new order on every pass: a shuffle of its own, unseeded."""

    def __iter__(self):
        return iter(torch.randperm(20).tolist())


def test_an_iterable_dataset_that_rewinds_works_and_one_that_does_not_is_refused():
    assert trained(IterableStream(Rewinds(), 20, window=4)) == [list(range(20))] * 2
    with pytest.raises(
        ConfigError,
        match="a pass over the source yielded 0 records, num_records asks for at least 20",
    ):
        IterableStream(DoesNotRewind(), 20)
    with pytest.raises(ConfigError, match="yielded 0 records"):  # spent by the count of its length
        IterableStream(DoesNotRewind())
    with pytest.raises(
        ConfigError, match="two passes over the source gave different first 20 records"
    ):
        IterableStream(Reshuffles(), 20)


class HubStream(IterableDataset):
    """Stands in for a Hugging Face ``datasets.IterableDataset``: with loader workers, each takes a
    share of the shards (by ``get_worker_info()``), as that class does."""

    __module__ = "datasets.iterable_dataset"
    n_shards = 4

    def __iter__(self):
        info = get_worker_info()
        shards = (
            range(self.n_shards)
            if info is None
            else range(info.id, self.n_shards, info.num_workers)
        )
        return (10 * s + k for s in shards for k in range(10))


def test_a_datasets_stream_is_refused_with_workers_and_works_without():
    stream = IterableStream(HubStream(), 40, window=8)
    with pytest.raises(
        ConfigError, match=r"splits itself among loader workers.*pass num_workers=0"
    ) as err:
        ddpkit.build_loader(stream, 4, num_workers=2)
    assert "JsonlStream" in str(err.value)
    assert trained(stream, workers=0) == [list(range(40))] * 2


def test_control_a_datasets_stream_in_workers_fails_mid_epoch(monkeypatch):
    monkeypatch.setattr(source_checks, "check_workers", lambda source, num_workers: None)
    stream = IterableStream(HubStream(), 40, window=8)
    loader = ddpkit.build_loader(stream, 4, num_workers=2, collate_fn=list)
    with pytest.raises(ConfigError, match="the stream ended after 20 records"):
        list(loader)
    # Its persistent workers, stopped now: left to the garbage collector, they would stop in
    # whichever process collects them, a rank forked by a later test included (two 5 s join timeouts
    # there, on workers not its own).
    loader._iterator._shutdown_workers()


def test_records_compare_alike_whatever_the_order_of_their_dicts_and_sets():
    a = {"id": 1, "tags": {"x", "y", "z"}, "x": torch.arange(3), "a": np.ones(2)}
    b = {"a": np.ones(2), "x": torch.arange(3), "tags": {"z", "x", "y"}, "id": 1}
    assert source_checks.canonical(a) == source_checks.canonical(b)
    assert source_checks.canonical(a) != source_checks.canonical(a | {"x": torch.arange(3.0)})
    assert source_checks.canonical([1, 2]) != source_checks.canonical([2, 1])


def test_a_jsonl_fingerprint_changes_with_where_records_lie(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(20)))
    before = JsonlStream(path, window=8).fingerprint()
    assert before["records"] == 20 and before["window"] == 8 and before["shards"] == 1
    assert before["shard files"].startswith(
        f"a.jsonl: 20 records, {path.stat().st_size} bytes, content "
    )
    lines = path.read_text().splitlines()
    lines[3] = json.dumps({"id": 3, "note": "longer"})  # the same count, another layout
    path.write_text("\n".join(lines) + "\n")
    after = JsonlStream(path, window=8).fingerprint()
    assert after["records"] == 20 and after["shard files"] != before["shard files"]
    tokens = tmp_path / "t.bin"
    np.arange(100, dtype=np.uint16).tofile(tokens)
    assert TokenStream(tokens, 10).fingerprint() | {"shard files": ""} == {
        "stream": "TokenStream",
        "records": 10,
        "window": 8192,
        "shards": 1,
        "shard files": "",
        "seq_len": 10,
    }
    assert TokenStream(tokens, 10).fingerprint()["shard files"] == "t.bin: 100 tokens of uint16"
