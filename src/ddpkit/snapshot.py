"""Single-file snapshots that are whole or absent: atomic writes, a checksummed manifest, and the newest good one.

The Trainer writes sharded snapshots as folders (:mod:`ddpkit.checkpoint`), with :func:`write_atomic` from here;
it still reads snapshots in this format, which earlier versions wrote.

Layout of ``run_dir/snapshots``::

    step-00000120.pt      the state, written as .step-00000120.pt.tmp, fsynced, then renamed
    step-00000120.json    the manifest (size, sha256), written the same way after the .pt is in place

A snapshot exists only once its manifest does, so a process killed at any instant leaves either the previous
snapshot as the newest or the new one whole. On load, a snapshot whose file is missing, truncated or altered
(size or checksum off) is reported by name and the one before it is used.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"step-(\d+)\.json$")


@dataclass(frozen=True)
class SnapshotInfo:
    step: int
    path: Path
    size: int
    sha256: str


def _fsync_dir(folder: Path) -> None:
    # The rename is durable only once the folder's entry is on disk too.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: a temporary file, fsynced, renamed over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def save_snapshot(folder: str | os.PathLike, step: int, state: dict[str, Any], keep_last: int = 2) -> SnapshotInfo:
    """Write ``state`` as the snapshot of ``step`` atomically, then delete all but the ``keep_last`` newest."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    data = buffer.getbuffer()
    info = SnapshotInfo(step, folder / f"step-{step:08d}.pt", len(data), hashlib.sha256(data).hexdigest())
    write_atomic(info.path, bytes(data))
    manifest = {"step": step, "file": info.path.name, "size": info.size, "sha256": info.sha256}
    write_atomic(folder / f"step-{step:08d}.json", json.dumps(manifest).encode())
    _prune(folder, keep_last)
    return info


def list_snapshots(folder: str | os.PathLike) -> list[SnapshotInfo]:
    """Snapshots with a manifest, newest first (not yet checked against their checksum)."""
    folder = Path(folder)
    found = []
    for manifest in folder.glob("step-*.json") if folder.is_dir() else []:
        if not _NAME.search(manifest.name):
            continue
        try:
            meta = json.loads(manifest.read_text())
            found.append(SnapshotInfo(int(meta["step"]), folder / meta["file"], int(meta["size"]), meta["sha256"]))
        except (ValueError, KeyError, OSError):
            continue  # a manifest is written atomically; an unreadable one was not written by us
    return sorted(found, key=lambda s: s.step, reverse=True)


def verify(info: SnapshotInfo) -> bytes | str:
    """The snapshot's bytes if its size and checksum match its manifest, else what is wrong with it."""
    try:
        data = info.path.read_bytes()
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if len(data) != info.size:
        return f"is truncated or altered ({len(data)} bytes, manifest says {info.size})"
    if hashlib.sha256(data).hexdigest() != info.sha256:
        return "does not match its checksum (corrupt)"
    return data


def load_latest(
    folder: str | os.PathLike,
    map_location: Any = None,
    warn: Callable[[str], None] = print,
) -> tuple[SnapshotInfo, dict[str, Any]] | None:
    """The newest snapshot that is whole, loaded onto ``map_location``; None if there is none."""
    for info in list_snapshots(folder):
        data = verify(info)
        if isinstance(data, str):
            warn(f"ddpkit: skipping snapshot {info.path}: it {data}; trying the one before it")
            continue
        # weights_only: a snapshot holds tensors and plain values only, so loading it runs no pickled code.
        return info, torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    return None


def _prune(folder: Path, keep_last: int) -> None:
    complete = list_snapshots(folder)
    keep = {s.path.name for s in complete[: max(1, keep_last)]}
    newest = complete[0].step if complete else -1
    for old in complete[max(1, keep_last) :]:
        # Manifest first: a crash half-way leaves an orphan file, never a manifest without its file.
        (folder / f"step-{old.step:08d}.json").unlink(missing_ok=True)
        old.path.unlink(missing_ok=True)
    for path in folder.glob("step-*.pt"):
        step = int(re.findall(r"\d+", path.name)[0])
        if path.name not in keep and step < newest:
            path.unlink(missing_ok=True)  # orphan of a write killed before its manifest
    for tmp in folder.glob(".step-*.tmp"):
        tmp.unlink(missing_ok=True)


def save_weights(path: str | os.PathLike, weights: dict[str, Any]) -> None:
    """Write ``weights`` (a dict of tensors and plain values) to ``path`` atomically: whole, or the old file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    write_atomic(path, buffer.getvalue())
