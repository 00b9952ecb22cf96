"""A run directory belongs to one job at a time: the group's rank 0 holds ``run_dir/.lock``
(:mod:`ddpkit._fs.lock`) for the life of ``fit()``; the phases of one script
(``run_dir/<phase>/``) share it, held by the process until it ends, so that no other job takes the
folder between them. ``resume=False`` moves the previous run's files aside.
"""

from __future__ import annotations

import gc
import os
import time
import weakref
from pathlib import Path
from typing import Any

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._fs.lock import FolderLock
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import broadcast_object


def run_dir_lock(run_dir: str | os.PathLike) -> FolderLock:
    """An exclusive advisory lock on ``run_dir/.lock``, naming its holder (host, pid) inside."""
    return FolderLock(
        run_dir,
        what="run_dir",
        job="job",
        user="run",
        hazard="two jobs on one run directory would interleave their records and resume from each "
        "other's snapshots",
    )


PREVIOUS_RUN = (
    "snapshots", "best.pt", "best.safetensors", "best_weights.pt", "final.safetensors",
    "final_weights.pt", "metrics.jsonl", "metrics.rewound.jsonl", "epochs.csv", "tensorboard",
    "loggers.json", "config.json", "curves.png",
)  # fmt: skip
"""What ``resume=False`` moves aside: the previous run's state and records (``mlflow.db`` and
``wandb/`` hold many runs: they stay)."""
RUN_FILES = (*PREVIOUS_RUN, "mlflow.db", "wandb")
"""What a run writes in its run directory (besides ``.lock``): none of it may be a symbolic link."""


_HELD: dict[Path, FolderLock] = {}
"""The run directories of phases this process has locked, until it ends."""
TRAINERS: weakref.WeakKeyDictionary[Any, tuple[Path, str | None]] = weakref.WeakKeyDictionary()
"""Each live Trainer of this process, and the (run_dir, phase) it trains in."""


def refuse_shared(run_dir: str | os.PathLike, phase: str | None) -> tuple[Path, str | None]:
    """The key a Trainer registers under in :data:`TRAINERS`; a :class:`ConfigError` naming
    ``phase=`` while another live Trainer of this process has ``run_dir`` with the same phase, or
    with a phase where this one has none or the reverse. Two without a phase pass: the second
    resumes the first's run, or the run record's check refuses it."""
    root = Path(run_dir).resolve()

    def others() -> list[str | None]:
        same = [p for r, p in list(TRAINERS.values()) if r == root]
        return [p for p in same if (phase and p == phase) or (p is None) != (phase is None)]

    if others():
        gc.collect()  # one that is unreachable, held only by a reference cycle, has ended
    if clash := others():
        other = f"phase={clash[0]!r}" if clash[0] else "no phase"
        raise ConfigError(
            f"run_dir {str(run_dir)!r} is already used by another Trainer of this process "
            f"({other}): two trainings in one folder would resume each other's snapshots. Give "
            "each training of the script its own TrainerConfig(phase=...) (it then writes in "
            "run_dir/<phase>/: phase='teacher', phase='student'), or its own run_dir; to resume "
            "a run in the same process, let go of its first Trainer (del trainer)"
        )
    return root, phase


def claim(
    run_dir: str | os.PathLike,
    *,
    is_main: bool,
    fresh: bool,
    group: Group = None,
    root: str | os.PathLike | None = None,
) -> FolderLock | None:
    """Lock ``run_dir`` on the group's main rank; with ``fresh`` (``resume=False``) move the
    previous run aside. Refused on every rank when the run directory or what the run writes there
    is another user's or a symbolic link. ``root``: ``run_dir`` is a phase's folder in it, and the
    lock is ``root``'s, held by this process until it ends (None is returned)."""
    lock: FolderLock | None = None
    error: Exception | None = None
    if is_main:
        path, top = Path(run_dir), Path(root or run_dir)
        held = _HELD.get(top.resolve())
        taken = held or run_dir_lock(top)
        try:
            # before the lock file is made: nothing is created in another user's folder
            fs.check_owned(top, "run_dir", follow=True, kind="run_dir")
            if held is None:
                taken.acquire()
            for name in RUN_FILES if path == top else ("", *RUN_FILES):
                what = "the snapshots folder" if name == "snapshots" else ""
                fs.check_owned(path / name, what, follow=False, kind="run_dir")
            if fresh:
                _set_aside_previous_run(path)
            if root is None and held is None:
                lock = taken
            else:
                _HELD[top.resolve()] = taken
        except (ConfigError, OSError) as err:
            if held is None:
                taken.release()
            error = err
            if isinstance(err, OSError):  # an OSError on every rank: a search tells it by errno
                message = f"cannot take run_dir {str(path)!r}: {err.strerror or err}"
                error = OSError(err.errno, message)
    error = broadcast_object(error, group=group)  # raised on every rank alike
    if error is not None:
        raise error
    return lock


def _set_aside_previous_run(run_dir: Path) -> None:
    # left, an old run's later snapshots would be resumed first
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
