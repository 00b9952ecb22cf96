"""The line index of a JSON Lines file kept beside it (``.NAME.lines``), used only where it can be
trusted.

The index says where each record lies; a wrong one makes the stream return other records than the
file holds, silently. So the file beside the data is read only when

- it belongs to this user, and the data folder is this user's and not writable by others (a sticky
  folder such as ``/tmp`` excepted: no one replaces another's files there): else another user could
  have planted or replaced it;
- it is not a link, its header names the data file's size and the digest of its content, hashed from
  the file's bytes each time (a file rewritten at the same size with its modification time put back
  is another file), its offsets match the checksum kept with them (a file cut short, a flipped byte,
  two copies spliced), and they are consistent: in increasing order, each line within the file, none
  overlapping the next.

What is not checked is an index rewritten by its own user with offsets that are consistent, the
content's digest copied and a checksum recomputed: telling that from the truth means finding every
newline of the data file, the work the index exists to save (hashing the file costs about as much as
reading it, the newline search as much again).

Otherwise the index is built in memory and used, and the reason is printed once per folder. It is
written through :mod:`ddpkit._fs`: a new file of an unpredictable name in the data folder, renamed
over the cache.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import numpy as np

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit.data._fingerprint import digest

_told: set[str] = set()


def _say_once(folder: Path, why: str) -> None:
    key = f"{folder}:{why}"
    if key not in _told:
        _told.add(key)
        print(
            f"ddpkit: the line index beside the data in {folder} is not used ({why}); it is built "
            "in memory",
            file=sys.stderr,
            flush=True,
        )


def trusted_folder(folder: Path) -> bool:
    """Whether a line index kept in ``folder`` can be trusted and written (said once when not)."""
    try:
        st = os.stat(folder)
    except OSError:
        return False
    owner = fs.other_owner(st)
    if owner is not None:
        _say_once(folder, f"the folder belongs to {fs.user_name(owner)} (uid {owner}), not to you")
        return False
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        _say_once(folder, "other users can write to the folder")
        return False
    return True


def read(cached: Path, header: np.ndarray, size: int) -> np.ndarray | None:
    """The offsets kept in ``cached`` if it is this user's, matches ``header`` and is consistent,
    else None."""
    try:
        st = os.lstat(cached)
    except FileNotFoundError:
        return None
    owner = fs.other_owner(st)
    if stat.S_ISLNK(st.st_mode) or owner is not None:
        whose = (
            "a symbolic link"
            if owner is None
            else f"a file of {fs.user_name(owner)} (uid {owner}), not yours"
        )
        _say_once(cached.parent, f"{cached.name} is {whose}")
        return None
    try:
        # what was checked above, never through a link
        fd = fs.open_fd(cached, os.O_RDONLY | os.O_NONBLOCK)
    except (ConfigError, OSError) as err:
        _say_once(cached.parent, f"{cached.name}: {err}")
        return None
    with os.fdopen(fd, "rb") as f:
        length = os.fstat(fd).st_size
        if length % 16 or length < 32:
            return None
        table = np.memmap(f, dtype=np.int64, mode="r").reshape(-1, 2)
    if not (np.array_equal(table[0], header[0]) and table[1, 0] == header[1, 0]):
        return None  # written for another version of the data file: rebuilt
    lines = table[2:]
    if table[1, 1] != checksum(lines) or not consistent(lines, size):
        _say_once(
            cached.parent, f"{cached.name} holds offsets that cannot be those of the file's lines"
        )
        return None
    return lines


def checksum(lines: np.ndarray) -> int:
    """The offsets' checksum kept in the header: the data fingerprint's digest of them
    (:func:`~ddpkit.data._fingerprint.digest`, 8 bytes of BLAKE2b) as an int64."""
    hex_digest = digest(np.ascontiguousarray(lines, dtype=np.int64).view(np.uint8).data)
    return int(np.frombuffer(bytes.fromhex(hex_digest), dtype=np.int64)[0])


def consistent(lines: np.ndarray, size: int) -> bool:
    """Non-empty lines ``[start, end)`` within ``size`` bytes, in order, each ending before the next
    starts (a newline between them)."""
    if len(lines) == 0:
        return True
    starts, ends = lines[:, 0], lines[:, 1]
    return bool(
        starts[0] >= 0
        and ends[-1] <= size
        and np.all(ends > starts)
        and np.all(starts[1:] > ends[:-1])
    )


def write(cached: Path, header: np.ndarray, lines: np.ndarray) -> None:
    """Keep ``lines`` as ``cached`` under ``header`` (its checksum filled in); where that cannot be
    done (a read-only folder) they stay in memory."""
    table = np.concatenate([header, lines])
    table[1, 1] = checksum(lines)
    try:
        fs.write_with(cached, table.tofile, root=cached.parent)
    except (OSError, ConfigError):
        pass
