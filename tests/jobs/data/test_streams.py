"""Streams: each record once per epoch over ranks and loader workers, the same global order at any
world size, and an exact resume after a SIGKILL, with real processes; the adapters' reads and
refusals."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import ddpkit
from ddpkit import ConfigError
from ddpkit.data._stream import Stream, StreamOrder
from ddpkit.data._stream_sources import IterableStream, JsonlStream, TokenStream
from ddpkit.testing import run_job, run_on_ranks
from tests.jobs.scripts.stream_job import N_RECORDS, naive_steps, read_steps, write_records
from tests.trainer_checks import (
    assert_each_sample_once,
    bitwise_equal,
    max_abs_diff,
    rank_differences,
    resume_steps,
    samples_per_epoch,
)

JOB = str(Path(__file__).parents[1] / "scripts" / "stream_job.py")
GLOBAL_BATCH = 24  # 12 a rank at 2 ranks, 8 at 3


def record_ids(stream: Stream, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The whole order of ``epoch`` as record numbers in the natural order (shard offset +
    index)."""
    shards, index = StreamOrder(stream, seed, epoch, shuffle).records(np.arange(len(stream)))
    offsets = np.concatenate([[0], np.cumsum(np.asarray(stream.shard_sizes, dtype=np.int64))])
    return offsets[shards] + index


class Sized(Stream):
    """Shards of given sizes whose records are their global numbers: for the order alone."""

    def __init__(self, sizes, window, random_access=True):
        super().__init__(window=window)
        self.sizes, self.random_access = sizes, random_access

    @property
    def shard_sizes(self):
        return self.sizes


def global_steps(per_rank: list[list[list[int]]]) -> list[list[int]]:
    """Each step's records over all ranks, in rank order."""
    assert len({len(steps) for steps in per_rank}) == 1, "ranks took different numbers of steps"
    return [sum((steps[s] for steps in per_rank), []) for s in range(len(per_rank[0]))]


def repeated_and_missing(records: list[int], n: int) -> tuple[int, int]:
    return len(records) - len(set(records)), n - len(set(records))


# -- the order -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes, window", [([57, 0, 100], 16), ([157], 1), ([10, 20, 30], 1000), ([5] * 40, 7)]
)
def test_each_epochs_order_is_a_permutation_of_the_records_that_changes_by_epoch(sizes, window):
    stream = Sized(sizes, window)
    orders = [record_ids(stream, seed=3, epoch=e).tolist() for e in range(3)]
    for order in orders:
        assert sorted(order) == list(range(sum(sizes)))
    assert orders[0] != orders[1] != orders[2]
    assert record_ids(stream, seed=3, epoch=1).tolist() == orders[1]  # a function of (seed, epoch)
    assert record_ids(stream, seed=4, epoch=1).tolist() != orders[1]
    assert record_ids(stream, seed=3, epoch=1, shuffle=False).tolist() == list(range(sum(sizes)))


def test_a_source_read_front_to_back_is_shuffled_only_within_its_blocks():
    stream = Sized([100], window=16, random_access=False)
    order = record_ids(stream, seed=3, epoch=0)
    assert sorted(order.tolist()) == list(range(100))
    assert all(order[p] // 16 == p // 16 for p in range(100))  # blocks in the source's order
    assert order[:16].tolist() != list(range(16))
    # A random-access source also mixes blocks and shards.
    mixed = record_ids(Sized([100], window=16), seed=3, epoch=0)
    assert any(mixed[p] // 16 != p // 16 for p in range(100))


def test_the_order_keeps_a_few_block_permutations_not_one_of_every_record():
    order = StreamOrder(Sized([10_000_000], window=1024), seed=0, epoch=0, shuffle=True)
    shards, index = order.records(np.arange(5_000_000, 5_000_024))
    assert (shards == 0).all() and len(set(index.tolist())) == 24
    assert len(order._tau) <= 2 and order.block_order.nbytes == 8 * 9766


# -- the adapters ----------------------------------------------------------------------------------


def test_jsonl_index_is_built_at_every_open_and_kept_nowhere(tmp_path):
    path = tmp_path / "a.jsonl"
    # a blank line, CRLF, no final newline
    path.write_text('{"id": 0}\n\n{"id": 1}\r\n   {"id": 2}')
    stream = JsonlStream(path)
    assert len(stream) == 3
    assert stream.read(0, np.array([2, 0, 1])) == [{"id": 2}, {"id": 0}, {"id": 1}]
    assert stream.lines[0].tolist() == [[0, 9], [11, 21], [22, 34]]
    assert [p.name for p in tmp_path.iterdir()] == ["a.jsonl"]
    with open(path, "a") as f:
        f.write('\n{"id": 3}\n')
    assert len(JsonlStream(path)) == 4
    assert len(JsonlStream(path, cache_index=False)) == 4  # accepted, no longer needed


def test_a_stream_of_many_shards_keeps_few_files_open(tmp_path):
    paths = []
    for shard in range(70):
        paths.append(tmp_path / f"part{shard:02d}.jsonl")
        paths[-1].write_text("".join(json.dumps({"id": 3 * shard + i}) + "\n" for i in range(3)))
    stream = JsonlStream(paths)
    got = [r["id"] for shard in range(70) for r in stream.read(shard, np.array([2, 0, 1]))]
    assert got == [3 * s + i for s in range(70) for i in (2, 0, 1)]
    assert len(stream.local()) == 64 and 0 not in stream.local() and 69 in stream.local()


def test_jsonl_refuses_a_missing_file_and_names_a_line_that_is_not_json(tmp_path):
    with pytest.raises(ConfigError, match="nowhere.jsonl is not a file"):
        JsonlStream(tmp_path / "nowhere.jsonl")
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 0}\n{"id": \n')
    with pytest.raises(ValueError, match="bad.jsonl: the line at byte 10 is not JSON"):
        JsonlStream(path).read(0, np.array([1]))


def test_token_file_records_are_fixed_length_slices(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    stream = TokenStream(path, seq_len=7)
    assert len(stream) == 142  # the last 6 tokens make no record
    first, last = stream.read(0, np.array([0, 141]))
    assert first.tolist() == list(range(7)) and last.tolist() == list(range(987, 994))
    batches = list(ddpkit.build_loader(stream, 8, num_workers=0))
    assert len(batches) == 17 and batches[0].shape == (8, 7) and batches[0].dtype == torch.int64
    assert sorted(torch.cat(batches)[:, 0].tolist()) != list(range(0, 7 * 136, 7))  # shuffled, ...
    assert set(torch.cat(batches)[:, 0].tolist()) <= set(range(0, 7 * 142, 7))  # ... whole records
    path.write_bytes(b"123456")
    with pytest.raises(ConfigError, match="has 6 bytes, not a whole number of int32 tokens"):
        TokenStream(path, 7, dtype=np.int32)
    with pytest.raises(ConfigError, match="seq_len=0"):
        TokenStream(path, 0)


class SplitsItself(torch.utils.data.IterableDataset):
    """Splits itself among loader workers, as many IterableDatasets do: each worker sees a part."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        return iter(range(info.id, 40, info.num_workers) if info else range(40))


def test_an_iterable_that_splits_itself_among_workers_is_refused(tmp_path):
    stream = IterableStream(SplitsItself(), num_records=40, window=8)
    assert len(IterableStream(SplitsItself(), window=8)) == 40  # counted by one pass
    in_main = [
        i for batch in ddpkit.build_loader(stream, 4, num_workers=0, collate_fn=list) for i in batch
    ]
    assert sorted(in_main) == list(range(40))
    loader = ddpkit.build_loader(stream, 4, num_workers=2, collate_fn=list)
    with pytest.raises(ConfigError, match="the stream ended after 20 records, num_records is 40"):
        list(loader)
    # Its persistent workers, stopped now: left to the garbage collector, they would stop in
    # whichever process collects them, a rank forked by a later test included (two 5 s join timeouts
    # there, on workers not its own).
    loader._iterator._shutdown_workers()


# -- ranks and workers, with real processes --------------------------------------------------------


def expected_steps(
    data: Path, seed: int, epochs: int, window: int = 16, iterable: bool = False
) -> list[list[int]]:
    """The global batches of ``epochs``, from the order alone (the file read front to back for
    ``iterable``)."""
    stream = (
        Sized([N_RECORDS], window, random_access=False)
        if iterable
        else JsonlStream(data, window=window)
    )
    steps = []
    for epoch in range(epochs):
        order = record_ids(stream, seed, epoch).tolist()
        steps += [
            order[s : s + GLOBAL_BATCH]
            for s in range(0, len(order) - GLOBAL_BATCH + 1, GLOBAL_BATCH)
        ]
    return steps


@pytest.mark.parametrize("iterable", [False, True], ids=["jsonl", "iterable"])
def test_each_record_once_per_epoch_over_two_ranks_and_two_workers(tmp_path, iterable):
    data = write_records(tmp_path / "records.jsonl")
    per_rank = run_on_ranks(
        functools.partial(read_steps, str(data), 12, workers=2, epochs=2, iterable=iterable), 2
    )[0]
    steps = global_steps(per_rank)
    # Rank r's batch is slice r of the global batch, whichever worker read it: the order cut into
    # steps.
    assert steps == expected_steps(data, seed=11, epochs=2, iterable=iterable)
    for epoch in (steps[:10], steps[10:]):
        assert repeated_and_missing(sum(epoch, []), N_RECORDS) == (0, 0)


def test_control_a_plain_iterable_dataset_in_two_workers_yields_each_record_twice(tmp_path):
    data = write_records(tmp_path / "records.jsonl")
    per_rank = run_on_ranks(
        functools.partial(naive_steps, str(data), 12, workers=2, by_worker=False), 2
    )[0]
    assert repeated_and_missing(sum(global_steps(per_rank), []), N_RECORDS) == (N_RECORDS, 0)


def test_a_stream_stopped_at_two_ranks_continues_at_three_in_the_same_order(tmp_path):
    data = write_records(tmp_path / "records.jsonl")
    head = run_on_ranks(functools.partial(read_steps, str(data), 12, workers=2, stop_after=5), 2)[0]
    tail = run_on_ranks(
        functools.partial(read_steps, str(data), 8, workers=2, start=(0, 5 * GLOBAL_BATCH)), 3
    )[0]
    steps = global_steps(head) + global_steps(tail)
    assert [sorted(s) for s in steps] == [
        sorted(s) for s in expected_steps(data, seed=11, epochs=1)
    ]
    assert repeated_and_missing(sum(steps, []), N_RECORDS) == (0, 0)
    # Control: the usual split by rank and worker, resumed by skipping the cursor's share in each
    # worker's part, repeats and skips records: its workers had read unequal amounts (5 steps over 2
    # workers).
    head = run_on_ranks(functools.partial(naive_steps, str(data), 12, workers=2, stop_after=5), 2)[
        0
    ]
    tail = run_on_ranks(
        functools.partial(naive_steps, str(data), 8, workers=2, cursor=5 * GLOBAL_BATCH), 3
    )[0]
    repeated, missing = repeated_and_missing(
        sum(global_steps(head) + global_steps(tail), []), N_RECORDS
    )
    assert repeated > 0 and missing > 0, (repeated, missing)


# -- the Trainer under the launcher (slow) ---------------------------------------------------------


def launch(
    tmp: Path, name: str, data: Path, *job_args: str, nproc: int = 2, restarts: int = 2, env: dict
) -> dict:
    log = tmp / f"{name}-log"
    log.mkdir(exist_ok=True)
    job = (
        str(tmp / name),
        "--data",
        str(data),
        "--sample-log",
        str(log),
        "--out",
        str(tmp / f"{name}.pt"),
    )
    restart = ("--max-restarts", str(restarts))
    proc = run_job(
        JOB, *job, *job_args, nproc=nproc, launcher_args=restart, env=env, cwd=tmp, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp / f"{name}.pt", weights_only=False)


def trained_steps(log_dir: Path) -> dict[int, list[int]]:
    """Step -> the records trained on in it over all ranks, from the last attempt that trained
    it."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for path in sorted(log_dir.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            by_step.setdefault(rec["step"], {}).setdefault(rec["attempt"], []).extend(rec["idx"])
    return {step: attempts[max(attempts)] for step, attempts in by_step.items()}


# Kills mid-epoch: (rank, step) -> the snapshots the restart may resume from (they are taken every 3
# steps and at the end of epoch 0, step 10): the newest, or the one before it when the newest was
# still being written in the background.
STREAM_KILLS = {"rank 1 in epoch 0": (1, 7, (6, 3)), "rank 0 in epoch 1": (0, 14, (12, 10))}


@pytest.mark.slow
# five 2-rank jobs with 2 loader workers a rank: about a minute, more under load
@pytest.mark.timeout(900)
def test_sigkill_mid_epoch_with_loader_workers_resumes_bitwise(tmp_path, clean_env):
    data = write_records(tmp_path / "records.jsonl")
    reference = launch(tmp_path, "reference", data, env=clean_env)
    for what, (rank, step, resumed_from) in STREAM_KILLS.items():
        name = what.replace(" ", "-")
        final = launch(
            tmp_path, name, data, "--kill-rank", str(rank), "--kill-step", str(step), env=clean_env
        )
        # Proof of the kill: the worker's mark, and a restarted job that resumed from a snapshot
        # mid-epoch.
        assert list((tmp_path / f"{name}-log").glob("killed-*")) and final["attempt"] == 1, what
        assert final["resumed_from"] in resumed_from, (what, final["resumed_from"])
        per_epoch = samples_per_epoch(tmp_path / f"{name}-log", resume_steps(tmp_path / name))
        assert_each_sample_once(per_epoch, N_RECORDS, 2)
        print(
            f"\n{what}: killed at step {step}, resumed from {final['resumed_from']}: max |dw| "
            f"{max_abs_diff(final, reference):.1e}"
        )
        assert bitwise_equal(final, reference), what
        assert rank_differences(tmp_path / f"{name}.pt", tmp_path / "reference.pt") == {
            0: [],
            1: [],
        }, what
    # Control: the transform's draws left to each worker's own stream: the same kill ends elsewhere.
    plain = launch(tmp_path, "plain", data, "--unseeded-samples", env=clean_env)
    plain_killed = launch(
        tmp_path,
        "plain-killed",
        data,
        "--unseeded-samples",
        "--kill-rank",
        "1",
        "--kill-step",
        "7",
        env=clean_env,
    )
    assert list((tmp_path / "plain-killed-log").glob("killed-*")) and plain_killed["attempt"] == 1
    print(f"control, unseeded transform: max |dw| {max_abs_diff(plain_killed, plain):.1e}")
    assert not bitwise_equal(plain_killed, plain)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_stopped_at_two_ranks_resumes_at_three_with_the_same_global_order(
    tmp_path, clean_env
):
    data = write_records(tmp_path / "records.jsonl")
    launch(tmp_path, "run", data, "--max-steps", "5", env=clean_env)
    final = launch(tmp_path, "run", data, "--workers", "1", nproc=3, env=clean_env)
    assert final["resumed_from"] == 5 and final["step"] == 20
    worlds = {
        json.loads(line)["world"]
        for p in (tmp_path / "run-log").glob("*.jsonl")
        for line in p.read_text().splitlines()
    }
    assert worlds == {2, 3}
    steps = trained_steps(tmp_path / "run-log")
    expected = expected_steps(data, seed=3, epochs=2, window=64)
    assert sorted(steps) == list(range(20))
    assert [sorted(steps[s]) for s in range(20)] == [sorted(s) for s in expected]
    for epoch in (range(10), range(10, 20)):
        assert repeated_and_missing(sum((steps[s] for s in epoch), []), N_RECORDS) == (0, 0)
