"""Stop signals: SIGUSR1 (a scheduler's warning) held until ``Trainer.fit()`` listens, the handlers
``fit()`` installs, and a launcher's warning by a call (:func:`preemption_notice`)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist

_pending: signal.Signals | None = None


def _remember(signum: int, frame: FrameType | None) -> None:
    global _pending
    _pending = signal.Signals(signum)


def hold_stop_signals() -> None:
    """Remember SIGUSR1 instead of dying of it, where it has its default action (main thread)."""
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:
            signal.signal(signal.SIGUSR1, _remember)


def pending_stop_signal(clear: bool = False) -> signal.Signals | None:
    """The stop signal held by :func:`hold_stop_signals`, if any; ``clear=True`` forgets it."""
    global _pending
    sig = _pending
    if clear:
        _pending = None
    return sig


@contextmanager
def stop_signals(on_signal: Callable[[int], None]) -> Iterator[None]:
    """Inside the block (main thread only), call ``on_signal(signum)`` on SIGTERM and SIGUSR1, and
    at once for a signal :func:`hold_stop_signals` held; the handlers before are put back after."""
    previous: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        try:
            previous[sig] = signal.signal(sig, lambda signum, frame: on_signal(signum))
        except ValueError:  # not the main thread
            break
    try:
        # read after the handlers are in: a signal landing in between is held or passed on
        held = pending_stop_signal(clear=True)
        if held is not None:
            on_signal(int(held))
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def pass_on(signum: int) -> None:
    """Deliver ``signum`` (0: none) again to the handlers ``fit()`` put back: a stop signal too late
    to stop training is not lost for what runs next."""
    if signum:
        signal.raise_signal(signum)


def preemption_notice(
    launcher: str, group: dist.ProcessGroup | None = None
) -> Callable[[], str | None] | None:
    """Where the launcher warns of a pre-emption by a call (Ray Train 2.60 and newer): a function
    that asks it, returning the notice in words or None; None where there is nothing to ask. The
    call is a barrier across Ray's workers, so a group of :func:`~ddpkit.split_world` never asks."""
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
