"""When the Trainer snapshots: every decision "is a snapshot due now?" in one place.

Three kinds of moments ask: after an optimizer step (``SnapshotConfig.every_steps``, and the copies
in memory every ``memory_every_steps``), at an epoch's end (``every_epochs``), and when training
stops. A step's snapshot that falls on an epoch's last step is taken at the epoch's end instead
(after its validation and the scheduler's step, so that it holds them), whether or not that epoch's
end is due on its own: an epoch end that is not due never swallows a step that is. The same position
(epoch, step, cursor) is never written twice.

A launcher's notice of a coming pre-emption (:func:`ddpkit.distributed._signals.preemption_notice`)
makes the next snapshot due at once: after the step it came at, or at that epoch's end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddpkit._errors import check_fields, check_types

_ALWAYS_SAVED = ("max_steps", "signal", "early_stopping")
"""Stops (``ddpkit.training.StopReason``, a ``str`` enum) that snapshot whatever the intervals: a
restart (or a rerun) must find where they stopped."""


@dataclass(kw_only=True)
class SnapshotConfig:
    """When the Trainer snapshots, how many it keeps, and how it writes them."""

    every_steps: int | None = None
    """Also snapshot every this many optimizer steps (None: at epoch ends only)."""
    every_epochs: int = 1
    """Snapshot every this many epochs; 0 turns epoch-end snapshots off."""
    keep: int = 2
    """Whole snapshots kept in ``run_dir/snapshots``; older ones are removed once a newer one is
    whole."""
    async_write: bool = True
    """Write in a background thread: the step waits only while the state is copied to host
    memory."""
    memory: bool = False
    """Also copy the state into shared memory on the node after steps (under ``ddpkit run``, which
    keeps a folder there for the job): a restarted worker resumes from it when it is newer than the
    newest disk snapshot, so a failure loses at most ``memory_every_steps`` steps. See
    :mod:`ddpkit.snapshot._memory.snapshots`."""
    memory_every_steps: int | None = None
    """Copy to memory every this many optimizer steps; None: every step, unless the first copies
    hold the loop longer than 5% of a step, then the smallest interval that keeps them within."""

    def __post_init__(self) -> None:
        check_types(self)
        check_fields(
            self,
            {
                "every_steps": self.every_steps is None or self.every_steps >= 1,
                "every_epochs": self.every_epochs >= 0,
                "keep": self.keep >= 1,
                "memory_every_steps": self.memory_every_steps is None
                or self.memory_every_steps >= 1,
            },
        )


@dataclass
class SnapshotSchedule:
    """Says when a snapshot (on disk, or in memory) is due; every rank asks with the same values and
    gets the same answer, so every rank saves after the same steps."""

    every_steps: int | None = None
    every_epochs: int = 1
    memory_every_steps: int = 1
    """The interval of the copies in memory, once chosen
    (:mod:`ddpkit.snapshot._memory.snapshots`)."""
    notice: str | None = None
    """A pre-emption notice not yet acted on: the next :meth:`after_step` or :meth:`at_epoch_end` is
    due."""
    _saved_at: tuple[int, int, int] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, config: SnapshotConfig) -> SnapshotSchedule:
        return cls(config.every_steps, config.every_epochs, config.memory_every_steps or 1)

    def _step_due(self, step: int) -> bool:
        return self.every_steps is not None and step % self.every_steps == 0

    def after_step(self, step: int, taken: bool, last_in_epoch: bool) -> bool:
        """A disk snapshot right after optimizer step ``step`` (the count once it is taken) inside
        an epoch. At the epoch's last step: no, :meth:`at_epoch_end` decides, counting this step."""
        return taken and not last_in_epoch and (self._step_due(step) or self.notice is not None)

    def at_epoch_end(
        self, epochs_done: int, step: int, last_step_taken: bool, stopping: bool
    ) -> bool:
        """A disk snapshot at the end of epoch number ``epochs_done`` (counted from 1), whose last
        step made the count ``step``: due by the epochs' interval, by the steps' (the epoch's last
        step), or a stop."""
        by_epochs = self.every_epochs > 0 and epochs_done % self.every_epochs == 0
        return (
            by_epochs
            or (last_step_taken and self._step_due(step))
            or stopping
            or self.notice is not None
        )

    def at_stop(self, reason: str | None) -> bool:
        """A disk snapshot where training ends: always after ``max_steps``, a stop signal or early
        stopping; after the last epoch or a callback's stop, when snapshots are on at all (either
        interval)."""
        if reason in _ALWAYS_SAVED:
            return True
        return self.every_steps is not None or self.every_epochs > 0

    def in_memory(self, step: int, taken: bool) -> bool:
        """A copy in memory after optimizer step ``step``."""
        return taken and step % self.memory_every_steps == 0

    def new_position(self, position: tuple[int, int, int]) -> bool:
        """Whether ``position`` has not been written yet (a save there is then due); false after
        :meth:`written` of the same position, so that an epoch end and a stop at the same step write
        once."""
        return position != self._saved_at

    def written(self, position: tuple[int, int, int]) -> None:
        """``position`` is on disk (saved, or the snapshot a run resumed from)."""
        self._saved_at, self.notice = position, None
