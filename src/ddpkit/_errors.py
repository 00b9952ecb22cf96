"""Errors that tell a user what to change, and the exit code of a pre-empted run."""

from __future__ import annotations

import signal
from typing import Any

PREEMPTED_EXIT_CODE = 75
"""Exit code of a run stopped by SIGTERM/SIGUSR1 after saving its snapshot: ``EX_TEMPFAIL`` of
``sysexits.h`` ("try again later"). A batch script tells "pre-empted, requeue me" (75) from
"finished" (0) and "failed" (other) by it; ``ddpkit run`` passes it through without counting it as a
failure to restart."""


class ConfigError(ValueError):
    """A launch, environment or option value that cannot work; the message names what to change."""


def check_fields(config: Any, checks: dict[str, bool]) -> None:
    """Raise a ``ConfigError`` naming the first of ``config``'s fields whose check is false."""
    for name, ok in checks.items():
        if not ok:
            raise ConfigError(
                f"{name}={getattr(config, name)!r} is not valid: see {type(config).__name__}.{name}"
            )


class Preempted(SystemExit):
    """Raised by ``Trainer.fit()`` when a stop signal ended training early, once the snapshot is on
    disk.

    A ``SystemExit``: uncaught, the process exits with :data:`~ddpkit._errors.PREEMPTED_EXIT_CODE`
    and no traceback, so a script that ignores it cannot go on to evaluate and exit 0 as if training
    were complete. A script that wants to do something first catches it and re-raises.
    """

    def __init__(self, step: int, signal_name: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.step, self.signal_name = step, signal_name

    @classmethod
    def by(cls, signum: int, step: int) -> Preempted:
        """Stopped by signal ``signum`` (0: one that reached another rank) after optimizer step
        ``step``."""
        return cls(step, signal.Signals(signum).name if signum else "a signal to another rank")

    def __str__(self) -> str:
        return (
            f"stopped by {self.signal_name} after optimizer step {self.step}; the snapshot is saved"
        )
