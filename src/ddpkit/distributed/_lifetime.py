"""One run of a script in its process, as ddpkit sees it: what the run holds through ddpkit that
would outlive its objects (signal handlers, folder locks, a store's files and threads), let go of
before the script runs again in the same process (``ddpkit run --recover in-place``:
:func:`release_all`); and what a launcher adds to the records of a resume (:func:`resumed`).

A holder registers how it lets go (:func:`hold`) and unregisters when it let go itself. The launcher
that reruns a script is the only caller of :func:`release_all`, and registers the listeners of
:func:`resumed`: the library never imports it.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_held: dict[int, tuple[str, Callable[[], Callable[[], None] | None]]] = {}
_count = 0


def hold(what: str, release: Callable[[], None]) -> Callable[[], None]:
    """Have :func:`release_all` call ``release`` (``what``: the holder, as a line names it); return
    the function that unregisters it, for the holder that lets go itself. A bound method is held
    weakly: a holder that is gone has nothing left to let go."""
    global _count
    _count += 1
    key = _count
    if hasattr(release, "__self__") and hasattr(release, "__func__"):
        method = weakref.WeakMethod(release)
        _held[key] = (what, method)
    else:
        _held[key] = (what, lambda: release)

    def let_go() -> None:
        _held.pop(key, None)

    return let_go


def release_all() -> list[str]:
    """Let go of everything held, newest first; what could not be let go, a line each."""
    failed = []
    while _held:
        key = max(_held)
        what, get = _held.pop(key)
        release = get()
        if release is None:
            continue
        try:
            release()
        except Exception as err:  # noqa: BLE001  (the others are let go all the same)
            failed.append(f"{what}: {type(err).__name__}: {err}")
    return failed


@dataclass(frozen=True)
class Resume:
    """A resume, as the records' listeners see it: the step it goes on from, where its state came
    from (``"none"``: nowhere, it starts afresh), and when its load began and ended
    (``time.time()``)."""

    step: int
    source: str
    started: float
    restored: float


_listeners: list[Callable[[Resume], dict[str, Any] | None]] = []


def on_resume(listener: Callable[[Resume], dict[str, Any] | None]) -> None:
    """Have every resume (a Trainer's, a hand loop's :class:`~ddpkit.Snapshots`) record the event
    ``listener`` returns for it (None: none)."""
    if listener not in _listeners:
        _listeners.append(listener)


def resumed(resume: Resume) -> list[dict[str, Any]]:
    """The events the listeners record for ``resume``."""
    events = []
    for listener in _listeners:
        with contextlib.suppress(Exception):  # a record lost is not worth a failed resume
            if (event := listener(resume)) is not None:
                events.append(event)
    return events
