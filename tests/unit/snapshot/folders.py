"""Folder snapshots (``ddpkit.snapshot._disk.DiskStore``) of a small state, saved, loaded and
resealed after a change: the helpers of the tests of folder snapshots and of every format ddpkit
reads."""

from __future__ import annotations

import hashlib
import json

import torch

from ddpkit.snapshot._disk import MARKER, DiskStore


def state(step: int) -> tuple[dict, dict]:
    return {"model": {"w": torch.full((4,), float(step))}}, {"step": step, "rng": torch.arange(3)}


def save(ckpt: DiskStore, step: int) -> None:
    ckpt.save(step, *state(step))


def load(ckpt: DiskStore, size: int = 4):
    found = ckpt.latest(warn=lambda msg: None)
    sharded, extra = ckpt.load(found, lambda: {"model": {"w": torch.zeros(size)}})
    return found, sharded, extra


def reseal(folder) -> None:
    """Rewrite the marker's sizes and checksums for the files as they now are: whoever can write the
    folder can."""
    marker = json.loads((folder / MARKER).read_text())
    marker["files"] = {
        name: {
            "size": (folder / name).stat().st_size,
            "sha256": hashlib.sha256((folder / name).read_bytes()).hexdigest(),
        }
        for name in marker["files"]
    }
    (folder / MARKER).write_text(json.dumps(marker))
