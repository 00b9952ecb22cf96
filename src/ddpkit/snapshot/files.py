"""Files in a run directory, written so that no symbolic link redirects a write and no other user's files are used.

A run directory is often reused, copied or shared (a project folder); a link left in it (``metrics.jsonl ->
~/.bashrc``, ``snapshots -> ../other-run/snapshots``) must not make a job append to, replace or delete anything
outside it. So:

- a file appended to (``metrics.jsonl``, ``epochs.csv``, ``.lock``) is opened with ``O_NOFOLLOW``: the kernel
  refuses a link instead of following it, with no window between a check and the open;
- a file replaced whole (``config.json``, ``best.pt``, ``loggers.json``, ``curves.png``) is written to a new
  temporary file in the same folder (``O_EXCL``: never an existing file or link) and renamed over its name; a
  rename replaces a link there, it never writes through it;
- a run directory, its ``snapshots/`` folder, or a file in it that belongs to another user is refused with
  the owner's name: another user's folder is theirs to clean up, and their files could be links or be
  replaced under this job.

The run directory itself may be a link (to scratch storage, say): what is guarded is what lies inside it.
"""

from __future__ import annotations

import errno
import os
import pwd
import secrets
import stat
from pathlib import Path
from typing import IO

from ddpkit.errors import ConfigError

_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _refuse_other_owner(st: os.stat_result, path: Path, what: str) -> None:
    me = os.geteuid()
    if st.st_uid != me:
        owner, you = _user(st.st_uid), _user(me)
        raise ConfigError(
            f"{what + ' ' if what else ''}{str(path)!r} belongs to {owner} (uid {st.st_uid}), not to you ({you}, "
            f"uid {me}): a job writes only into a run directory of its own user. Give this run a run_dir of your "
            f"own, or have {owner} hand it over (chown -R {you} {str(path)!r})"
        )


def check_owned(path: Path, what: str, *, follow: bool) -> None:
    """Refuse ``path`` if it belongs to another user (and, unless ``follow``, if it is a link); absent is fine."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return
    if not follow:
        refuse_link(path, st)
    _refuse_other_owner(st, path, what)


def refuse_link(path: Path, st: os.stat_result | None = None) -> None:
    """Refuse ``path`` if it is a symbolic link; absent is fine."""
    if st is None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(_link_message(path))


def _link_message(path: Path) -> str:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return (
        f"{str(path)!r} is a symbolic link (to {target!r}): ddpkit writes its records and snapshots inside the "
        "run directory, never through a link. Remove the link, or give this run another run_dir"
    )


def open_fd(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` that refuses a link at ``path`` and anything but a regular file of this user."""
    try:
        fd = os.open(path, flags | _NO_FOLLOW, mode)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(_link_message(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{str(path)!r} is not a regular file: move it away, or give this run another run_dir")
        _refuse_other_owner(st, path, "file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: Path, *, read: bool = False) -> IO[str]:
    """A text file opened to append to (created if missing; ``read``: also readable from the start)."""
    fd = open_fd(path, (os.O_RDWR if read else os.O_WRONLY) | os.O_APPEND | os.O_CREAT)
    return os.fdopen(fd, "a+" if read else "a", buffering=1, newline="" if read else None)


def read_bytes(path: Path) -> bytes:
    fd = open_fd(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        return f.read()


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data``, whole or not at all: a new file in the same folder, fsynced, then renamed."""
    # A name of its own, created with O_EXCL: never an existing file, nor a link planted under a name we would
    # have used. (Not tempfile.mkstemp: its files are 0600 whatever the umask, and results are often shared.)
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o644)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # replaces a link named ``path``; never writes to where it points
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(folder)  # the rename is durable only once the folder's entry is on disk
    finally:
        os.close(folder)
