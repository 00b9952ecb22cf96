"""A run directory belongs to one job at a time: the group's rank 0 holds an advisory lock
(:func:`fcntl.flock`) on ``run_dir/.lock`` for the life of ``fit()``, which the kernel drops however
the process ends. A run directory of another user, or with a symbolic link where the run writes, is
refused (:mod:`ddpkit._fs`); ``resume=False`` moves the previous run's files aside.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._fs.lock import FolderLock
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import broadcast_object


class RunDirLock(FolderLock):
    """An exclusive advisory lock on ``run_dir/.lock``, naming its holder (host, pid) inside the
    file."""

    def __init__(self, run_dir: str | os.PathLike) -> None:
        super().__init__(
            run_dir,
            what="run_dir",
            job="job",
            user="run",
            hazard="two jobs on one run directory would interleave their records and resume from "
            "each other's snapshots",
        )


PREVIOUS_RUN = (
    "snapshots", "best.pt", "best.safetensors", "best_weights.pt", "final.safetensors",
    "final_weights.pt", "metrics.jsonl", "metrics.rewound.jsonl", "epochs.csv", "tensorboard",
    "loggers.json", "config.json", "curves.png",
)  # fmt: skip
"""What ``resume=False`` moves aside: the previous run's state and records, which the new run's
would otherwise join at the same steps. ``mlflow.db`` and ``wandb/`` hold many runs: they stay."""
RUN_FILES = (*PREVIOUS_RUN, "mlflow.db", "wandb")
"""What a run writes in its run directory (besides ``.lock``): none of it may be a symbolic link."""


def claim(
    run_dir: str | os.PathLike, *, is_main: bool, fresh: bool, group: Group = None
) -> RunDirLock | None:
    """Lock ``run_dir`` on the group's main rank; with ``fresh`` (``resume=False``) move the
    previous run aside. Refused on every rank (the main rank's verdict is broadcast) when the run
    directory or its ``snapshots/`` belongs to another user, or when anything the run writes there
    is a symbolic link."""
    lock: RunDirLock | None = None
    error: tuple[str, int | None] | None = None
    if is_main:
        path = Path(run_dir)
        lock = RunDirLock(path)
        try:
            # before the lock file is made: nothing is created in another user's folder
            fs.check_owned(path, "run_dir", follow=True, kind="run_dir")
            lock.acquire()
            for name in RUN_FILES:
                what = "the snapshots folder" if name == "snapshots" else ""
                fs.check_owned(path / name, what, follow=False, kind="run_dir")
            if fresh:
                _set_aside_previous_run(path)
        except ConfigError as err:
            lock.release()
            lock, error = None, (str(err), None)
        except OSError as err:
            # stays an OSError on every rank: a search tells the machine's errors by their errno
            lock.release()
            lock, error = (
                None,
                (f"cannot take run_dir {str(path)!r}: {err.strerror or err}", err.errno),
            )
    error = broadcast_object(error, group=group)
    if error is not None:
        message, code = error
        if code is not None:
            raise OSError(code, message)
        raise ConfigError(message)
    return lock


def _set_aside_previous_run(run_dir: Path) -> None:
    # left, an old run's later snapshots would be resumed first; the folder they go to is laid out
    # as a run directory: `ddpkit plot` draws it
    snapshots = run_dir / "snapshots"
    present = [
        name
        for name in PREVIOUS_RUN
        if os.path.lexists(run_dir / name)
        and not (name == "snapshots" and snapshots.is_dir() and not any(snapshots.iterdir()))
    ]
    if not present:
        return
    aside = run_dir / f"replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    fs.make_dir(aside, root=run_dir)
    for name in present:
        # moves a link itself, never what it points to
        fs.rename(run_dir / name, aside / name, root=run_dir)
    print(
        f"ddpkit: resume=False: the previous run's {', '.join(present)} moved to {aside}; this "
        "run starts them afresh",
        flush=True,
    )
