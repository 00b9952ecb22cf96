"""The snapshot folders of a run: their names, the marker that makes one whole, its check, and the prune."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MARKER = "complete.json"
_FOLDER = re.compile(r"^step-(\d+)$")


@dataclass(frozen=True)
class Found:
    """A whole snapshot: a ``step-N/`` folder."""

    step: int
    path: Path


def folder_name(step: int) -> str:
    return f"step-{step:08d}"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def digest(paths: list[Path]) -> dict[str, dict[str, Any]]:
    return {p.name: {"size": p.stat().st_size, "sha256": sha256(p)} for p in paths}


def candidates(folder: Path) -> list[Found]:
    """Snapshot folders with a marker, newest first; not yet verified."""
    found = []
    for path in folder.glob("step-*") if folder.is_dir() else []:
        match = _FOLDER.match(path.name)
        if match and path.is_dir() and (path / MARKER).exists():
            found.append(Found(int(match.group(1)), path))
    return sorted(found, key=lambda f: f.step, reverse=True)


def verify(found: Found) -> str | None:
    """None if ``found`` is whole, else what is wrong with it."""
    try:
        marker = json.loads((found.path / MARKER).read_text())
        files = marker["files"]
    except (OSError, ValueError, KeyError):
        return f"has an unreadable {MARKER}"
    for name, want in files.items():
        file = found.path / name
        if not file.exists():
            return f"is missing {name}"
        if file.stat().st_size != want["size"]:
            return f"has {name} truncated or altered ({file.stat().st_size} bytes, marker says {want['size']})"
        if sha256(file) != want["sha256"]:
            return f"has {name} not matching its checksum (corrupt)"
    return None


def prune(folder_path: Path, keep_last: int, newest: int) -> None:
    """Remove whole snapshots older than the newest ``keep_last``, and the debris of killed writes."""
    whole = candidates(folder_path)
    keep = {f.path.name for f in whole[:keep_last]}
    # Every deletion goes through a descriptor of the folder opened without following links, and each
    # entry is lstat-ed: a link named like a snapshot (to another run's, say) loses only itself, never what
    # it points to; a snapshots/ that is itself a link is refused (ELOOP), not pruned.
    folder = os.open(folder_path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for name in os.listdir(folder):
            match = _FOLDER.match(name)
            if not match or name in keep or int(match.group(1)) >= newest:
                continue
            mode = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode
            if stat.S_ISLNK(mode):
                os.unlink(name, dir_fd=folder)
            elif stat.S_ISDIR(mode):
                # Marker first: a prune killed half-way leaves a folder without one (ignored), never a
                # marker whose files are gone.
                step = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
                try:
                    os.unlink(MARKER, dir_fd=step)
                except FileNotFoundError:
                    pass
                finally:
                    os.close(step)
                # rmtree walks by descriptors and unlinks links inside without following them; through
                # dir_fd from Python 3.11, by path before (the entry was lstat-ed as a folder just above).
                if sys.version_info >= (3, 11):
                    shutil.rmtree(name, dir_fd=folder, ignore_errors=True)
                else:
                    shutil.rmtree(os.path.join(folder_path, name), ignore_errors=True)
    finally:
        os.close(folder)
