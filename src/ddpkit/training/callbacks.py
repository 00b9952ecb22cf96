"""Callbacks: what the Trainer does not do, added without subclassing it.

A callback is any object with some of the methods of :class:`Callback`; the Trainer calls those it has, on
every rank, in the order given. They run between collectives the Trainer makes on every rank, so a callback
may make collectives of its own as long as it makes the same ones on every rank of the Trainer's group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# The hooks' ``trainer`` is a :class:`~ddpkit.Trainer`; it is not imported here (the Trainer imports this module).
Trainer = Any


class Callback:
    """The hooks the Trainer calls. Subclass and override the ones you need (all do nothing here)."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """After a resume (or a fresh start), before the first step."""

    def on_step_end(self, trainer: Trainer, taken: bool) -> None:
        """After each optimizer step; ``taken`` is False for a step skipped for non-finite gradients."""

    def on_epoch_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After an epoch's validation, records and snapshot. Setting ``trainer.stopped_by`` (a string) ends
        training after this epoch; raising ends it at once, on every rank that raises."""

    def on_fit_end(self, trainer: Trainer) -> None:
        """When training ends without an error: epochs done, max_steps, early stopping, or a stop signal (then
        just before ``fit()`` raises :class:`~ddpkit.Preempted`)."""


def call(callbacks: Sequence[Any], hook: str, *args: Any) -> None:
    """Call ``hook`` on each callback that has it, in order."""
    for cb in callbacks:
        method = getattr(cb, hook, None)
        if method is not None:
            method(*args)
