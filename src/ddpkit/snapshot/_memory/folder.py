"""The job's folder in node-local shared memory, where workers keep snapshots that outlive them.

The agent of ``ddpkit run`` outlives every attempt of its workers: it makes one folder per job and
node at start (:func:`open_job_folder`), names it to the workers in :data:`DIR_ENV` with a random
key in :data:`KEY_ENV`, and removes it when the job ends, however it ends
(:func:`close_job_folder`). A restarted worker finds its state there
(:mod:`ddpkit.snapshot._memory.store`). Layout::

    <root>/ddpkit-memory-<uid>/   mode 700, refused if a link or open to others
        <nonce>/                  one per job and node, mode 700; the job's random key
            owner                 the agent's pid and start time (a dead agent's: stale)

A launcher killed with SIGKILL runs no clean-up: the next job on the node sweeps the folders whose
agent is dead (:func:`sweep_stale`); those of live agents (other jobs) stay. Standard library only:
the launcher imports it before torch's agent starts any worker.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit.platforms import _torchrun as torchrun

ROOT_ENV = "DDPKIT_MEMORY_ROOT"
"""Where the agent makes the job's folder (default ``/dev/shm``); tests point it at a small
tmpfs."""
DIR_ENV = "DDPKIT_MEMORY_DIR"
"""The job's folder on this node, set by the agent for its workers."""
KEY_ENV = "DDPKIT_MEMORY_KEY"
"""The job's random key (the folder's name), set by the agent with :data:`DIR_ENV`."""
UNAVAILABLE_ENV = "DDPKIT_MEMORY_UNAVAILABLE"
"""Why the agent made no folder (the memory file system is missing or not private), for the workers
to say."""
OFF_ENV = "DDPKIT_MEMORY_SNAPSHOTS"
"""``0`` in the launcher's environment: the agent makes no folder (snapshots in memory are then
off)."""


class FolderUnavailable(RuntimeError):
    """The memory file system cannot hold the job's folder."""


def start_time(pid: int) -> str | None:
    """The start time of process ``pid`` in clock ticks since boot (with the pid, a process's
    identity: pids are reused), or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[19]  # field 22; the command name in (...) may hold spaces


def _owner_alive(folder: Path) -> bool:
    try:
        pid, started = (folder / "owner").read_text().split()
        return start_time(int(pid)) == started
    except (OSError, ValueError):
        return False


def private_base(root: Path) -> Path:
    """``root/ddpkit-memory-<uid>``, made with mode 700; refused if it is a link, or someone else's:
    another user could otherwise plant slots for this user's jobs to load."""
    base = root / f"ddpkit-memory-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        fs.make_dir(base, mode=0o700)
    info = os.lstat(base)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise FolderUnavailable(
            f"{base} is not a private folder of this user (a link, or open to others)"
        )
    return base


def sweep_stale(base: Path) -> list[Path]:
    """Remove the folders under ``base`` whose agent is dead; return them."""
    removed = []
    for folder in base.iterdir() if base.is_dir() else []:
        if folder.is_dir() and not folder.is_symlink() and not _owner_alive(folder):
            fs.remove_tree(folder, root=base)
            removed.append(folder)
    return removed


def open_job_folder(pid: int | None = None) -> Path | None:
    """Make this job's folder (the agent, once per job), sweep stale ones first, and export it to
    the workers; None, with the reason in :data:`UNAVAILABLE_ENV`, when the memory file system is
    missing or not usable."""
    root = Path(os.environ.get(ROOT_ENV, "/dev/shm"))
    pid = os.getpid() if pid is None else pid
    try:
        if not root.is_dir():
            raise FolderUnavailable(f"{root} does not exist")
        base = private_base(root)
        sweep_stale(base)
        nonce = secrets.token_hex(8)
        # Made under a temporary name and renamed once its owner is written: another job's sweep
        # never sees a folder without an owner, which it would take for stale.
        tmp = base / f".{nonce}"
        fs.make_dir(tmp, root=base, mode=0o700)
        fs.write_atomic(tmp / "owner", f"{pid} {start_time(pid)}\n".encode(), root=base)
        folder = base / nonce
        fs.rename(tmp, folder, root=base)
    except (OSError, FolderUnavailable, ConfigError) as err:
        os.environ[UNAVAILABLE_ENV] = str(err)
        return None
    os.environ[DIR_ENV] = str(folder)
    os.environ[KEY_ENV] = nonce
    return folder


def close_job_folder() -> None:
    """Remove this job's folder (the agent, when the job ends however it ends)."""
    folder = os.environ.pop(DIR_ENV, None)
    os.environ.pop(KEY_ENV, None)
    os.environ.pop(UNAVAILABLE_ENV, None)
    if folder:
        fs.remove_tree(Path(folder))


def job_key() -> str | None:
    """This job's key as the agent set it: its nonce, with torchrun's run id; None outside
    ``ddpkit run``."""
    nonce = os.environ.get(KEY_ENV)
    return f"{torchrun.run_id(os.environ)}:{nonce}" if nonce else None


MOUNT_MORE = (
    "give the node more shared memory: in Kubernetes an emptyDir volume with medium: Memory "
    "mounted at /dev/shm (`ddpkit k8s` writes one), in Docker --shm-size"
)
"""What to change when the memory file system is too small."""


def room_warning(folder: str | os.PathLike[str], need: int) -> str | None:
    """A warning when the file system of ``folder`` has less free room than ``need`` bytes, else
    None.

    Containers get a 64 MiB ``/dev/shm`` unless a volume says otherwise, less than two slots of most
    models: told once at the start of a run rather than found at the first save."""
    try:
        info = os.statvfs(folder)
    except OSError:
        return None
    free = info.f_bavail * info.f_frsize
    if free >= need:
        return None
    return (
        f"the shared memory holding {folder} has {free / 2**20:.0f} MiB free, less than the "
        f"{need / 2**20:.0f} MiB that the snapshots in memory of this node's ranks need at least "
        "(two copies of each rank's model, more with its optimizer's state): they will stop at "
        f"the first save; {MOUNT_MORE}"
    )
