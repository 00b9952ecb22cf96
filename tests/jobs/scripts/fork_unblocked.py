"""Preloaded by a fork server in a test's control: the server's ``pthread_sigmask`` blocks nothing,
so it forks its workers with the job's signals ignored only (as it did before it blocked them around
a fork)."""

import signal

_set_mask = signal.pthread_sigmask


def _blocks_nothing(how: int, signals: object) -> set:
    return _set_mask(how, []) if how == signal.SIG_BLOCK else _set_mask(how, signals)


signal.pthread_sigmask = _blocks_nothing
