"""The one way ddpkit writes, replaces, truncates, renames and deletes files and folders: relative
to a verified folder descriptor, never through a link, only into this user's files and folders
(the rules and their reasons: docs/snapshots.md). Call these through the package
(``fs.write_atomic(...)``): a test can then stand in for one of them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import secrets
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Literal

from ddpkit._errors import ConfigError

_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_IN_PLACE = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC

Linked = Literal["refuse", "replace"]
"""What an open to write does with a file that has other hard links: ``"refuse"`` (a
:class:`ConfigError` naming it), or ``"replace"`` (the name first gets a copy of its own)."""


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _refuse_other_owner(
    st: os.stat_result, path: Path | str, what: str, kind: str = "folder"
) -> None:
    """Refuse ``path`` (a ``what`` in a ``kind`` the user names) when another user owns it."""
    uid, me = st.st_uid, os.geteuid()
    if uid == me:
        return
    owner, you = user_name(uid), user_name(me)
    raise ConfigError(
        f"{what + ' ' if what else ''}{str(path)!r} belongs to {owner} (uid {uid}), not to you "
        f"({you}, uid {me}): ddpkit writes only into folders of its own user. Give this job a "
        f"{kind} of your own, or have {owner} hand it over (chown -R {you} {str(path)!r})"
    )


def check_owned(path: Path, what: str, *, follow: bool, kind: str = "folder") -> None:
    """Refuse ``path`` if it belongs to another user (and, unless ``follow``, if it is a link);
    absent is fine. ``kind``: the option that names the folder, for the message (``run_dir``)."""
    if not follow:
        refuse_link(path)
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except FileNotFoundError:
        return
    _refuse_other_owner(st, path, what, kind)


def refuse_link(path: Path) -> None:
    """Refuse ``path`` if it is a symbolic link; absent is fine."""
    if os.path.islink(path):
        raise ConfigError(link_message(path))


def link_message(path: Path | str) -> str:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return (
        f"{str(path)!r} is a symbolic link (to {target!r}): ddpkit writes inside its own folders, "
        "never through a link. Remove the link, or give this job another folder"
    )


@contextmanager
def folder(path: Path, *, root: Path | None = None, create: bool = False) -> Iterator[int]:
    """A descriptor of the folder ``path``, this user's: ``root`` (``path`` by default) opened as
    given, each folder below it with ``O_NOFOLLOW`` (made first with ``create``)."""
    path = Path(path)
    base = Path(root) if root is not None else path
    try:
        parts = path.relative_to(base).parts if root is not None else ()
    except ValueError:
        parts = ("..",)
    if ".." in parts:
        raise ConfigError(
            f"{str(path)!r} is not inside {str(base)!r}: ddpkit writes only inside its folders"
        )
    if create:
        os.makedirs(base, exist_ok=True)  # the folder the user named, wherever their path leads
    try:
        fd = os.open(base, _FOLDER)
    except NotADirectoryError:
        raise ConfigError(
            f"{str(base)!r} is not a folder: move it away, or give this job another folder"
        ) from None
    try:
        st = os.fstat(fd)
        # root's and sticky (/tmp, /dev/shm): no one removes another's files there
        if not (st.st_uid == 0 and st.st_mode & stat.S_ISVTX):
            _refuse_other_owner(st, base, "folder")
        here = base
        for part in parts:
            here = here / part
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o777, dir_fd=fd)
            try:
                inner = os.open(part, _FOLDER | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as err:
                if err.errno in (errno.ELOOP, errno.ENOTDIR):
                    if os.path.islink(here):
                        raise ConfigError(link_message(here)) from None
                    # a file where a folder goes: the error mkdir and open give, naming it
                    code = errno.EEXIST if create else errno.ENOTDIR
                    raise OSError(code, os.strerror(code), str(here)) from None
                raise
            os.close(fd)
            fd = inner
            _refuse_other_owner(os.fstat(fd), here, "folder")
        yield fd
    finally:
        os.close(fd)


def _not_a_file(path: Path) -> ConfigError:
    return ConfigError(
        f"{str(path)!r} is not a regular file: move it away, or give this job another folder"
    )


def other_names(st: os.stat_result) -> bool:
    """Whether the file ``st`` has other hard links: a write into it would be a write into them."""
    return st.st_nlink > 1


def open_in(
    dir_fd: int, path: Path, flags: int, mode: int, linked: Linked | None = "refuse"
) -> int:
    """:func:`open_fd` in the folder ``dir_fd``; ``linked=None``: the caller sees to hard links."""
    # Non-blocking: a FIFO planted under the name would hold the open. O_TRUNC only after the
    # checks: the open would cut another user's file, or another name's, before them.
    try:
        fd = os.open(
            path.name, flags & ~os.O_TRUNC | _NO_FOLLOW | os.O_NONBLOCK, mode, dir_fd=dir_fd
        )
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ConfigError(link_message(path)) from None
        if err.errno == errno.ENXIO:  # a FIFO with no reader, opened to write
            raise _not_a_file(path) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_a_file(path)
        _refuse_other_owner(st, path, "file")
        if linked is not None and other_names(st) and flags & _IN_PLACE:
            # checked on the descriptor that is written, not on the name
            if linked != "replace":
                links = st.st_nlink - 1
                raise ConfigError(
                    f"{str(path)!r} has {links} other hard link{'s' if links > 1 else ''} (a "
                    "folder copied with cp -al?): ddpkit writes in place only into a file of one "
                    "name, never through a link. Remove it once no job uses it, or give this job "
                    "another folder"
                )
            _replace_by_copy(dir_fd, path, st, copy=not flags & os.O_TRUNC)
            os.close(fd)
            return open_in(dir_fd, path, flags, mode)  # a link made to the copy since is refused
        if flags & os.O_TRUNC:
            os.ftruncate(fd, 0)
        if not flags & os.O_NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _replace_by_copy(dir_fd: int, path: Path, st: os.stat_result, *, copy: bool) -> None:
    """Give ``path`` (the file ``st``) a file of its own with its bytes (none unless ``copy``)."""
    tmp, out = temporary(dir_fd, path.name, 0o600)
    try:
        os.fchmod(out, stat.S_IMODE(st.st_mode))
        if copy:
            src = os.open(path.name, os.O_RDONLY | _NO_FOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
            try:
                now = os.fstat(src)
                if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                    raise ConfigError(
                        f"{str(path)!r} was replaced while it was opened: run the job again"
                    )
                offset = 0
                while sent := os.sendfile(out, src, offset, 1 << 30):
                    offset += sent
            finally:
                os.close(src)
        os.fsync(out)
        os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    finally:
        os.close(out)
    os.fsync(dir_fd)


def open_fd(
    path: Path,
    flags: int,
    mode: int = 0o644,
    *,
    root: Path | None = None,
    linked: Linked = "refuse",
) -> int:
    """``os.open`` of a regular file of this user at ``path``, never through a link; opened to
    write, one with other hard links is refused or replaced by a copy first (:data:`Linked`)."""
    path = Path(path)
    with folder(path.parent, root=root) as dir_fd:
        return open_in(dir_fd, path, flags, mode, linked)


def open_fifo(path: Path, flags: int, *, create: bool = False) -> int | None:
    """``os.open`` of the FIFO of this user at ``path`` (made first, mode 0600, with ``create``),
    never through a link; None where what is there is not such a FIFO."""
    path = Path(path)
    with folder(path.parent) as dir_fd:
        if create:
            os.mkfifo(path.name, 0o600, dir_fd=dir_fd)
        fd = os.open(path.name, flags | _NO_FOLLOW, dir_fd=dir_fd)
    st = os.fstat(fd)
    if stat.S_ISFIFO(st.st_mode) and st.st_uid == os.getuid():
        return fd
    os.close(fd)
    return None


def open_append(
    path: Path, *, read: bool = False, root: Path | None = None, linked: Linked = "refuse"
) -> IO[str]:
    """A text file opened to append to (made if missing; ``read``: readable from the start)."""
    flags = (os.O_RDWR if read else os.O_WRONLY) | os.O_APPEND | os.O_CREAT
    fd = open_fd(path, flags, root=root, linked=linked)
    return os.fdopen(fd, "a+" if read else "a", buffering=1, newline="" if read else None)


def unshare(path: Path, *, root: Path | None = None) -> None:
    """Where the file at ``path`` has other hard links, give the name a copy of its own (absent is
    fine), before a library opens it in place by its name."""
    with contextlib.suppress(FileNotFoundError):
        os.close(open_fd(path, os.O_WRONLY, linked="replace", root=root))


def open_exclusive(path: Path, *, root: Path | None = None, mode: int = 0o644) -> IO[bytes]:
    """A new file at ``path``, opened to write; refused if anything is there already."""
    return os.fdopen(open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode, root=root), "wb")


def read_bytes(path: Path, *, root: Path | None = None) -> bytes:
    with os.fdopen(open_fd(path, os.O_RDONLY, root=root), "rb") as f:
        return f.read()


def truncate(path: Path, size: int, *, root: Path | None = None, linked: Linked = "refuse") -> None:
    fd = open_fd(path, os.O_WRONLY, root=root, linked=linked)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary(dir_fd: int, name: str, mode: int, flags: int = os.O_WRONLY) -> tuple[str, int]:
    """(name, descriptor) of a new file beside ``name`` in ``dir_fd``: an unpredictable name,
    created with ``O_EXCL`` (never an existing file, nor a planted link)."""
    while True:
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        try:
            return tmp, os.open(
                tmp, flags | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, mode, dir_fd=dir_fd
            )
        except FileExistsError:
            continue


def write_with(
    path: Path, write: Callable[[IO[bytes]], object], *, root: Path | None = None, mode: int = 0o644
) -> None:
    """Replace ``path`` by what ``write(file)`` writes (``savefig``, ``torch.save``), whole or not
    at all: a new file in the same folder, fsynced, renamed."""
    path = Path(path)
    with folder(path.parent, root=root, create=True) as dir_fd:
        tmp, fd = temporary(dir_fd, path.name, mode)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        os.fsync(dir_fd)  # the rename is durable only once the folder's entry is on disk


def write_atomic(path: Path, data: bytes, *, root: Path | None = None, mode: int = 0o644) -> None:
    """Replace ``path`` by ``data``, whole or not at all (see :func:`write_with`)."""
    write_with(path, lambda f: f.write(data), root=root, mode=mode)


def make_dirs(path: Path, *, root: Path | None = None) -> None:
    """Make ``path`` and the folders above it up to ``root``, none of them through a link."""
    with folder(Path(path), root=root, create=True):
        return


def make_dir(path: Path, *, root: Path | None = None, mode: int = 0o777) -> None:
    """Make the new folder ``path`` (refused if anything is there already)."""
    path = Path(path)
    with folder(path.parent, root=root) as dir_fd:
        os.mkdir(path.name, mode, dir_fd=dir_fd)


def remove(path: Path, *, root: Path | None = None, missing_ok: bool = True) -> None:
    """Delete the file (or the link itself) at ``path``; another user's is refused."""
    path = Path(path)
    try:
        with folder(path.parent, root=root) as dir_fd:
            _refuse_other_owner(
                os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False), path, "file"
            )
            os.unlink(path.name, dir_fd=dir_fd)
    except FileNotFoundError:
        if not missing_ok:
            raise


def remove_empty_dir(path: Path, *, root: Path | None = None) -> None:
    """Delete the folder ``path`` if it is empty (an ``OSError`` if not)."""
    path = Path(path)
    with folder(path.parent, root=root) as dir_fd:
        os.rmdir(path.name, dir_fd=dir_fd)


def remove_tree(path: Path, *, root: Path | None = None) -> None:
    """Delete the folder ``path`` and what it holds, never following a link (a link at ``path`` is
    removed itself, a file there is left); another user's folder is refused."""
    path = Path(path)
    try:
        with folder(path.parent, root=root) as dir_fd:
            remove_tree_in(dir_fd, path)
    except FileNotFoundError:
        return


def remove_tree_in(dir_fd: int, path: Path) -> None:
    """:func:`remove_tree` of ``path.name`` in the folder ``dir_fd``."""
    st = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
    _refuse_other_owner(st, path, "folder")
    if stat.S_ISDIR(st.st_mode):
        _empty(dir_fd, path.name)
    elif stat.S_ISLNK(st.st_mode):
        os.unlink(path.name, dir_fd=dir_fd)


def _empty(dir_fd: int, name: str) -> None:
    """Delete the folder ``name`` of ``dir_fd`` and what it holds, by descriptors; best effort once
    it is opened."""
    inner = os.open(name, _FOLDER | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        for entry in os.scandir(inner):
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):
                    _empty(inner, entry.name)
                else:
                    os.unlink(entry.name, dir_fd=inner)
    finally:
        os.close(inner)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=dir_fd)


def rename(src: Path, dst: Path, *, root: Path | None = None) -> None:
    """Move ``src`` (a file, a folder or a link itself) to ``dst``, replacing a file there."""
    src, dst = Path(src), Path(dst)
    with folder(src.parent, root=root) as src_fd, folder(dst.parent, root=root) as dst_fd:
        os.replace(src.name, dst.name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
