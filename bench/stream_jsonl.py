"""What reading a JSON Lines file through :class:`ddpkit.data._stream_sources.JsonlStream` costs,
against a plain reader.

One process, no loader workers, the file in the page cache (a first untimed pass reads it). Each
round times, in turn:

- ``plain``: ``for line in open(path): json.loads(line)``, the front-to-back reader a stream
  replaces;
- ``stream, in order``: the records of an epoch by global position, ``batch`` at a time, as a
  loader's batches ask them (``StreamSamples.__getitems__``), without shuffling (``pread`` of each
  line, then decoding);
- ``stream, shuffled``: the same with the two-level shuffle (shards, blocks of ``window`` records);
- ``loader, shuffled``: ``build_loader(stream, batch, num_workers=0)`` with a list collate, the
  DataLoader's own overhead included.

and reports the median records/s over rounds and each stream's ratio to ``plain`` measured in the
same round. The stream is built once before the rounds (its line index's time printed).

    python bench/stream_jsonl.py                 # 200,000 records of ~190 bytes, batch 64, 5 rounds
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import ddpkit
from ddpkit.data import EpochIndices
from ddpkit.data._stream import StreamSamples
from ddpkit.data._stream_sources import JsonlStream


def write(path: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            f.write(
                json.dumps({"id": i, "text": "w" * int(rng.integers(100, 200)), "label": i % 7})
                + "\n"
            )


def plain(path: Path) -> int:
    n = 0
    with open(path) as f:
        for line in f:
            json.loads(line)
            n += 1
    return n


def by_position(stream: JsonlStream, shuffle: bool, batch: int) -> int:
    samples = StreamSamples(stream, seed=0, shuffle=shuffle)
    n = len(stream)
    for start in range(0, n, batch):
        samples.__getitems__(EpochIndices(range(start, min(start + batch, n)), 0))
    return n


def through_loader(stream: JsonlStream, batch: int) -> int:
    loader = ddpkit.build_loader(stream, batch, num_workers=0, drop_last=False, collate_fn=list)
    return sum(len(b) for b in loader)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "records.jsonl"
        write(path, a.records)
        plain(path)  # into the page cache
        t0 = time.perf_counter()
        stream = JsonlStream(path)
        built = time.perf_counter() - t0
        size = path.stat().st_size
        print(
            f"{datetime.date.today()} {platform.node()} python {platform.python_version()} torch "
            f"{torch.__version__} numpy {np.__version__}; {a.records} records, {size / 1e6:.1f} "
            f"MB, batch {a.batch}, window {stream.window}, {a.rounds} rounds; one process, no "
            "workers"
        )
        print(f"line index: built in {built * 1e3:.0f} ms ({size / built / 1e6:.0f} MB/s)")
        cases = {
            "plain": lambda: plain(path),
            "stream, in order": lambda: by_position(stream, False, a.batch),
            "stream, shuffled": lambda: by_position(stream, True, a.batch),
            "loader, shuffled": lambda: through_loader(stream, a.batch),
        }
        rates: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(a.rounds):
            for name, run in cases.items():
                t0 = time.perf_counter()
                n = run()
                rates[name].append(n / (time.perf_counter() - t0))
        print(f"{'reader':20s} {'records/s':>10s} {'x plain':>8s}")
        for name, r in rates.items():
            ratio = statistics.median(x / y for x, y in zip(r, rates["plain"]))
            print(f"{name:20s} {statistics.median(r):10.0f} {ratio:8.2f}")


if __name__ == "__main__":
    main()
