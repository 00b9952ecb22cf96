"""Running ``ddpkit run`` on ``tests/jobs/scripts/stall_job.py`` and timing what it says: shared by
the stall watch's tests and ``bench/stall_watch_latency.py``."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ddpkit.testing import start_job

STALL_JOB = str(Path(__file__).parents[1] / "scripts" / "stall_job.py")


@dataclass
class Outcome:
    returncode: int
    stderr: str
    stdout: str
    named_at: float | None
    """Wall time the launcher's line naming the stall came out (None: never)."""
    ended_at: float
    stalled_at: float | None
    """Wall time rank 1 printed that it stalls (from its log; None: it never did)."""

    @property
    def to_named(self) -> float | None:
        return (
            None
            if self.named_at is None or self.stalled_at is None
            else self.named_at - self.stalled_at
        )

    @property
    def to_end(self) -> float | None:
        return None if self.stalled_at is None else self.ended_at - self.stalled_at


def run_stall_job(
    launcher_args: list[str],
    job_args: list[str],
    env: dict[str, str],
    cwd: Path,
    timeout: float = 240,
) -> Outcome:
    """``ddpkit run --nproc 2 LAUNCHER_ARGS stall_job.py JOB_ARGS`` in ``cwd``, its stderr timed
    line by line."""
    proc = start_job(STALL_JOB, *job_args, launcher_args=launcher_args, env=env, cwd=cwd)
    lines: list[str] = []
    named: list[float] = []
    stdout: list[str] = []

    def read_stderr() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if not named and re.search(r"rank \d+ stalled:", line):
                named.append(time.time())
            lines.append(line)

    def read_stdout() -> None:
        assert proc.stdout is not None
        stdout.extend(proc.stdout)

    readers = [threading.Thread(target=read_stderr), threading.Thread(target=read_stdout)]
    for reader in readers:
        reader.start()
    try:
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ended = time.time()
    for reader in readers:
        reader.join(timeout=10)
    stalled = None
    for log in (cwd / "ddpkit-logs").rglob("stdout.log"):
        found = re.search(
            r"rank 1 stalls \(\S+\) after step \d+ at ([0-9.]+)", log.read_text(errors="replace")
        )
        if found:
            stalled = float(found[1])
    return Outcome(
        proc.returncode,
        "".join(lines),
        "".join(stdout),
        named[0] if named else None,
        ended,
        stalled,
    )
