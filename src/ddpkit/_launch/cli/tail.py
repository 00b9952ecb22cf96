"""``--all-ranks``: each rank's output tagged ``[rank N]`` by whole lines, in place of torchrun's
reader (which tags what ``readline()`` finds); a line redrawn with ``\\r`` is shown as a terminal
shows it, at most every :data:`PROGRESS_EVERY` seconds."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

PROGRESS_EVERY = 5.0  # seconds between two tagged lines of a line still being redrawn

# one line at a time on the shared stream, whichever rank's thread writes
_write_lock = threading.Lock()


class LineTagger:
    """Cuts one rank's output into whole lines, each written as ``header + line`` to ``dst``."""

    def __init__(
        self,
        header: str,
        dst: TextIO,
        keep: Callable[[str], bool] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.header, self.dst, self.keep, self.clock = header, dst, keep, clock
        self._pending = b""
        self._shown_progress = b""
        self._last_progress = -PROGRESS_EVERY

    def feed(self, data: bytes) -> None:
        """Take more output: write every line it completes, and a progress update if due."""
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            self._write(_final_state(line))
            self._shown_progress, self._last_progress = b"", -PROGRESS_EVERY
        last_redraw = self._pending.rstrip(b"\r").rfind(b"\r")
        if last_redraw >= 0:
            # between the last two \r: the latest whole redraw (what follows may be half written)
            latest = self._pending[:last_redraw].rsplit(b"\r", 1)[-1]
            self._pending = self._pending[last_redraw:]
            now = self.clock()
            if (
                latest
                and latest != self._shown_progress
                and now - self._last_progress >= PROGRESS_EVERY
            ):
                self._write(latest)
                self._shown_progress, self._last_progress = latest, now

    def close(self) -> None:
        """The rank's output ended: write what it left without a final newline."""
        if self._pending:
            self._write(_final_state(self._pending))
            self._pending = b""

    def _write(self, line: bytes) -> None:
        text = line.decode("utf-8", errors="replace") + "\n"
        if self.keep is not None and not self.keep(text):
            return
        with _write_lock:
            self.dst.write(f"{self.header}{text}")
            self.dst.flush()


def _final_state(line: bytes) -> bytes:
    """What a terminal shows of a line redrawn with ``\\r``: the text after the last one."""
    return line.rstrip(b"\r").rsplit(b"\r", 1)[-1]


def tail_lines(
    header: str,
    file: str,
    dst: TextIO,
    finished: threading.Event,
    interval_sec: float,
    log_line_filter: Callable[[str], bool] | None = None,
    **_: Any,
) -> None:
    """Follow ``file`` (a rank's output, still being written) until ``finished`` is set and it is
    read to the end, writing its whole lines to ``dst`` behind ``header``: torchrun's
    ``tail_logfile``, by line."""
    while not os.path.exists(file):
        if finished.wait(interval_sec) and not os.path.exists(file):
            return
    tagger = LineTagger(header, dst, log_line_filter)
    with open(file, "rb") as fp:
        while True:
            done = finished.is_set()  # then all they wrote is in the file before the read
            data = fp.read(1 << 16)
            if data:
                tagger.feed(data)
            elif done:
                break
            else:
                finished.wait(interval_sec)  # torchrun's own poll: a growing file gives no signal
    tagger.close()


def install() -> None:
    """Make torchrun's ``TailLog`` (``--tee``) write whole lines, through its module's name."""
    from torch.distributed.elastic.multiprocessing import tail_log

    tail_log.tail_logfile = tail_lines
