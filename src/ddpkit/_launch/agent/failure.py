"""The summary of a failed ``ddpkit run`` job and its exit code: :func:`cause` picks the failure
that ended the job, :func:`summarize_failure` says it first."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddpkit._errors import PREEMPTED_EXIT_CODE
from ddpkit._launch.watch import stall as watch


def _describe(
    rank: int, failure: Any, stall: watch.Stall | None = None, first: bool = False
) -> str:
    if _cut_short(failure):
        how = f"raised, then {failure.signal_name()} ended it as it exited"
    elif failure.exitcode < 0:
        how = f"killed by {failure.signal_name()}"
    else:
        how = f"exit code {failure.exitcode}"
    if stall is not None and rank in stall.ranks:
        how = (
            f"{'' if first and stall.disagreement else 'stalled, '}ended by the stall watch ({how})"
        )
    return f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}): {how}"


@dataclass(frozen=True)
class Left:
    """A worker that exited with code 0 while the others of its node went on."""

    rank: int
    local_rank: int
    pid: int
    step: int | None  # at its last mark (None: it never marked one)


def _left_line(left: Sequence[Left], first_rank: int) -> str:
    """The line, before a failed job's summary, that says which ranks left the job early."""
    if len(left) == 1:
        one = left[0]
        at = f" at step {one.step}" if one.step is not None else ""
        who = f"rank {one.rank} (local rank {one.local_rank}, pid {one.pid})"
    else:
        at = ""
        who = "ranks " + ", ".join(
            f"{g.rank}" + (f" (step {g.step})" if g.step is not None else "") for g in left
        )
    return (
        f"ddpkit run: {who} left the job with exit code 0{at} while the others went on; rank "
        f"{first_rank} then failed (below): a script that returns, or calls sys.exit(0), on some "
        "ranks only leaves the others to fail in their next collective; end every rank at the same "
        "step"
    )


def _recorded(failure: Any) -> tuple[str, list[str]]:
    data = (failure.error_file_data or {}).get("message")
    if not isinstance(data, dict):
        return "", []
    stack = data.get("extraInfo", {}).get("py_callstack", "").rstrip().splitlines()
    # the user's frames start after the last runpy frame (the launch machinery's)
    runpy_frames = [i for i, line in enumerate(stack) if "<frozen runpy>" in line]
    if runpy_frames:
        stack = stack[runpy_frames[-1] + 1 :]
    return data.get("message", ""), stack


# what a rank's collective says when a peer went away: another rank's failure, not a cause
_PEER_LOST = (
    "Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
)  # fmt: skip


def _peer_lost(failure: Any) -> bool:
    message, _ = _recorded(failure)
    return any(text in message for text in _PEER_LOST)


# the signal the launcher sends its workers: a worker ended by it is a consequence
_OUR_SIGNALS = (-signal.SIGTERM,)


def _cut_short(failure: Any) -> bool:
    """A rank that recorded its exception and was ended by a signal as its interpreter wound down
    (another rank's exit was polled first and the agent stopped the rest; a thread kept it alive
    until the agent's SIGKILL): the exception is what ended it."""
    return failure.exitcode < 0 and bool(_recorded(failure)[0])


def cause(failures: dict[int, Any], stall: watch.Stall | None = None) -> tuple[int, Any]:
    """(rank, failure) of the worker whose failure ended the job. torchrun orders failures in whole
    seconds, so the first in time can be a consequence. In order: a rank the stall watch named
    (``stall``), an exception that is not a lost peer, an exit with an error code, a death by a
    signal the launcher did not send, then the earliest."""
    by_time = sorted(failures.items(), key=lambda rf: (rf[1].timestamp, rf[0]))
    for rank, failure in by_time:
        if stall is not None and rank in stall.ranks:
            return rank, failure
    # of two errors, the one that exited by itself first (not by the agent's signal)
    for rank, failure in sorted(by_time, key=lambda rf: rf[1].exitcode in _OUR_SIGNALS):
        message, _ = _recorded(failure)
        if message and not _peer_lost(failure):
            return rank, failure
    for rank, failure in by_time:  # exited with its own code (sys.exit(3)), no exception recorded
        if failure.exitcode > 0 and not _peer_lost(failure):
            return rank, failure
    for rank, failure in by_time:
        if failure.exitcode < 0 and failure.exitcode not in _OUR_SIGNALS:
            return rank, failure
    return by_time[0]


def summarize_failure(
    err: Any,
    stall: watch.Stall | None = None,
    where: str = "",
    left: Sequence[Left] = (),
) -> str:
    """The failed ranks: the cause (:func:`cause`) with its exception and the end of its traceback,
    then the rest. ``stall``: what the stall watch named; ``where``: each rank's step and phase at
    its last mark; ``left``: the ranks that exited with code 0 while the others went on, said
    first."""
    failures: dict[int, Any] = getattr(err, "failures", {})
    if not failures:
        return f"ddpkit run: the job failed: {err}"
    first_rank, first = cause(failures, stall)
    lines = [_left_line(left, first_rank)] if left else []
    lines.append(
        f"ddpkit run: {len(failures)} worker(s) failed; first: "
        f"{_describe(first_rank, first, stall, first=True)}"
    )
    message, stack = _recorded(first)
    if stall is not None and first_rank in stall.ranks:
        if stall.disagreement:
            lines.append(f"  {stall.disagreement}")
        lines.append(f"  {stall.headline.removeprefix('ddpkit run: ')}")
    elif message:
        lines.append(f"  {message}")
        lines += ["  traceback (last lines):"] + [f"    {line}" for line in stack[-12:]]
    elif first.exitcode < 0:
        lines.append(
            "  no Python exception: the process was killed (out of memory? the scheduler? a "
            "signal?)"
        )
    if where:
        lines.append(f"  where each rank was: {where}")
    others = [r for r in sorted(failures) if r != first_rank]
    for rank in others:
        message, _ = _recorded(failures[rank])
        lines.append(
            f"  then {_describe(rank, failures[rank], stall)}"
            + (f": {message.splitlines()[0]}" if message else "")
        )
    return "\n".join(lines)


def preempted(failures: dict[int, Any]) -> bool:
    """True when the workers stopped because they were told to (snapshot saved): a worker exited
    with the pre-empted code, and the others with it too or by the agent's SIGTERM. A worker that
    died otherwise is a failure, and the job is restarted."""
    codes = [f.exitcode for f in failures.values()]
    return PREEMPTED_EXIT_CODE in codes and all(
        c in (PREEMPTED_EXIT_CODE, -signal.SIGTERM) for c in codes
    )


def exit_code(err: BaseException, stall: watch.Stall | None = None) -> int:
    """The code ``ddpkit run`` exits with: 75 when pre-empted, else the cause's (:func:`cause`)."""
    failures = getattr(err, "failures", {})
    if not failures:
        return 1
    if preempted(failures):
        return PREEMPTED_EXIT_CODE
    _, failure = cause(failures, stall)
    if _cut_short(failure):
        return 1  # its exception ended the job, not the signal that came as it exited
    if failure.exitcode < 0:
        return 128 - failure.exitcode  # as a shell reports death by signal
    return failure.exitcode or 1
