"""Where this rank is: its step, phase and collectives, in a page ``rank<RANK>.progress`` (in the
job folder's ``progress/``: :mod:`ddpkit.distributed._channels`) that ``ddpkit run``'s agent reads
(docs/launcher.md, "When a job hangs"); a mark is a few plain stores into it. Outside ``ddpkit
run`` a mark returns at once."""

from __future__ import annotations

import functools
import mmap
import os
import struct
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ddpkit import _fs as fs
from ddpkit.distributed._channels import PROGRESS, channel
from ddpkit.platforms import _torchrun as torchrun

RECORD = struct.Struct("=qqqqqqqqqqddd")
"""The record, in native byte order (the rank and its agent share the machine): magic, pid, op,
phase, marks made, step, steps begun, collectives entered, the elements of the collective's first
tensor (-1: none), the peer of a point-to-point call (-1: none or any); when the step began
(``CLOCK_MONOTONIC``), the seconds the step before took, the group's collective timeout (0: not
known). A mark writes the count of marks last."""
SIZE = RECORD.size
MAGIC = 0x334B5044  # "DPK3"
_MAGIC, _PID, _OP, _PHASE, _SEQ, _STEP, _STEPS, _COLL, _NUMEL, _PEER = range(10)
_STEP_AT, _LAST_STEP, _TIMEOUT = 10, 11, 12


class Phase:
    """What a rank is doing (plain ints: an enum's conversion would cost a mark more than its
    store). ``LOOP``: after a loader handed over a batch, in a loop ddpkit does not drive."""

    STARTING = 0
    DATA = 1
    LOOP = 2
    FORWARD_BACKWARD = 3
    OPTIMIZER = 4
    COLLECTIVE = 5
    SNAPSHOT = 6
    USER = 7
    GRADIENT_SYNC = 8
    EVALUATION = 9
    MAIN_FIRST = 10
    EXPORT = 11
    POINT_TO_POINT = 12


PHASE_NAMES = {
    Phase.STARTING: "starting (before its first step)",
    Phase.DATA: "loading data",
    Phase.LOOP: "in its loop (forward/backward, optimizer or user code)",
    Phase.FORWARD_BACKWARD: "forward/backward",
    Phase.OPTIMIZER: "the optimizer step",
    Phase.COLLECTIVE: "in a collective",
    Phase.SNAPSHOT: "saving a snapshot",
    Phase.USER: "user code between steps (callbacks, validation)",
    Phase.GRADIENT_SYNC: "at its backward's end, in DDP's all-reduce of the gradients",
    Phase.EVALUATION: "evaluating (validation)",
    Phase.MAIN_FIRST: "alone in main_first()'s body (the others wait for it)",
    Phase.EXPORT: "writing the best or final weights",
    Phase.POINT_TO_POINT: "in a point-to-point call",
}

OPS = (
    "collective", "all_reduce", "all_gather", "gather_tensors", "all_gather_object",
    "gather_object", "broadcast_object", "barrier", "first_failure", "broadcast", "reduce",
    "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "gather", "scatter", "broadcast_object_list", "scatter_object_list",
    "monitored_barrier", "shutdown", "send", "recv",
)  # fmt: skip
"""The ops a record names, by their index; an op not listed is recorded as ``collective``."""
_OP_CODES = {op: code for code, op in enumerate(OPS)}

_buf: mmap.mmap | None = None
_ints: memoryview[int] | None = None  # the page as 8-byte integers (slots 0-9)
_floats: memoryview[float] | None = None  # and as doubles (slots 10-12)
_opened = False  # tried to open (a missing folder is not tried again)
_phase = Phase.STARTING
_op = 0
_step = 0
_steps = 0
_seq = 0
_coll = 0
_numel = -1
_peer = -1
_step_at = 0.0
_last_step = 0.0
_timeout = 0.0
_trainer_counts = False  # the Trainer numbers the steps; a loader's batches are then micro-batches
_clock = time.monotonic


def _open() -> bool:
    global _opened, _buf, _ints, _floats
    _opened = True
    folder, rank = channel(PROGRESS), torchrun.rank_text(os.environ)
    if folder is None or rank is None or not rank.isdigit():
        return False
    try:
        fd = fs.open_fd(folder / f"rank{rank}.progress", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        return False  # the agent's folder went away (the job is ending): nothing to report to
    try:
        # the room taken now: a store into a mapped page of a full tmpfs is a SIGBUS
        os.posix_fallocate(fd, 0, SIZE)
        _buf = mmap.mmap(fd, SIZE)
    except OSError as err:
        print(
            f"ddpkit: rank {rank} keeps no progress record ({err.strerror}: {folder}): the stall "
            "watch does not judge this job",
            file=sys.stderr,
            flush=True,
        )
        return False
    finally:
        os.close(fd)
    _ints, _floats = memoryview(_buf).cast("q"), memoryview(_buf).cast("d")
    _ints[_MAGIC], _ints[_PID] = MAGIC, os.getpid()
    return True


def _write() -> None:
    global _seq
    if _ints is None and (_opened or not _open()):
        return
    assert _ints is not None and _floats is not None
    _seq += 1
    _ints[_OP], _ints[_PHASE], _ints[_STEP], _ints[_STEPS] = _op, _phase, _step, _steps
    _ints[_COLL], _ints[_NUMEL], _ints[_PEER] = _coll, _numel, _peer
    _floats[_STEP_AT], _floats[_LAST_STEP], _floats[_TIMEOUT] = _step_at, _last_step, _timeout
    _ints[_SEQ] = _seq


def reset() -> None:
    """This rank's record as a fresh process keeps it (a script run again in its process, ``ddpkit
    run --recover in-place``): no step, no collective counted; the count of marks goes on, so that
    the agent sees the record change. A survivor that kept its counts would seem ahead of a
    replacement that starts at 0, and the stall watch would blame the replacement."""
    global _phase, _op, _step, _steps, _coll, _numel, _peer, _step_at, _last_step, _timeout
    global _trainer_counts, _depth
    _phase, _op, _step, _steps, _coll, _numel, _peer = Phase.STARTING, 0, 0, 0, 0, -1, -1
    _step_at = _last_step = _timeout = 0.0
    _trainer_counts, _depth = False, 0
    if _ints is not None:
        _write()


def collective_timeout(seconds: float) -> None:
    """The process group's collective timeout, written with the rank's next mark (a record made
    before its first mark would let a rank's work before it count as a stall)."""
    global _timeout
    _timeout = seconds


def watched() -> bool:
    """Whether an agent reads this rank's marks (``ddpkit run``); elsewhere a mark does nothing."""
    return _ints is not None or (not _opened and _open())


def mark(phase: int) -> None:
    """This rank is now in ``phase`` (a :class:`Phase`): two stores into the page."""
    global _phase, _seq
    _phase = phase
    if _ints is None:
        _write()
        return
    _seq += 1
    _ints[_PHASE] = phase
    _ints[_SEQ] = _seq


def begin_step(step: int) -> None:
    """This rank starts step ``step`` (the Trainer's); loaders' batches no longer count steps."""
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
def phase(p: int) -> Iterator[None]:
    """In ``p`` for the body; then back in the phase before."""
    before = _phase
    mark(p)
    try:
        yield
    finally:
        mark(before)


class collective:  # noqa: N801  (used as a function: `with progress.collective("all_reduce"):`)
    """In collective ``op`` (of ``numel`` elements, -1: not said), the next in this rank's
    sequence; a collective inside another counts once, as the outer one."""

    __slots__ = ("before", "outer")

    def __init__(self, op: str, numel: int = -1) -> None:
        global _phase, _op, _coll, _numel, _depth
        self.outer = _depth == 0
        _depth += 1
        if not self.outer:
            return
        self.before = _phase
        _op, _numel = _OP_CODES.get(op, 0), numel
        _coll += 1
        _phase = Phase.COLLECTIVE

    def __enter__(self) -> None:
        if self.outer:
            _write()

    def __exit__(self, *exc: object) -> None:
        global _depth
        _depth -= 1
        if self.outer:
            mark(self.before)


_depth = 0  # collectives entered and not yet left (nested: one inside another)


@contextmanager
def point_to_point(op: str, peer: int) -> Iterator[None]:
    """In a blocking ``send`` or ``recv`` with ``peer`` (-1: any) for the body: not a collective
    (ranks make different ones, in different numbers), so the count of collectives stays."""
    global _phase, _op, _peer
    before = _phase
    _phase, _op, _peer = Phase.POINT_TO_POINT, _OP_CODES.get(op, 0), peer
    _write()
    try:
        yield
    finally:
        _peer = -1
        mark(before)


_DDPKITS_OWN = ("collective", "gather_tensors", "broadcast_object", "first_failure", "shutdown")
POINT_TO_POINT = ("send", "recv")
TORCH_COLLECTIVES = tuple(op for op in OPS if op not in _DDPKITS_OWN + POINT_TO_POINT)
"""The collectives :func:`watch_torch_collectives` marks, with the blocking point-to-point calls
(:data:`POINT_TO_POINT`)."""


def _numel_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The elements of a collective's first tensor argument (a list's first), -1 without one."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)) and value:
            value = value[0]
        if hasattr(value, "numel") and callable(value.numel):
            return int(value.numel())
    return -1


def _watched_call(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    import inspect

    import torch.distributed as dist

    try:
        at = list(inspect.signature(fn).parameters).index("group")
    except (ValueError, TypeError):
        at = None

    peer_name = {"send": "dst", "recv": "src"}.get(op)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        group = args[at] if at is not None and len(args) > at else kwargs.get("group")
        # a group's collectives are its ranks' alone: counted, other groups would seem to disagree
        if _depth or (group is not None and group is not dist.GroupMember.WORLD):
            return fn(*args, **kwargs)
        if peer_name is not None:
            peer = args[1] if len(args) > 1 else kwargs.get(peer_name)
            with point_to_point(op, peer if isinstance(peer, int) else -1):
                return fn(*args, **kwargs)
        with collective(op, _numel_of(args, kwargs)):
            return fn(*args, **kwargs)

    call.__ddpkit_watched__ = fn  # type: ignore[attr-defined]
    return call


def watch_torch_collectives() -> list[str]:
    """Mark the world's collectives called through ``torch.distributed`` as ddpkit's own are, under
    ``ddpkit run`` only, once; return the ops of :data:`TORCH_COLLECTIVES` this torch has."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if channel(PROGRESS) is None:
        return []
    wrapped = []
    for op in TORCH_COLLECTIVES + POINT_TO_POINT:
        fn = getattr(dist, op, None)
        if fn is None or not callable(fn):
            continue
        if not hasattr(fn, "__ddpkit_watched__"):
            call = _watched_call(op, fn)
            setattr(dist, op, call)
            if getattr(c10d, op, None) is fn:
                setattr(c10d, op, call)
        wrapped.append(op)
    return wrapped


def _after_fork_in_child() -> None:
    # A rank's children (loader workers) inherit its mapping and must not write its record; one
    # forked before any mark (the fork server's workers) opens its own.
    global _buf, _ints, _floats, _opened
    if _buf is not None:
        _ints, _floats, _buf, _opened = None, None, None, True


os.register_at_fork(after_in_child=_after_fork_in_child)
