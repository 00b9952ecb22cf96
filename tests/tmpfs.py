"""A real file system that runs out of space: a small tmpfs mounted for one test, and a way to fill
it."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(where: Path, size: str = "4m") -> Iterator[Path]:
    """``where``, with a tmpfs of ``size`` mounted on it for the duration; skips the test where
    mounting is not permitted (it needs root, or CAP_SYS_ADMIN)."""
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs to fill (needs root or CAP_SYS_ADMIN): {proc.stderr.strip()}"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(folder: Path, leave: int = 0) -> None:
    """Write a file into ``folder`` until its file system has no page left (large writes, then
    page-sized ones for the last pages), then give back ``leave`` bytes: a write larger than that
    starts, and fails part-way, as when a disk fills up during a snapshot."""
    filler = folder / f"filler-{len(list(folder.glob('filler-*')))}"
    with open(filler, "wb", buffering=0) as f:
        for size in (1 << 20, 4096):
            while True:
                try:
                    f.write(bytes(size))
                except OSError as err:
                    if err.errno != errno.ENOSPC:
                        raise
                    break
        f.truncate(max(0, f.tell() - leave))
