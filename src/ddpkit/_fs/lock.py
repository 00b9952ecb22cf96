"""A folder that belongs to one job at a time: an advisory :func:`fcntl.flock` on ``FOLDER/.lock``,
held by the main rank for the life of the job, with the holder's name written in once it is ours.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import weakref
from pathlib import Path
from typing import Any

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError


def take(path: Path, *, wait: bool) -> tuple[int, bool]:
    """A descriptor of the lock file ``path`` (made if missing), and whether this process now holds
    its exclusive :func:`fcntl.flock` (waited for with ``wait``); if not, the caller closes it."""
    path = Path(path)
    with fs.folder(path.parent) as dir_fd:
        while True:
            fd = fs.open_in(dir_fd, path, os.O_RDWR | os.O_CREAT, 0o644, linked=None)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
                except BlockingIOError:
                    return fd, False
                held = os.fstat(fd)
                try:
                    named = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    named = None
                if named is None or (named.st_dev, named.st_ino) != (held.st_dev, held.st_ino):
                    os.close(fd)  # replaced since we opened it: the name's file is the lock now
                    continue
                if fs.other_names(held):
                    # Renamed in locked, the old file let go only then: replaced without holding
                    # the old one, two jobs could each hold "the" lock.
                    tmp, new = fs.temporary(dir_fd, path.name, 0o644, os.O_RDWR)
                    fcntl.flock(new, fcntl.LOCK_EX)
                    os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                    os.close(fd)
                    fd = new
                return fd, True
            except BaseException:
                os.close(fd)
                raise


_HELD: weakref.WeakSet[FolderLock] = weakref.WeakSet()  # the locks this process holds


def release_all() -> None:
    """Release every folder lock this process holds: a failed run of a script that runs again in
    this process (``ddpkit run --recover in-place``) claims its folders anew."""
    for lock in list(_HELD):
        lock.release()


class FolderLock:
    """An exclusive advisory lock on ``folder/.lock``. For the message of a job that finds it taken:
    ``what`` names the folder (``run_dir``), ``job`` and ``user`` the kind of job in it (``job``,
    ``run``) and ``hazard`` what two of them at once would do."""

    def __init__(
        self, folder: str | os.PathLike, *, what: str, job: str, user: str, hazard: str
    ) -> None:
        self.path = Path(folder) / ".lock"
        self.what, self.job, self.user, self.hazard = what, job, user, hazard
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`ConfigError` naming the job that holds it."""
        fs.make_dirs(self.path.parent)
        fd, held = take(self.path, wait=False)
        if not held:
            try:
                info = json.loads(os.pread(fd, 4096, 0) or b"{}")
                holder = f"host {info['host']}, pid {info['pid']}, since {info['since']}"
            except (ValueError, KeyError, OSError):
                holder = "holder unknown: it has not written its name yet"
            if fs.other_names(os.fstat(fd)):
                holder += (
                    f"; or a job of another folder whose {self.path.name} is this same file, as "
                    "after cp -al"
                )
            os.close(fd)
            raise ConfigError(
                f"{self.what} {str(self.path.parent)!r} is in use by another {self.job} ({holder}"
                f"): {self.hazard}. Wait for it to end, or give this {self.user} another "
                f"{self.what}"
            )
        # written once the lock is ours: a job that finds it locked reads a whole record
        os.ftruncate(fd, 0)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        record = {"host": socket.gethostname(), "pid": os.getpid(), "since": since}
        os.pwrite(fd, json.dumps(record).encode(), 0)
        self._fd = fd
        _HELD.add(self)

    def release(self) -> None:
        if self._fd is not None:
            # Unlocked, not only closed: a process forked meanwhile (a loader worker) holds a copy
            # of the descriptor, and with it the lock, until it exits.
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
            _HELD.discard(self)

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
