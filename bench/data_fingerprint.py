"""What the data fingerprint costs: a ``Subset``'s indices hashed, and a JSON Lines file checked by
its content.

One process. Each round times, in turn:

- ``subset indices (list)``: :func:`ddpkit.data._fingerprint.dataset_items` of a ``Subset`` whose
  ``indices`` is a list of ``--indices`` ints (what ``random_split`` makes): numpy's conversion,
  then the hash;
- ``subset indices (tensor)``: the same with a tensor of indices;
- ``read``: the file read once in 16 MiB pieces, nothing else done: the speed of the storage it sits
  on (here the page cache; a first untimed pass reads it in);
- ``hash``: the file read as ``read`` does and hashed (SHA-256), nothing else: the part of a
  stream's open that checks its content;
- ``index built``: :func:`~ddpkit.data._stream_sources.indexed_lines`, newlines found and the bytes
  hashed in one pass: what every stream built pays (no index is kept beside the file).

and reports the median seconds over rounds, and for the file each pass's speed and its ratio to
``read`` measured in the same round.

    python bench/data_fingerprint.py                     # 10^6 indices, a 320 MB file, 3 rounds
    python bench/data_fingerprint.py --mb 32 --rounds 5
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Subset, TensorDataset

from ddpkit.data._fingerprint import dataset_items
from ddpkit.data._stream_sources import indexed_lines


def write(path: Path, megabytes: int) -> int:
    """Records of ~190 bytes (as ``bench/stream_jsonl.py``'s) up to ``megabytes``: a block of 10,000
    repeated."""
    rng = np.random.default_rng(0)
    block = "".join(
        json.dumps({"id": i, "text": "w" * int(rng.integers(100, 200)), "label": i % 7}) + "\n"
        for i in range(10_000)
    ).encode()
    copies = max(1, megabytes * 10**6 // len(block))
    with open(path, "wb") as f:
        for _ in range(copies):
            f.write(block)
    return copies * 10_000


def read(path: Path, hasher=None) -> None:
    buffer = memoryview(bytearray(1 << 24))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            if hasher is not None:
                hasher.update(buffer[:n])


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--indices", type=int, default=10**6)
    parser.add_argument("--mb", type=int, default=320, help="size of the JSON Lines file")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--dir", default=None, help="folder for the file (default: the system's temporary one)"
    )
    args = parser.parse_args()

    chosen = torch.randperm(2 * args.indices, generator=torch.Generator().manual_seed(0))[
        : args.indices
    ]
    base = TensorDataset(torch.zeros(2 * args.indices, dtype=torch.uint8))
    as_list, as_tensor = Subset(base, chosen.tolist()), Subset(base, chosen)

    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = Path(folder) / "data.jsonl"
        records = write(path, args.mb)
        size = path.stat().st_size
        read(path)  # into the page cache, untimed
        for _ in range(args.rounds):
            for name, fn in [
                ("subset indices (list)", lambda: dataset_items(as_list)),
                ("subset indices (tensor)", lambda: dataset_items(as_tensor)),
                ("read", lambda: read(path)),
                ("hash", lambda: read(path, hashlib.sha256())),
                ("index built", lambda: indexed_lines(path)),
            ]:
                times.setdefault(name, []).append(timed(fn))

    print(
        f"{datetime.date.today()}, {platform.node()}, "
        f"{platform.processor() or platform.machine()}, python {platform.python_version()}, torch "
        f"{torch.__version__}, numpy {np.__version__}; {args.rounds} rounds, medians"
    )
    print(
        f"{args.indices:,} Subset indices; a JSON Lines file of {size / 1e6:.0f} MB, {records:,} "
        "records"
    )
    for name, values in times.items():
        median = statistics.median(values)
        line = f"  {name:24s} {median:7.3f} s"
        if name not in ("subset indices (list)", "subset indices (tensor)"):
            ratio = statistics.median(v / r for v, r in zip(values, times["read"]))
            line += f"  {size / median / 1e9:5.2f} GB/s  x{ratio:4.1f} the read"
        print(line)


if __name__ == "__main__":
    main()
