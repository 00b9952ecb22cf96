"""What a search keeps in ``search_dir``, checked before a job touches it.

Three ways a search_dir can mislead a job into training the wrong thing, or into failing healthy
trials:

- two jobs at once: the second would take the first one's live trials for trials a dead job left
  running and fail them. World rank 0 holds an advisory lock (:func:`fcntl.flock`) on
  ``search_dir/.lock`` for the life of the search, naming its holder; the kernel drops it when the
  process ends, however it ends, so a killed job leaves nothing behind and its restart takes the
  lock at once;
- a journal whose last record was cut (a kill or a full disk while Optuna wrote it): Optuna skips a
  last line without its newline, then glues the next record to it, and every later read fails to
  parse that line;
- ``trial-NNNN`` folders the study knows nothing of (its journal was emptied or removed, or
  ``study_name`` changed): a new trial of that number would resume the old one's finished snapshot
  and train nothing.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._fs.lock import FolderLock

JOURNAL = "study.journal"
# Optuna reads a journal whole and replays every record at each open: a GiB is a million trials of
# ~1 KB each.
JOURNAL_LIMIT = 1 << 30
_TRIAL_DIR = re.compile(r"trial-(\d+)")


def trial_dir(search_dir: Path, number: int) -> Path:
    return search_dir / f"trial-{number:04d}"


class SearchDirLock(FolderLock):
    """An exclusive advisory lock on ``search_dir/.lock``, naming its holder (host, pid) inside the
    file: the run directory's lock (:class:`ddpkit._fs.lock.FolderLock`), in the words of a
    search."""

    def __init__(self, search_dir: str | os.PathLike) -> None:
        super().__init__(
            search_dir,
            what="search_dir",
            job="search job",
            user="search",
            hazard="a second job would take that job's live trials for trials a dead job left "
            "running",
        )


def repair_journal(path: Path) -> str | None:
    """Make Optuna's journal file readable again after a write was cut short; say what was done, or
    None.

    Call it only while no process writes the journal (under :class:`SearchDirLock`, before the study
    is opened). A journal is a log: every prefix of whole records is a consistent study, so the
    bytes after the last newline (a record cut short) are moved to a file beside it and the journal
    ends at its last whole record; a trial whose last record was cut is then still running, and the
    search resumes it. A damaged line before the last cannot be cut out that way (the records after
    it may depend on it): that is a :class:`ConfigError` naming the line and the ways out, and the
    file is left as it is.
    """
    # Optuna appends to the journal through an open() that would follow a link: none may stand
    # there.
    fs.check_owned(path, "the study's journal", follow=False)
    # nor a second name of the file (a search_dir copied with cp -al): Optuna's writes stay ours
    fs.unshare(path)
    if not path.is_file():
        return None
    refuse_large_journal(path, path.stat().st_size)
    data = fs.read_bytes(path)
    whole, _, tail = data.rpartition(b"\n")
    lines = whole.split(b"\n") if whole else []
    for number, line in enumerate(lines, start=1):
        if not _is_record(line):
            _refuse_damaged(path, number, len(lines) + bool(tail))
    lock = path.with_name(path.name + ".lock")
    if os.path.lexists(lock):
        # Optuna's journal lock (a symlink) left by a process killed while appending: with the
        # search_dir lock held, no writer can be alive, and Optuna would otherwise wait out its 30 s
        # grace period on every write.
        fs.remove(lock)
    if not tail:
        return None
    if _is_record(tail):
        # Written whole, only its newline missing: Optuna skips such a line, so the record never
        # took effect.
        with fs.open_append(path) as f:
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        return (
            f"ddpkit search: {path} ended without its last newline; the whole record before it "
            "is kept"
        )
    aside = path.with_name(f"{path.name}.cut-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    # first the copy, then the cut: a crash between them loses nothing
    with fs.open_exclusive(aside) as f:
        f.write(tail)
        f.flush()
        os.fsync(f.fileno())
    fs.truncate(path, len(data) - len(tail))
    return (
        f"ddpkit search: {path} ended in a record cut short (a kill or a full disk while it was "
        f"written); its {len(tail)} bytes were moved to {aside.name}, the {len(lines)} whole "
        "records before it are kept"
    )


def refuse_large_journal(path: Path, size: int) -> None:
    if size > JOURNAL_LIMIT:
        raise ConfigError(
            f"the study's journal {path} holds {size} bytes, more than the {JOURNAL_LIMIT} a "
            "search reads: continue the search in another search_dir, or give it an RDB storage "
            "(SearchConfig.storage)"
        )


def _is_record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    # JSONDecodeError, UnicodeDecodeError, a line nested too deep
    except (ValueError, RecursionError):
        return False


def _refuse_damaged(path: Path, number: int, total: int) -> None:
    kept = number - 1
    raise ConfigError(
        f"the study's journal {path} is damaged at line {number} of {total} (not a whole record; a "
        "write cut short, then others appended to it), and Optuna cannot read past it. Either "
        f"keep the {kept} whole records before it (`head -n {kept} {path} > {path}.kept && mv "
        f"{path} {path}.damaged && mv {path}.kept {path}`: the trials recorded after them are "
        "dropped, and their trial-NNNN folders must be moved away too), or start the search "
        "afresh in another search_dir"
    )


def check_trial_dirs(search_dir: Path, owned: set[int], study: str) -> None:
    """Refuse ``trial-NNNN`` folders with content whose trial is not one of this search's ``owned``
    trials."""
    strangers = []
    for path in sorted(search_dir.glob("trial-*")):
        match = _TRIAL_DIR.fullmatch(path.name)
        if match:
            # a trial's run directory is made here, by the search: never through a link
            fs.refuse_link(path)
        if match and int(match.group(1)) not in owned and path.is_dir() and any(path.iterdir()):
            strangers.append(path.name)
    if strangers:
        listed = ", ".join(strangers[:6]) + (
            f" and {len(strangers) - 6} more" if len(strangers) > 6 else ""
        )
        raise ConfigError(
            f"search_dir {str(search_dir)!r} holds trial folders that no trial of this search in "
            f"{study} owns: {listed}. They are another search's (its journal was emptied or "
            "removed, or study_name changed), and a new trial of the same number would resume "
            "that one's snapshots instead of training. Give this search another search_dir, or "
            "move those folders out of this one (or delete them)"
        )


def describe_storage(config: Any) -> str:
    """Where the study lives, for messages."""
    where = config.storage or str(Path(config.search_dir) / JOURNAL)
    return f"study {config.study_name!r} ({where})"
