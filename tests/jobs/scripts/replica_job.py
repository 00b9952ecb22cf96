"""The memory job (:mod:`tests.jobs.scripts.memory_job`) with copies on other nodes, for the tests
of a lost node healed from them: how many copies (``--replicas``), holds at a step of a later
attempt (while a test takes a node away again), and a node lost in the middle of a copy's transfer.

Test hooks live here, not in ddpkit. ``--kill-in-transfer RANK STEP``: on the first attempt, RANK's
transfer of its copy of STEP sends its first piece (pieces of 4 KiB, on every rank), writes
``in-transfer-rankR`` in the log folder and waits there: the test then takes its node away.
``--stop-in-exchange RANK``: the first time RANK reshards copies taken at another world size, it
writes ``stopped-in-exchange-rankR`` in the log folder once it has posted its first send or receive
of the pieces, and stops itself (SIGSTOP).

    python -m tests.jobs.scripts.replica_job RUN_DIR --log DIR [memory_job's options]
        [--replicas K] [--hold-at ATTEMPT STEP FILE]... [--kill-in-transfer RANK STEP]
        [--stop-in-exchange RANK]
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import tests.jobs.scripts.memory_job as memory_job
import tests.jobs.scripts.train_job as train_job
from ddpkit.snapshot import _replicas, _resized
from ddpkit.training._config import SnapshotConfig


def _wait_for(path: str) -> None:
    """Poll for a file the test creates when it has done its part (up to 4 minutes)."""
    deadline = time.monotonic() + 240
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def holds(record: type, at: list[tuple[int, int, str]], log: str) -> type:
    """memory_job's step record, holding every rank after STEP of attempt ATTEMPT until FILE
    exists (saying so in ``holding-ATTEMPT-rankR``)."""

    class Holding(record):  # type: ignore[misc,valid-type]
        def on_step_end(self, trainer: Any, taken: bool, output: Any) -> None:
            super().on_step_end(trainer, taken, output)
            rt = trainer.runtime
            for attempt, step, file in at:
                if (rt.restart_count, trainer.step) == (attempt, step):
                    Path(log, f"holding-{attempt}-rank{rt.rank}").write_text(str(os.getpid()))
                    _wait_for(file)

    return Holding


def kill_in_transfer(rank: int, step: int, log: str) -> None:
    """On the first attempt, ``rank`` stops after the first piece of its copy of ``step``."""
    exchange = _replicas.Courier._exchange_chunk
    if getattr(exchange, "planted", False):
        return

    def stopping(self: Any, at: int, index: int, payload: Any, arrivals: Any) -> None:
        exchange(self, at, index, payload, arrivals)
        first = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        if first and (self.rank, at, index) == (rank, step, 0):
            Path(log, f"in-transfer-rank{rank}").write_text(str(os.getpid()))
            time.sleep(600)  # the test takes this node away meanwhile

    stopping.planted = True  # type: ignore[attr-defined]
    _replicas.Courier._exchange_chunk = stopping  # type: ignore[method-assign]


def stop_in_exchange(rank: int, log: str) -> None:
    """The first time ``rank`` reshards copies of another world size, it stops itself (SIGSTOP)
    once it has posted its first send or receive of the pieces."""
    exchange = _resized.exchange
    if getattr(exchange, "planted", False):
        return
    import torch.distributed as dist

    def stopping(pieces: Any, givers: Any, me: int, *args: Any) -> None:
        flag = Path(log, f"stopped-in-exchange-rank{rank}")
        if me != rank or flag.exists():
            return exchange(pieces, givers, me, *args)
        posts = {name: getattr(dist, name) for name in ("isend", "irecv")}

        def stop_after(post: Any) -> Any:
            def posted(*a: Any, **kw: Any) -> Any:
                work = post(*a, **kw)
                flag.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGSTOP)
                return work

            return posted

        for name, post in posts.items():
            setattr(dist, name, stop_after(post))
        try:
            return exchange(pieces, givers, me, *args)
        finally:
            for name, post in posts.items():
                setattr(dist, name, post)

    stopping.planted = True  # type: ignore[attr-defined]
    _resized.exchange = stopping  # type: ignore[assignment]


def main() -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--replicas", type=int, default=None)
    p.add_argument("--hold-at", nargs=3, action="append", default=[],
                   metavar=("ATTEMPT", "STEP", "FILE"))  # fmt: skip
    p.add_argument("--kill-in-transfer", type=int, nargs=2, default=None, metavar=("RANK", "STEP"))
    p.add_argument("--stop-in-exchange", type=int, default=None, metavar="RANK")
    p.add_argument("--log", required=True)
    a, rest = p.parse_known_args()
    if a.replicas is not None:
        train_job.SnapshotConfig = functools.partial(SnapshotConfig, replicas=a.replicas)  # type: ignore[misc]
    at = [(int(attempt), int(step), file) for attempt, step, file in a.hold_at]
    if at and not getattr(memory_job.StepRecord, "holding", False):
        memory_job.StepRecord = holds(memory_job.StepRecord, at, a.log)  # type: ignore[misc]
        memory_job.StepRecord.holding = True  # type: ignore[attr-defined]
    if a.kill_in_transfer is not None:
        _replicas.CHUNK = 4096
        kill_in_transfer(*a.kill_in_transfer, a.log)
    if a.stop_in_exchange is not None:
        stop_in_exchange(a.stop_in_exchange, a.log)
    argv = sys.argv
    sys.argv = [argv[0], *rest, "--log", a.log]  # memory_job reads its own options
    try:
        memory_job.main()
    finally:
        sys.argv = argv


if __name__ == "__main__":
    main()
