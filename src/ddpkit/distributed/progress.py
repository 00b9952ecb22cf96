"""Where this rank is: its step and phase, written where the launcher's agent reads them without a collective.

Under ``ddpkit run`` the agent names a folder in node-local shared memory (:data:`DIR_ENV`); each rank keeps
one record of :data:`SIZE` bytes there, ``rank<RANK>.progress``, mapped into its memory and overwritten by
every mark with plain stores (one ``struct.pack_into``: no system call, a few hundred nanoseconds). The agent
polls the records of its node's ranks (:mod:`ddpkit.launch.watch`) and names a rank that stopped making
progress while the others wait for it. Outside ``ddpkit run`` every mark returns at once.

Who marks: the Trainer's loop (data, forward/backward, optimizer, snapshot, callbacks); a ``build_loader``
loader (loading data, and a step boundary at each batch handed over, for a hand-written loop); ddpkit's
collectives (the op and a per-rank sequence number, which the agent compares across ranks).

Record layout (little endian): magic, pid, op, phase (u32 each); marks made (u64); step, steps begun in this
process (i64); collectives entered (u64); the time the current step began (f64, seconds of ``CLOCK_MONOTONIC``)
and the seconds the step before it took. A mark within a step writes the phase and the count of marks alone
(:data:`HOT`, 12 bytes); the agent times a rank's silence by its own clock, between two counts it read.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import IntEnum
from pathlib import Path

DIR_ENV = "DDPKIT_PROGRESS_DIR"
"""The folder of the ranks' records on this node, set by ``ddpkit run``'s agent."""

RECORD = struct.Struct("<4sIIIQqqQdd")
HOT = struct.Struct("<IQ")
"""Phase and marks made, at :data:`HOT_AT`: what a mark within a step rewrites."""
HOT_AT = 12
SIZE = RECORD.size
MAGIC = b"DPK1"


class Phase(IntEnum):
    """What a rank is doing. ``LOOP``: after a loader handed over a batch, in a loop ddpkit does not drive."""

    STARTING = 0
    DATA = 1
    LOOP = 2
    FORWARD_BACKWARD = 3
    OPTIMIZER = 4
    COLLECTIVE = 5
    SNAPSHOT = 6
    USER = 7


PHASE_NAMES = {
    Phase.STARTING: "starting (before its first step)",
    Phase.DATA: "loading data",
    Phase.LOOP: "in its loop (forward/backward, optimizer or user code)",
    Phase.FORWARD_BACKWARD: "forward/backward",
    Phase.OPTIMIZER: "the optimizer step",
    Phase.COLLECTIVE: "in a collective",
    Phase.SNAPSHOT: "saving a snapshot",
    Phase.USER: "user code between steps (callbacks, validation)",
}

OPS = (
    "collective",
    "all_reduce",
    "all_gather",
    "gather_tensors",
    "all_gather_object",
    "gather_object",
    "broadcast_object",
    "barrier",
    "first_failure",
)
"""The ops a record names, by their index; an op not listed is recorded as ``collective``."""

_buf: mmap.mmap | None = None
_opened = False  # tried to open (a missing folder is not tried again)
_pid = 0
_phase = int(Phase.STARTING)
_op = 0
_step = 0
_steps = 0
_seq = 0
_coll = 0
_step_at = 0.0
_last_step = 0.0
_trainer_counts = False  # the Trainer numbers the steps; a loader's batches are then micro-batches
_clock = time.monotonic


def _open() -> mmap.mmap | None:
    global _opened, _pid
    _opened = True
    folder, rank = os.environ.get(DIR_ENV), os.environ.get("RANK")
    if not folder or rank is None or not rank.isdigit():
        return None
    from ddpkit import fs

    try:
        fd = fs.open_fd(Path(folder) / f"rank{rank}.progress", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        return None  # the agent's folder went away (the job is ending): nothing to report to
    try:
        os.ftruncate(fd, SIZE)
        buf = mmap.mmap(fd, SIZE)
    finally:
        os.close(fd)
    _pid = os.getpid()
    return buf


def _write() -> None:
    global _buf, _seq
    if _buf is None:
        if _opened:
            return
        _buf = _open()
        if _buf is None:
            return
    _seq += 1
    RECORD.pack_into(_buf, 0, MAGIC, _pid, _op, _phase, _seq, _step, _steps, _coll, _step_at, _last_step)


def mark(phase: int) -> None:
    """This rank is now in ``phase`` (a :class:`Phase`)."""
    global _phase, _seq
    _phase = phase
    if _buf is None:
        _write()
        return
    _seq += 1
    HOT.pack_into(_buf, HOT_AT, phase, _seq)


def begin_step(step: int) -> None:
    """This rank starts step ``step`` (the Trainer: its optimizer step); loaders' batches no longer count steps."""
    global _trainer_counts, _phase
    _trainer_counts = True
    _next_step(step)
    _phase = Phase.DATA
    _write()


def batch_taken() -> None:
    """A loader handed over a batch: in a hand-written loop, the next step begins."""
    global _phase
    if _trainer_counts:
        mark(Phase.FORWARD_BACKWARD)
        return
    _next_step(_step + 1)
    _phase = Phase.LOOP
    _write()


def _next_step(step: int) -> None:
    global _step, _steps, _step_at, _last_step
    now = _clock()
    if _steps:
        _last_step = now - _step_at
    _step, _steps, _step_at = step, _steps + 1, now


@contextmanager
def phase(p: Phase) -> Iterator[None]:
    """In ``p`` for the body; then back in the phase before."""
    before = _phase
    mark(p)
    try:
        yield
    finally:
        mark(before)


@contextmanager
def collective(op: str) -> Iterator[None]:
    """In collective ``op``, the next in this rank's sequence; every rank enters the same ones in the same order."""
    global _phase, _op, _coll
    before = _phase
    _op = OPS.index(op) if op in OPS else 0
    _coll += 1
    _phase = Phase.COLLECTIVE
    _write()
    try:
        yield
    finally:
        mark(before)


def _after_fork_in_child() -> None:
    # A rank's own children (DataLoader workers) inherit its mapping: they are not the rank, and must not write
    # its record. A process forked before any mark (the launcher's fork server's workers) opens its own.
    global _buf, _opened
    if _buf is not None:
        _buf, _opened = None, True


os.register_at_fork(after_in_child=_after_fork_in_child)
