"""The resume tests' job (:mod:`tests.jobs.scripts.train_job`) with snapshots in memory on and disk
snapshots rare, for the tests of the snapshots in memory.

Test hooks live here, not in ddpkit: SIGKILL at a random instant after a given step (a timer thread,
so the kill lands anywhere: in a forward pass, in the all-reduce, in the copy to memory), SIGKILL in
the middle of the copy to memory, a record of every step each rank completed (to count the steps a
failure lost), holding every rank after a step until a file exists (while a test takes a node away),
and the controls: memory off, and no copy of every rank's own part on its peers.

    python -m tests.jobs.scripts.memory_job RUN_DIR --log DIR [--kill-rank R --kill-after-step S]
        [--kill-delay SECONDS] [--kill-in-copy S] [--no-memory] [--disk-every-steps N] [--out FILE]
        [--kill-again R S] [--kill-in-restore R] [--sleep-at R S SECONDS] [--fill-memory BYTES]
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import ddpkit
import ddpkit.snapshot._memory
import ddpkit.snapshot._slots
import tests.jobs.scripts.train_job as train_job
from ddpkit.distributed._channels import JOB_DIR_ENV
from tests.jobs.scripts.train_job import train
from tests.tmpfs import fill


def _sigkill(log: str, what: str) -> None:
    Path(log, f"killed-{what}").write_text(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for(path: str) -> None:
    """Poll for a file the test creates when it has done its part (up to 2 minutes)."""
    deadline = time.monotonic() + 120
    while not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


class StepRecord:
    """Appends ``attempt step`` to ``log/steps-rank<r>.txt`` after each optimizer step; holds at a
    step if asked; and, on the first attempt, arms the kill."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.file: Any = None

    def on_step_end(self, trainer: Any, taken: bool, output: Any) -> None:
        a, rt = self.a, trainer.runtime
        if self.file is None:
            self.file = open(Path(a.log) / f"steps-rank{rt.rank}.txt", "a", buffering=1)  # noqa: SIM115
        self.file.write(f"{rt.restart_count} {trainer.step}\n")
        if a.hold_after_step is not None and trainer.step == a.hold_after_step:
            _wait_for(a.hold_file)  # every rank waits while the test takes a node away
        if (
            a.sleep_at is not None
            and rt.restart_count == 0
            and (rt.rank, trainer.step) == tuple(a.sleep_at[:2])
        ):
            time.sleep(a.sleep_at[2])  # a long pause of this rank's own (not a collective)
        again = a.kill_again is not None and rt.restart_count == 1
        if again and (rt.rank, trainer.step) == tuple(a.kill_again):
            _sigkill(a.log, f"again-rank{rt.rank}-after-step{trainer.step}")
        if rt.restart_count == 0 and rt.rank == a.kill_rank and trainer.step == a.kill_after_step:
            # the test says when: another job has come and gone meanwhile
            if a.kill_when_file is not None:
                _wait_for(a.kill_when_file)
            # A timer, not a sleep in the loop: training goes on, and the kill lands wherever it is
            # then.
            what = f"rank{rt.rank}-after-step{trainer.step}"
            timer = threading.Timer(a.kill_delay, _sigkill, (a.log, what))
            timer.daemon = True
            timer.start()


def kill_inside_copy(step: int, log: str) -> Any:
    """SIGKILL this process half-way through the copy of ``step`` into memory (first attempt
    only)."""
    copy = ddpkit.snapshot._slots.copy_tensors

    def dying_copy(dests, sources):
        if (
            int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
            and dying_copy.trainer.step == step
        ):
            half = len(dests) // 2
            copy(dests[:half], sources[:half])
            _sigkill(log, f"in-copy-step{step}")
        copy(dests, sources)

    ddpkit.snapshot._slots.copy_tensors = dying_copy
    return dying_copy


def kill_inside_restore(rank: int, log: str) -> None:
    """SIGKILL global rank ``rank`` in the middle of its load of a copy in memory, on the second
    attempt (a replacement or a survivor loading the state after the first failure)."""
    memory = ddpkit.snapshot._memory.MemoryStore
    load = memory._read

    def dying_read(self, choice, *args):
        runtime = ddpkit.get_runtime()
        if runtime.restart_count == 1 and runtime.rank == rank:
            _sigkill(log, f"in-restore-rank{rank}")
        return load(self, choice, *args)

    memory._read = dying_read  # type: ignore[method-assign]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--log", required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-after-step", type=int, default=None)
    p.add_argument("--kill-delay", type=float, default=0.0)
    p.add_argument("--kill-when-file", default=None, help="the kill waits for this file to exist")
    p.add_argument("--kill-in-copy", type=int, default=None, metavar="STEP")
    p.add_argument("--kill-in-copy-rank", type=int, default=0)
    p.add_argument("--no-memory", action="store_true")
    p.add_argument(
        "--memory-every", default="1", help="every N steps, or 'auto' (ddpkit's default)"
    )
    p.add_argument(
        "--no-peers", action="store_true", help="no copy of a rank's state on another node"
    )
    p.add_argument(
        "--stall-budget", type=float, default=None, help="the share of a step a save may take"
    )
    p.add_argument("--hold-after-step", type=int, default=None)
    p.add_argument(
        "--hold-file",
        default=None,
        help="ranks hold after --hold-after-step until this file exists",
    )
    p.add_argument("--raise-at", type=int, nargs=2, metavar=("RANK", "STEP"), default=None)
    p.add_argument("--disk-every-steps", type=int, default=None)
    p.add_argument(
        "--kill-again",
        type=int,
        nargs=2,
        metavar=("RANK", "STEP"),
        default=None,
        help="on the second attempt, SIGKILL RANK after STEP",
    )
    p.add_argument(
        "--kill-in-restore",
        type=int,
        default=None,
        metavar="RANK",
        help="on the second attempt, SIGKILL RANK as it loads the copy in memory",
    )
    p.add_argument(
        "--sleep-at",
        type=float,
        nargs=3,
        metavar=("RANK", "STEP", "SECONDS"),
        default=None,
        help="on the first attempt, RANK pauses after STEP",
    )
    p.add_argument(
        "--fill-memory",
        type=int,
        default=None,
        metavar="BYTES",
        help="rank 0, before the first attempt starts: fill the job folder's file system but BYTES",
    )
    p.add_argument("--augment", action="store_true")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--no-sync-bn", action="store_true")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--global-batch", type=int, default=24)
    return p.parse_args()


def main() -> None:
    a = parse_args()
    if a.stall_budget is not None:
        from ddpkit.snapshot import _interval

        _interval.STALL_BUDGET = a.stall_budget
    rank = int(os.environ.get("RANK", "0"))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    Path(a.log, f"pid-rank{rank}-attempt{attempt}").write_text(str(os.getpid()))
    with open(Path(a.log, f"pids-rank{rank}.txt"), "a") as f:  # every run, a restart for a node
        f.write(f"{os.getpid()}\n")  # that joined included (torch does not count it)
    if a.fill_memory is not None and rank == 0 and attempt == "0":
        # Before ddpkit.init(), which no rank passes alone: no rank has made a slot yet. The job
        # started with room (the agent checks); the room is gone when the first copy is made.
        fill(Path(os.environ[JOB_DIR_ENV]), leave=a.fill_memory)
    dying = None
    if a.kill_in_restore is not None:
        kill_inside_restore(a.kill_in_restore, a.log)
    if a.kill_in_copy is not None and rank == a.kill_in_copy_rank:
        dying = kill_inside_copy(a.kill_in_copy, a.log)

    if a.no_peers:
        config = train_job.SnapshotConfig
        train_job.SnapshotConfig = functools.partial(config, replicas=1)  # type: ignore[misc]

    def hook(trainer: Any) -> None:
        if dying is not None:
            dying.trainer = trainer
        memory = trainer.memory
        memory = "off" if memory is None else "peers" if memory.courier is not None else "on"
        Path(a.log, f"memory-rank{trainer.runtime.rank}-pid{os.getpid()}").write_text(memory)

    train(
        a.run_dir,
        epochs=a.epochs,
        snapshot_every_steps=a.disk_every_steps,
        # disk snapshots rare: none at epoch ends, none by steps unless asked
        snapshot_every_epochs=0,
        memory=not a.no_memory,
        memory_every_steps=None if a.memory_every == "auto" else int(a.memory_every),
        sample_log=a.log,
        out=a.out,
        trainer_hook=hook,
        callbacks=[StepRecord(a)],
        augment=a.augment,
        num_workers=a.workers,
        sync_batchnorm=not a.no_sync_bn,
        catch_preempted=False,
        strategy=a.strategy,
        global_batch=a.global_batch,
        event=("raise", *a.raise_at) if a.raise_at else None,
    )
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
