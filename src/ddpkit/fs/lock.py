"""A folder that belongs to one job at a time: an advisory lock on ``FOLDER/.lock`` naming its holder.

The main rank holds :func:`fcntl.flock` on the file for the life of the job. The kernel drops it when the
process ends, however it ends, so a crashed or SIGKILLed job leaves nothing behind and a restarted one takes it
again at once. The file is opened as every ddpkit file is (:mod:`ddpkit.fs.safe`): never through a link, never
another user's file or folder; the holder's name is written into it only once the lock is ours.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.fs import safe


class FolderLock:
    """An exclusive advisory lock on ``folder/.lock``. For the message of a job that finds it taken: ``what``
    names the folder (``run_dir``), ``job`` and ``user`` the kind of job in it (``job``, ``run``) and
    ``hazard`` what two of them at once would do."""

    def __init__(self, folder: str | os.PathLike, *, what: str, job: str, user: str, hazard: str) -> None:
        self.path = Path(folder) / ".lock"
        self.what, self.job, self.user, self.hazard = what, job, user, hazard
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`ConfigError` naming the job that holds it."""
        safe.make_dirs(self.path.parent)
        fd = safe.open_fd(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ConfigError(
                f"{self.what} {str(self.path.parent)!r} is in use by another {self.job} ({holder}): "
                f"{self.hazard}. Wait for it to end, or give this {self.user} another {self.what}"
            ) from None
        # Holder written once the lock is ours (the file is ours too, checked above): a job that finds it
        # locked reads a whole record.
        os.ftruncate(fd, 0)
        os.pwrite(
            fd,
            json.dumps(
                {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
            ).encode(),
            0,
        )
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"host {info['host']}, pid {info['pid']}, since {info['since']}"
    except (ValueError, KeyError, OSError):
        return "holder unknown: it has not written its name yet"
