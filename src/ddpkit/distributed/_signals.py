"""Stop signals that arrive while nothing listens for them yet.

A scheduler warns a job before it ends it: SLURM's ``--signal=USR1@90`` sends SIGUSR1 90 s before
the time limit, whatever the job is doing at that moment. SIGUSR1's default action is to terminate,
so a warning that lands before ``Trainer.fit()`` has installed its handlers (while the data loads,
the model builds, or between two ``fit()`` calls) killed the process with exit code 138 and no
snapshot. :func:`hold_stop_signals`, called by ``ddpkit run``'s worker entry point and by
:func:`ddpkit.init`, replaces that default with a handler that only remembers the signal; ``fit()``
asks :func:`pending_stop_signal` when it starts and acts on it as on a signal received during
training.

SIGTERM keeps its default: a process told to terminate outside ``fit()`` terminates.

Some launchers warn by a call, not a signal: :func:`preemption_notice`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # _runtime imports this module
    from ddpkit.distributed._runtime import Group

HELD_SIGNALS = (signal.SIGUSR1,)

_pending: signal.Signals | None = None


def _remember(signum: int, frame: FrameType | None) -> None:
    global _pending
    _pending = signal.Signals(signum)


def hold_stop_signals() -> None:
    """Remember SIGUSR1 instead of dying of it, where the process still has the default action for
    it.

    A handler the program installed itself is left alone; so is a process that runs this from a
    thread other than the main one (Python installs handlers only from the main thread).
    """
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in HELD_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _remember)


def pending_stop_signal(clear: bool = False) -> signal.Signals | None:
    """The stop signal received while only :func:`hold_stop_signals`'s handler was listening, if
    any.

    ``clear=True`` forgets it once read, so that one signal stops one ``fit()``.
    """
    global _pending
    sig = _pending
    if clear:
        _pending = None
    return sig


@contextmanager
def stop_signals(on_signal: Callable[[int], None]) -> Iterator[None]:
    """Inside the block, call ``on_signal(signum)`` on SIGTERM and SIGUSR1 (a scheduler's warning
    before pre-emption) instead of their usual action; the handlers in place before are put back on
    leaving, however the block ends. A signal held by :func:`hold_stop_signals` before the block is
    passed on at once. From a thread other than the main one, signals are left alone."""
    previous: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        try:
            previous[sig] = signal.signal(sig, lambda signum, frame: on_signal(signum))
        except ValueError:  # not the main thread
            break
    try:
        # Read after the handlers are in: a signal that lands in between is then either held or
        # passed on.
        held = pending_stop_signal(clear=True)
        if held is not None:
            on_signal(int(held))
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def pass_on(signum: int) -> None:
    """Deliver ``signum`` (0: none) again, to the handlers in place now that ``fit()`` has put back
    its own.

    A stop signal that lands after the ranks' last agreement comes too late to stop training, which
    ends as planned; dropped there, it would be lost for what runs next (a search going on to its
    next candidates while its launcher waits for it to stop). Passed on, SIGTERM's default ends the
    process, and a SIGUSR1 held by :func:`hold_stop_signals` stops the next ``fit()``."""
    if signum:
        signal.raise_signal(signum)


def preemption_notice(launcher: str, group: Group = None) -> Callable[[], str | None] | None:
    """Where the launcher warns of a pre-emption by a call rather than a signal: a function that
    asks it, returning the notice in words (None while there is none). None where there is nothing
    to ask.

    Ray Train runs the training function in a thread of its own, where no signal handler runs. When
    a node of the worker group is being drained (a spot instance reclaimed, a node taken away by the
    autoscaler), Ray's watcher marks every worker, and ``ray.train.get_preemption_info()`` (Ray 2.60
    and newer) reads the mark. That call is a barrier across all of Ray's workers: every rank must
    make it, the same number of times. The Trainer asks at each agreement of its ranks, which every
    rank reaches after the same step; a Trainer on a group of :func:`~ddpkit.split_world` does not
    ask (its agreements are not the other groups'), nor does any other launcher.
    """
    if launcher != "ray" or group is not None:
        return None
    import ray.train

    ask = getattr(ray.train, "get_preemption_info", None)
    if ask is None:  # before Ray 2.60: only the snapshots already on disk survive a pre-emption
        return None

    def notice() -> str | None:
        info = ask()
        if info is None:
            return None
        nodes = ", ".join(node[:8] for node in info.preempted_node_ids)
        return f"Ray Train's pre-emption notice (node {nodes}, ranks {info.preempted_ranks})"

    return notice
