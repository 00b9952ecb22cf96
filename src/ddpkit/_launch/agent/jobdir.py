"""The job's folder on this node (its channels: :mod:`ddpkit.distributed._channels`), made by the
agent once per job and removed when the job ends however it ends. It lives in shared memory
(``/dev/shm``, or ``$DDPKIT_MEMORY_ROOT``), so that the snapshots in memory outlive a worker and
its records cost no disk; where shared memory cannot hold it, in the run's log folder, without
snapshots in memory. Layout::

    <root>/ddpkit-memory-<uid>/<nonce>/   this job's folder

(a folder of another job whose agent is gone is swept as a new one is made).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import time
from pathlib import Path

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._launch.proctree import start_time
from ddpkit.distributed._channels import (
    INBOX,
    JOB_DIR_ENV,
    MEMORY,
    MEMORY_OFF,
    PROGRESS,
    STACKS,
)

ROOT_ENV = "DDPKIT_MEMORY_ROOT"
"""Where the agent makes the job's folder (default ``/dev/shm``)."""
OFF_ENV = "DDPKIT_MEMORY_SNAPSHOTS"
"""``0`` in the launcher's environment: the job keeps no snapshots in memory."""
SETUP_SECONDS = 60.0  # the longest an agent takes from making its folder to renaming it
ROOM = 1 << 20  # bytes of shared memory below which the folder goes to disk (a page a rank)


class FolderUnavailable(RuntimeError):
    """The memory file system cannot hold the job's folder."""


def _owner_alive(folder: Path) -> bool:
    try:
        pid, started = (folder / "owner").read_text().split()
        return start_time(int(pid)) == int(started)
    except (OSError, ValueError):
        return False


def private_base(root: Path) -> Path:
    """``root/ddpkit-memory-<uid>``, made with mode 700; refused if it is a link, or someone else's
    (who could plant slots for this user's jobs to load)."""
    base = root / f"ddpkit-memory-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        fs.make_dir(base, mode=0o700)
    info = os.lstat(base)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise FolderUnavailable(
            f"{base} is not a private folder of this user (a link, or open to others)"
        )
    return base


_job_folder: Path | None = None


def open_job_folder(fallback: Path) -> Path:
    """Make this job's folder and name it to the workers (:data:`JOB_DIR_ENV`): in shared memory
    where it has room (stale folders swept first), else ``fallback`` (then with
    :data:`~ddpkit.distributed._channels.MEMORY_OFF` saying why there are no snapshots in memory,
    as also where ``$DDPKIT_MEMORY_SNAPSHOTS=0``)."""
    global _job_folder
    why = None
    try:
        folder = _in_shared_memory()
    except (OSError, FolderUnavailable, ConfigError) as err:
        folder, why = None, str(err)
    if folder is None:
        folder = fallback
        fs.make_dirs(folder)
        fs.write_atomic(folder / "owner", f"{os.getpid()} {start_time(os.getpid())}\n".encode())
    _job_folder = folder
    for name in (PROGRESS, INBOX, STACKS):
        fs.make_dirs(folder / name, root=folder)
    if why is None and os.environ.get(OFF_ENV) == "0":
        why = f"{OFF_ENV}=0"
    if why is None:
        fs.make_dirs(folder / MEMORY, root=folder)
    else:
        fs.write_atomic(folder / MEMORY_OFF, why.encode(), root=folder)
    os.environ[JOB_DIR_ENV] = str(folder)
    return folder


def _in_shared_memory() -> Path:
    """A new folder for this job in shared memory, with the agent's pid and start time in it."""
    root, pid = Path(os.environ.get(ROOT_ENV, "/dev/shm")), os.getpid()
    if not root.is_dir():
        raise FolderUnavailable(f"{root} does not exist")
    room = os.statvfs(root)
    if room.f_bavail * room.f_frsize < ROOM:
        raise FolderUnavailable(f"{root} has less than {ROOM >> 20} MiB free")
    base = private_base(root)
    for stale in base.iterdir():  # the folders of agents that are gone
        # another agent may rename or sweep one meanwhile: it is then not this agent's to sweep
        with contextlib.suppress(FileNotFoundError):
            if not stale.is_dir() or stale.is_symlink() or _owner_alive(stale):
                continue
            # another agent's folder being set up (".<nonce>") has no owner yet: one whose setup
            # died is left behind, swept once it is older than any setup takes
            age = time.time() - stale.stat().st_mtime
            if stale.name.startswith(".") and age < SETUP_SECONDS:
                continue
            fs.remove_tree(stale, root=base)
    # renamed into place once its owner is written in it: a sweep never sees one without
    nonce = secrets.token_hex(8)
    tmp = base / f".{nonce}"
    fs.make_dir(tmp, root=base, mode=0o700)
    fs.write_atomic(tmp / "owner", f"{pid} {start_time(pid)}\n".encode(), root=base)
    fs.rename(tmp, base / nonce, root=base)
    return base / nonce


def close_job_folder() -> None:
    """Remove this job's folder (the agent, when the job ends however it ends)."""
    global _job_folder
    os.environ.pop(JOB_DIR_ENV, None)
    if _job_folder is not None:
        fs.remove_tree(_job_folder)
        _job_folder = None
