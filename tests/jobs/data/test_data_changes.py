"""A resume on changed data is refused before any step, naming each change;
``on_data_change="restart_epoch"`` trains the epoch again on the new data; an iterable source whose
order differs between ranks is refused. Real 2-rank jobs over gloo; each refusal has its control:
the same resume by cursor alone (what a snapshot held before it had the data's fingerprint) trains
records twice and others never, counted."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

import ddpkit
import ddpkit.data._loader
from ddpkit import ConfigError
from ddpkit.data._stream_sources import IterableStream, JsonlStream
from ddpkit.testing import run_on_ranks

PER_RANK, WORLD, HEAD_STEPS = 8, 2, 4  # global batch 16: 160 records make 10 steps; stopped after 4
SEED = 5


def write_shard(path: Path, ids: range) -> Path:
    with open(path, "w") as f:
        for i in ids:
            # lines of different lengths
            f.write(json.dumps({"id": i, "pad": "x" * (i % 7)}) + "\n")
    return path


def ids_only(batch: list) -> list[int]:
    return [r["id"] if isinstance(r, dict) else int(r[0]) for r in batch]


def tensor_ids(batch: list) -> list[int]:
    return [int(t[0]) for t in batch]


def everyone(batches: list[list[int]]) -> list[int]:
    """Every rank's records of ``batches`` (each rank's list of batches), gathered."""
    return [i for rank in ddpkit.all_gather_object(batches) for batch in rank for i in batch]


def stream_loader(
    source: tuple[list[str], int], per_rank: int = PER_RANK, workers: int = 0, **kwargs
):
    paths, window = source
    stream = JsonlStream(paths, window=window)
    return ddpkit.build_loader(
        stream, per_rank, seed=SEED, num_workers=workers, collate_fn=ids_only, **kwargs
    )


def map_loader(n: int, per_rank: int = PER_RANK, workers: int = 0, **kwargs):
    dataset = TensorDataset(torch.arange(n))
    return ddpkit.build_loader(
        dataset, per_rank, seed=SEED, num_workers=workers, collate_fn=tensor_ids, **kwargs
    )


def resume_each(make, base, variants: dict) -> dict:
    """On every rank: 4 steps over ``base`` (2 loader workers, left with ``break``), then, for each
    variant of the data, a resume from the loader's state, a control resumed by cursor alone, and a
    restarted epoch."""
    ddpkit.init()
    head_loader = make(base, workers=2)
    head = []
    for batch in head_loader:
        head.append(batch)
        if len(head) == HEAD_STEPS:
            break
    state = head_loader.state_dict()
    out = {"state": state, "head": everyone(head), "variants": {}}
    for name, data in variants.items():
        got: dict = {}
        resumed = make(data)
        try:
            resumed.load_state_dict(state)
            got["tail"] = everyone(list(resumed))
        except ConfigError as err:
            got["refused"] = str(err)
        control = make(data)  # the resume as it was: the cursor alone
        control.batch_sampler.set_position(state["epoch"], state["cursor"])
        got["control"] = everyone(list(control))
        restarted = make(data, on_data_change="restart_epoch")
        restarted.load_state_dict(state)
        got["restarted"], got["changes"] = everyone(list(restarted)), restarted.data_changes
        got["next_epoch"] = restarted.position()
        out["variants"][name] = got
    return out


def twice_and_never(trained: list[int], records: set[int]) -> tuple[int, int]:
    return len(trained) - len(set(trained)), len(records - set(trained))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> dict[str, tuple[list[str], int]]:
    root = tmp_path_factory.mktemp("shards")
    (root / "grown").mkdir()
    a = write_shard(root / "a.jsonl", range(0, 80))
    b = write_shard(root / "b.jsonl", range(100, 180))
    shutil.copy(a, root / "grown" / "a.jsonl")
    grown_b = write_shard(root / "grown" / "b.jsonl", list(range(100, 180)) + list(range(200, 224)))
    return {
        "same": ([str(a), str(b)], 32),
        "swapped": ([str(b), str(a)], 32),
        "appended": ([str(root / "grown" / "a.jsonl"), str(grown_b)], 32),
        "window": ([str(a), str(b)], 64),
    }


@pytest.fixture(scope="module")
def stream_runs(shards) -> dict:
    variants = {k: v for k, v in shards.items()}
    return run_on_ranks(resume_each, WORLD, (stream_loader, shards["same"], variants))[0]


RECORDS = {
    "same": set(range(80)) | set(range(100, 180)),
    "swapped": set(range(80)) | set(range(100, 180)),
    "appended": set(range(80)) | set(range(100, 180)) | set(range(200, 224)),
    "window": set(range(80)) | set(range(100, 180)),
}
CHANGED = {
    "swapped": [
        r"shard 0: a\.jsonl: 80 records, \d+ bytes, content \w+ -> b\.jsonl: 80 records",
        r"shard 1: b\.jsonl",
    ],
    "appended": [
        r"records: 160 -> 184",
        r"shard 1: b\.jsonl: 80 records, \d+ bytes, content \w+ -> b\.jsonl: 104",
    ],
    "window": [r"window: 32 -> 64"],
}


def test_an_unchanged_stream_resumes_where_it_stopped(stream_runs):
    same = stream_runs["variants"]["same"]
    # 4 batches handed over, 2 workers
    assert stream_runs["state"]["cursor"] == HEAD_STEPS * PER_RANK * WORLD
    assert "refused" not in same and same["changes"] == []
    assert twice_and_never(stream_runs["head"] + same["tail"], RECORDS["same"]) == (0, 0)
    assert same["control"] == same["tail"]


@pytest.mark.parametrize("change", ["swapped", "appended", "window"])
def test_a_stream_resumed_on_changed_data_is_refused_naming_each_change(stream_runs, change):
    got = stream_runs["variants"][change]
    message = got["refused"]
    assert "\n" not in message and "on_data_change='restart_epoch'" in message
    assert "resuming at sample 64 of epoch 0" in message
    for pattern in CHANGED[change]:
        assert re.search(pattern, message), (pattern, message)
    # Control: resumed by the cursor alone, the epoch trains records twice and others never.
    twice, never = twice_and_never(stream_runs["head"] + got["control"], RECORDS[change])
    print(f"\n{change}, resumed by cursor alone: {twice} records twice, {never} never")
    assert twice > 0 and never > 0
    # The way out: the epoch again from its first step on the new data, every record once.
    dropped = len(RECORDS[change]) % 16  # drop_last: 184 records make 11 steps of 16
    assert got["changes"] and twice_and_never(got["restarted"], RECORDS[change]) == (0, dropped)
    assert got["next_epoch"] == (1, 0)


def test_a_map_style_dataset_whose_length_changed_is_refused():
    out = run_on_ranks(
        resume_each, WORLD, (map_loader, 160, {"same": 160, "longer": 184, "shorter": 150})
    )[0]
    same, longer, shorter = (out["variants"][k] for k in ("same", "longer", "shorter"))
    assert twice_and_never(out["head"] + same["tail"], set(range(160))) == (0, 0)
    assert (
        "dataset length: 160 -> 184" in longer["refused"]
        and "dataset length: 160 -> 150" in shorter["refused"]
    )
    for name, got, n in (("longer", longer, 184), ("shorter", shorter, 150)):
        twice, never = twice_and_never(out["head"] + got["control"], set(range(n)))
        print(f"\nmap-style {name}, resumed by cursor alone: {twice} records twice, {never} never")
        assert twice > 0 and never > 0
        assert twice_and_never(got["restarted"], set(range(n))) == (0, n % 16)


def test_a_stream_stopped_at_two_ranks_resumes_at_one_with_the_same_global_batch(
    stream_runs, shards
):
    # a world of one, the same global batch
    loader = stream_loader(shards["same"], per_rank=PER_RANK * WORLD)
    loader.load_state_dict(stream_runs["state"])
    tail = [i for batch in loader for i in batch]
    assert twice_and_never(stream_runs["head"] + tail, RECORDS["same"]) == (0, 0)
    assert sorted(tail) == sorted(stream_runs["variants"]["same"]["tail"])  # the same records
    # global batch 8: another order of steps
    other_batch = stream_loader(shards["same"], per_rank=PER_RANK)
    with pytest.raises(ConfigError, match="global batch: 16 -> 8"):
        other_batch.load_state_dict(stream_runs["state"])


# -- an iterable whose order differs between ranks -------------------------------------------------


class RankOrder:
    """Records 0..299 in an order of each process's own (as a set of strings iterates under each
    process's hash seed, or a shuffle seeded per process)."""

    def __init__(self, rank: int) -> None:
        self.order = list(range(300))
        random.Random(rank).shuffle(self.order)

    def __iter__(self):
        return iter(self.order)


def read_iterable(check: bool) -> dict:
    rt = ddpkit.init()
    stream = IterableStream(RankOrder(rt.rank), window=16)
    if not check:  # the control: every rank reports the same head, as the check had never looked
        stream._head = "unchecked"
    try:
        loader = ddpkit.build_loader(stream, 10, num_workers=0, collate_fn=list)
    except ConfigError as err:
        return {"refused": str(err)}
    return {"trained": everyone(list(loader))}


def test_an_iterable_whose_order_differs_between_ranks_is_refused_on_every_rank():
    for out in run_on_ranks(read_iterable, WORLD, (True,)):
        assert (
            "first 128 records differ between ranks (rank 0's differ from rank 1's)"
            in out["refused"]
        )
    # Control: unchecked, the epoch trains records twice and others never, and nothing fails.
    trained = run_on_ranks(read_iterable, WORLD, (False,))[0]["trained"]
    twice, never = twice_and_never(trained, set(range(300)))
    print(f"\nan order of each rank's own, unchecked: {twice} of 300 records twice, {never} never")
    assert twice > 0 and never > 0


# -- the Trainer -----------------------------------------------------------------------------------


def as_sample(record: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    return torch.tensor([float(record["id"])]), torch.tensor(record["id"] % 2), record["id"]


def fit_stream(
    run_dir: Path, paths: list[str], max_steps: int | None, on_data_change: str = "error"
) -> dict:
    """The Trainer on a stream of ``paths`` (one epoch, global batch 16, in this process): the ids
    it trained."""
    trained: list[int] = []

    def batch_loss(model, batch):
        x, y, ids = batch
        trained.extend(ids.tolist())
        return torch.nn.functional.cross_entropy(model(x), y)

    torch.manual_seed(0)
    model = torch.nn.Linear(1, 2)
    config = ddpkit.TrainerConfig(
        run_dir=str(run_dir), epochs=1, max_steps=max_steps, global_batch_size=16, num_workers=0,
        seed=SEED, logging=ddpkit.LoggingConfig(progress=False), on_data_change=on_data_change,
    )  # fmt: skip
    stream = JsonlStream(paths, transform=as_sample, window=32)
    trainer = ddpkit.Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), stream, config, batch_loss_fn=batch_loss
    )
    try:
        metrics = trainer.fit()
    except ConfigError as err:
        return {"refused": str(err), "trained": trained, "step": trainer.step}
    return {"trained": trained, "step": trainer.step, "metrics": metrics}


def test_the_trainer_refuses_a_resume_on_swapped_shards_before_any_step(
    tmp_path, shards, monkeypatch
):
    same, swapped = shards["same"][0], shards["swapped"][0]
    head = fit_stream(tmp_path / "run", same, max_steps=HEAD_STEPS)
    assert head["step"] == HEAD_STEPS and len(head["trained"]) == 64
    shutil.copytree(tmp_path / "run", tmp_path / "control")
    refused = fit_stream(tmp_path / "run", swapped, max_steps=None)
    assert "shard 0: a.jsonl" in refused["refused"] and "-> b.jsonl" in refused["refused"]
    # refused before any step, and before anything of the snapshot is loaded (its counters too)
    assert refused["trained"] == [] and refused["step"] == 0
    # Control: with the check off the resume trains on, ends normally, and the epoch repeats and
    # skips records.
    monkeypatch.setattr(ddpkit.data._loader, "changes", lambda saved, current: [])
    tail = fit_stream(tmp_path / "control", swapped, max_steps=None)
    assert "refused" not in tail and tail["step"] == 10
    twice, never = twice_and_never(head["trained"] + tail["trained"], RECORDS["swapped"])
    print(f"\nthe Trainer, shards swapped, unchecked: {twice} records twice, {never} never")
    assert twice > 0 and never > 0


def test_the_trainer_with_restart_epoch_trains_the_epoch_again_on_the_new_data(tmp_path, shards):
    same, swapped = shards["same"][0], shards["swapped"][0]
    head = fit_stream(tmp_path / "run", same, max_steps=HEAD_STEPS)
    assert head["step"] == HEAD_STEPS
    tail = fit_stream(tmp_path / "run", swapped, max_steps=None, on_data_change="restart_epoch")
    assert "refused" not in tail
    # The epoch from its first step on the swapped shards, in the order a fresh run takes: every
    # record once.
    assert (
        tail["step"] == HEAD_STEPS + 10
        and len(set(tail["trained"])) == len(tail["trained"]) == 10 * 16
    )
    fresh = fit_stream(tmp_path / "fresh", swapped, max_steps=None)
    assert fresh["trained"] == tail["trained"]
