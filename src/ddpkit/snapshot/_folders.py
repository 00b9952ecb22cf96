"""A snapshot folder's files: its name, the marker that makes it whole, the marker's check, the
prune, and the value files (``values.pt``, ``rank{r}.pt``). A folder is trusted by what it holds,
never by its name; the marker is read as data that may lie: a plain file name of the folder for
each entry, each file regular, never read past the size the marker gives (docs/snapshots.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit.snapshot import _codec as codec

MARKER = "complete.json"
_FOLDER = re.compile(r"^step-(\d+)$")
_MARKER_LIMIT = 1 << 20  # a marker lists a few files per rank: a MiB is far more than one holds
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class NotRegular(OSError):
    """A file of a snapshot folder that is a link, a device, a FIFO or a folder."""


@dataclass(frozen=True)
class Found:
    """A whole snapshot: a ``step-N/`` folder."""

    step: int
    path: Path


PARTIAL = "has no marker"
"""What :func:`scan` says of a folder written up to before its marker: the debris of a killed
write, not yet a snapshot (nor a stray), removed by the next prune."""


def folder_name(step: int) -> str:
    return f"step-{step:08d}"


def open_regular(path: Path, dir_fd: int | None = None) -> int:
    """A descriptor of the regular file ``path`` (the name ``path.name`` in the folder ``dir_fd``,
    when given): not through a link (ELOOP), never waiting on a FIFO."""
    fd = os.open(
        path if dir_fd is None else path.name,
        os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
        dir_fd=dir_fd,
    )
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegular(f"{path} is not a regular file")
    return fd


def read_bounded(path: Path, limit: int, dir_fd: int | None = None) -> bytes:
    """The bytes of the regular file ``path`` (in ``dir_fd``: :func:`open_regular`), if it holds at
    most ``limit``; ``OSError`` otherwise."""
    fd = open_regular(path, dir_fd)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise OSError(f"{path} holds {size} bytes, more than the {limit} it may")
        return os.pread(fd, size, 0)
    finally:
        os.close(fd)


def sha256(path: Path, size: int | None = None) -> str:
    """The SHA-256 of the regular file ``path``: of its first ``size`` bytes, when given."""
    h = hashlib.sha256()
    fd = open_regular(path)
    with os.fdopen(fd, "rb") as f:
        left = size if size is not None else os.fstat(fd).st_size
        while left > 0 and (chunk := f.read(min(left, 1 << 22))):
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def plain_name(name: object) -> bool:
    """True for the name of a file directly inside a folder: no ``/`` or NUL, not ``.``, ``..``."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\0" not in name
        and len(name.encode("utf-8", "surrogatepass")) <= 255
    )


def scan(folder: Path) -> list[tuple[Found, str | None]]:
    """Every entry of ``folder`` named ``step-N``, newest first (by N), with what keeps it from
    being the snapshot of step N: None for a snapshot (not yet verified), :data:`PARTIAL` for a
    folder without a marker, else why it is a stray (never loaded, never counted as a snapshot)."""
    try:
        top = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return []
    try:
        entries = []
        for name in os.listdir(top):
            match = _FOLDER.match(name)
            if match:
                step = int(match.group(1))
                path = folder / name
                entries.append((Found(step, path), _not_a_snapshot(top, path, step)))
    finally:
        os.close(top)
    return sorted(entries, key=lambda e: (e[0].step, e[0].path.name), reverse=True)


def _not_a_snapshot(top: int, path: Path, step: int) -> str | None:
    """Why ``path``, an entry of the folder ``top``, is not the snapshot of ``step``."""
    name = path.name
    try:
        mode = os.stat(name, dir_fd=top, follow_symlinks=False).st_mode
        if stat.S_ISLNK(mode):
            return (
                f"is a link (to {os.readlink(name, dir_fd=top)!r}): a snapshot is read from a "
                "folder of its own, never through a link"
            )
        if not stat.S_ISDIR(mode):
            return "is not a folder"
        if name != folder_name(step):
            return f"is not named as the snapshot of step {step} is ({folder_name(step)})"
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
    except OSError as err:  # replaced since it was listed, or not ours to read
        return f"is unreadable ({err.strerror or err})"
    try:
        try:
            os.stat(MARKER, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return PARTIAL
        except OSError:
            pass  # named by the read below
        marker = _read_marker(path / MARKER, fd)
    except ValueError as err:
        return str(err)
    finally:
        os.close(fd)
    return _step_problem(marker, step)


def _read_marker(path: Path, dir_fd: int | None = None) -> Any:
    """The marker at ``path`` (in ``dir_fd``: :func:`open_regular`), parsed; ``ValueError``
    (naming it) if it cannot be read."""
    try:
        return json.loads(read_bounded(path, _MARKER_LIMIT, dir_fd))
    except (OSError, ValueError, RecursionError) as err:
        raise ValueError(f"has an unreadable {MARKER} ({err})") from None


def _step_problem(marker: Any, step: int) -> str | None:
    """None if ``marker`` records ``step``, the step of its folder's name; else what it records."""
    recorded = marker.get("step") if isinstance(marker, dict) else None
    if type(recorded) is int and recorded == step:
        return None
    what = f"step {recorded}" if type(recorded) is int else "no step"
    return (
        f"has a {MARKER} that records {what}, not {step}: a copy or a rename of another step's "
        "folder is never loaded"
    )


def listed(found: Found) -> dict[str, dict[str, Any]]:
    """The files ``found``'s marker lists, each a plain name with a size and a SHA-256;
    ``ValueError`` (naming the marker and the entry) if it is not such a list."""
    return _files(_read_marker(found.path / MARKER))


def _files(marker: Any) -> dict[str, dict[str, Any]]:
    """The files ``marker`` lists (:func:`listed`)."""
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or not files:
        raise ValueError(f"has a {MARKER} that lists no files")
    for name, want in files.items():
        if not plain_name(name):
            raise ValueError(
                f"has a {MARKER} naming {name[:80]!r}, which is not a file of the folder: refused"
            )
        if (
            not isinstance(want, dict)
            or type(want.get("size")) is not int
            or want["size"] < 0
            or not isinstance(want.get("sha256"), str)
            or not _SHA256.match(want["sha256"])
        ):
            raise ValueError(f"has a {MARKER} whose entry for {name} is not a size and a SHA-256")
    return files


def verify(found: Found, required: tuple[str, ...] = ()) -> str | None:
    """None if ``found`` (a snapshot :func:`scan` found) is whole: its marker lists ``required``
    among its files, each of the size and SHA-256 it gives; else what is wrong with it."""
    try:
        files = listed(found)
    except ValueError as err:
        return str(err)
    for name in required:
        if name not in files:
            return f"has a {MARKER} that does not list {name}"
    for name, want in files.items():
        file = found.path / name
        try:
            mode = os.lstat(file).st_mode
        except FileNotFoundError:
            return f"is missing {name}"
        except OSError as err:
            return f"has {name} unreadable ({err.strerror})"
        if not stat.S_ISREG(mode):
            return (
                f"has {name} that is not a regular file (a link, device, FIFO or folder): refused"
            )
        try:
            size = os.stat(file, follow_symlinks=False).st_size
            if size != want["size"]:
                return f"has {name} truncated or altered ({size} bytes, marker says {want['size']})"
            digest_ = sha256(file, want["size"])
        except OSError as err:  # replaced by a link or another kind of file since the lstat
            return f"has {name} unreadable ({err.strerror or err})"
        if digest_ != want["sha256"]:
            return f"has {name} not matching its checksum (corrupt)"
    return None


def prune(folder_path: Path, keep_last: int, newest: int) -> None:
    """Remove snapshots older than the newest ``keep_last``, and the debris of killed writes (any
    step). A stray (:func:`scan`) never counts among those kept: older than ``newest``, it goes (a
    link loses only itself); newer, it is left, and named at every resume."""
    entries = scan(folder_path)
    keep = [found.path.name for found, problem in entries if problem is None][:keep_last]
    # By a descriptor opened without following links: a snapshots/ that is itself a link is
    # refused (ELOOP); a link named like a snapshot loses only itself (fs.remove_tree_in).
    folder = os.open(folder_path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for found, problem in entries:
            name = found.path.name
            if name in keep or (found.step >= newest and problem != PARTIAL):
                continue
            # Marker first: a prune killed half-way leaves a folder without one (ignored), never a
            # marker whose files are gone.
            with contextlib.suppress(OSError):  # a link (ELOOP) or a file has no marker of its own
                step = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=folder)
                try:
                    os.unlink(MARKER, dir_fd=step)
                finally:
                    os.close(step)
            fs.remove_tree_in(folder, found.path)
    finally:
        os.close(folder)


VALUES = "values.pt"
"""The file of a state's values other than DCP's tensors (every rank's, and rank 0's ``extra``)."""
OWN = "rank{}.pt"
"""The file of one rank's own values (``DiskStore.save``'s ``own``), by rank."""
INDEX = "metadata.json"
"""DCP's index of a snapshot, as JSON (:mod:`ddpkit.snapshot._dcp` writes and reads it)."""


def _load_plain(file: Path, folder: Path, map_location: Any) -> Any:
    """The value file ``file`` of snapshot ``folder`` (:func:`ddpkit.snapshot._codec.read_file`);
    refused by name when it holds anything but what the codec writes, or is of another format."""
    try:
        return codec.read_file(file, map_location)
    except pickle.UnpicklingError:
        raise ConfigError(
            f"{file} holds objects other than tensors and plain values, which ddpkit never writes: "
            f"refusing to load it, as unpickling them could run code. Remove {folder} to resume "
            "from the snapshot before it"
        ) from None
    except codec.FormatError as err:
        raise ConfigError(
            f"{folder} was written by another version of ddpkit (its {file.name} is of {err}, this "
            f"version reads format {codec.FORMAT}): resume it with that version, or start afresh "
            "here with TrainerConfig(resume=False) (its snapshots are moved aside) or in another "
            "run_dir"
        ) from None
    except codec.MALFORMED as err:
        raise ConfigError(
            f"{file} holds values that ddpkit never writes ({type(err).__name__}: "
            f"{str(err)[:200]}): refusing it. Remove {folder} to resume from the snapshot before it"
        ) from None


def read_values(folder: Path, map_location: Any) -> dict[str, Any]:
    """The snapshot's :data:`VALUES`; refused by name when it holds anything but what the codec
    writes, is of another format, or is not what a save writes there."""
    saved = _load_plain(folder / VALUES, folder, map_location)
    keys = {"world_size", "values", "differences", "extra"}
    if not isinstance(saved, dict) or set(saved) != keys or type(saved["world_size"]) is not int:
        raise ConfigError(
            f"{folder / VALUES} is not what ddpkit writes there: refusing it. Remove {folder}"
        )
    return saved


def read_own(found: Found, ranks: list[int], map_location: Any) -> list[Any]:
    """The :data:`OWN` files of ``ranks`` in ``found``, each decoded by the codec; refused by name
    where the marker (whose files were checked) does not list one."""
    try:
        files = listed(found)
    except ValueError as err:
        raise ConfigError(f"{found.path} {err}") from None
    out = []
    for rank in ranks:
        name = OWN.format(rank)
        if name not in files:
            raise ConfigError(
                f"{found.path} holds no values of rank {rank} ({name}): its {MARKER} does not list "
                "them"
            )
        out.append(_load_plain(found.path / name, found.path, map_location))
    return out
