"""Probe of mosaicml-streaming's guarantees, with real processes: the library closest to ours on
paper.

Questions, for records numbered 0..N-1 written in its MDS format, ``global_batch`` records a step:
  1. each record once per epoch, at 2 and at 3 ranks, with 2 loader workers a rank;
  2. the same global batches (as sets, step by step) at 2 and at 3 ranks;
  3. a state saved at 2 ranks after some steps, loaded at 3 ranks: the rest of the epoch as in an
     uninterrupted 2-rank run, nothing repeated or skipped.

``--litdata``: litdata's assignment of items to (rank, worker) for an unshuffled dataset of 24
chunks of 10 items, turned into the global batches a DataLoader gives (each worker's batches, taken
worker by worker), at 2 and at 3 ranks with 2 workers each (a pure function of the library: no
processes needed).

Not part of the test suite and not dependencies of ddpkit: both libraries pull an unpinned torch
(through torchvision) and mosaicml-streaming pins numpy<2.2, so install them beside the CPU torch
without their dependencies:

    .venv/bin/pip install --no-deps mosaicml-streaming==0.13.0 transformers==4.57.6 \
        huggingface_hub==0.36.2 tokenizers==0.22.2 safetensors regex Brotli python-snappy cramjam \
        zstd catalogue
    .venv/bin/python bench/stream_library_probe.py [N] [global_batch]
    .venv/bin/pip install --no-deps litdata==0.2.76 lightning-utilities obstore boto3 botocore \
        s3transfer jmespath
    .venv/bin/python bench/stream_library_probe.py --litdata

Its package ``__init__`` imports its vision and multimodal datasets, hence torchvision, whose wheels
on PyPI are built for CUDA torch and do not load beside the CPU build: those two submodules are
replaced by empty modules here, before the import (the probe uses ``streaming.base`` only).
"""

from __future__ import annotations

import os
import sys
import tempfile
import types
from collections import Counter

import torch.multiprocessing as mp

if "--litdata" not in sys.argv:
    for _name in ("streaming.vision", "streaming.multimodal"):
        sys.modules[_name] = types.ModuleType(_name)


def _env(rank: int, world: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29577",
    )


def _rank(
    rank: int, world: int, local: str, batch: int, stop_after: int | None, state, out
) -> None:
    _env(rank, world)
    from streaming import StreamingDataLoader, StreamingDataset

    ds = StreamingDataset(
        local=local, shuffle=True, shuffle_seed=7, batch_size=batch, num_canonical_nodes=1
    )
    if state is not None:
        ds.load_state_dict(state)
    loader = StreamingDataLoader(ds, batch_size=batch, num_workers=2)
    steps = []
    for i, b in enumerate(loader):
        steps.append(b["id"].tolist())
        if stop_after is not None and i + 1 == stop_after:
            if rank == 0:
                out.put(("state", loader.state_dict()))
            break
    out.put((rank, steps))


def run(world: int, local: str, global_batch: int, stop_after: int | None = None, state=None):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank, args=(r, world, local, global_batch // world, stop_after, state, q)
        )
        for r in range(world)
    ]
    for p in procs:
        p.start()
    got = dict(q.get() for _ in range(world + (stop_after is not None)))
    for p in procs:
        p.join()
    steps = max(len(got[r]) for r in range(world))
    per_step = [
        sorted(sum((got[r][s] for r in range(world) if s < len(got[r])), [])) for s in range(steps)
    ]
    return per_step, got.get("state"), [len(got[r]) for r in range(world)]


def report(name: str, per_step: list[list[int]], n: int) -> None:
    seen = Counter(i for step in per_step for i in step)
    twice = sum(c - 1 for c in seen.values() if c > 1)
    print(
        f"{name}: {len(per_step)} steps, {sum(seen.values())} records, {twice} repeated, "
        f"{n - len(seen)} never"
    )


def litdata_global_batches(
    world: int, workers: int, global_batch: int, chunks: int = 24, per_chunk: int = 10
):
    from litdata.streaming.item_loader import Interval
    from litdata.utilities.env import _DistributedEnv
    from litdata.utilities.shuffle import _associate_chunks_and_intervals_to_workers

    intervals = [
        Interval(c * per_chunk, c * per_chunk, (c + 1) * per_chunk, (c + 1) * per_chunk)
        for c in range(chunks)
    ]
    b = global_batch // world
    _, assigned = _associate_chunks_and_intervals_to_workers(
        _DistributedEnv(world, 0, 1), range(chunks), intervals, True, workers, b
    )
    per_rank = []
    for r in range(world):
        items = [
            [i for iv in assigned[r * workers + w] for i in range(iv[1], iv[2])]
            for w in range(workers)
        ]
        batches = [[s[k : k + b] for k in range(0, len(s) - b + 1, b)] for s in items]
        per_rank.append(
            [
                batches[w][k]
                for k in range(max(map(len, batches)))
                for w in range(workers)
                if k < len(batches[w])
            ]
        )
    return [
        sorted(sum((per_rank[r][s] for r in range(world)), []))
        for s in range(min(map(len, per_rank)))
    ]


def main() -> None:
    if sys.argv[1:] == ["--litdata"]:
        two, three = litdata_global_batches(2, 2, 24), litdata_global_batches(3, 2, 24)
        print(
            "litdata: global batches equal as sets at 2 and 3 ranks: "
            f"{sum(a == b for a, b in zip(two, three))} of {len(two)}\n  step 0 at 2 ranks: "
            f"{two[0]}\n  step 0 at 3 ranks: {three[0]}"
        )
        return
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 240
    global_batch = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    from streaming import MDSWriter

    with tempfile.TemporaryDirectory() as tmp:
        local = os.path.join(tmp, "mds")
        with MDSWriter(out=local, columns={"id": "int"}, size_limit=1 << 10) as w:
            for i in range(n):
                w.write({"id": i})
        two, _, _ = run(2, local, global_batch)
        three, _, _ = run(3, local, global_batch)
        report("2 ranks x 2 workers", two, n)
        report("3 ranks x 2 workers", three, n)
        same = sum(a == b for a, b in zip(two, three))
        print(
            f"global batches equal as sets at 2 and 3 ranks: {same} of {max(len(two), len(three))}"
        )
        k = 4
        head, state, _ = run(2, local, global_batch, stop_after=k)
        print(f"state after {k} steps at 2 ranks: {state}")
        tail, _, lens = run(3, local, global_batch, state=state)
        report(f"2 ranks for {k} steps, then 3 ranks", head + tail, n)
        print(
            f"the 3-rank rest equals the uninterrupted 2-rank rest, step by step: {tail == two[k:]}"
        )


if __name__ == "__main__":
    main()
