"""A module of fork_probe.py's own that keeps a file open in its global and never closes it: what it
wrote is on disk only once the file object is flushed, which a new interpreter does as it tears its
modules down."""

from __future__ import annotations

from pathlib import Path
from typing import IO

TEXT = "written through a file its module never closes\n"
log: IO[str] | None = None


def write(path: Path) -> None:
    global log
    log = open(path, "w")  # noqa: SIM115  (kept open on purpose)
    log.write(TEXT)
