"""Callbacks: what the Trainer does not do, added without subclassing it.

A callback is any object with some of the methods of :class:`Callback`; the Trainer calls those it
has, on every rank, in the order given. They run between collectives the Trainer makes on every
rank, so a callback may make collectives of its own as long as it makes the same ones on every rank
of the Trainer's group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ddpkit._errors import ConfigError
from ddpkit.training._step import StepOutput

# The hooks' ``trainer`` is a :class:`~ddpkit.Trainer`; it is not imported here (the Trainer imports
# this module).
Trainer = Any


class Callback:
    """The hooks the Trainer calls. Subclass and override the ones you need (all do nothing
    here)."""

    def on_fit_start(self, trainer: Trainer) -> None:
        """After a resume (or a fresh start), before the first step."""

    def on_step_end(self, trainer: Trainer, taken: bool, output: StepOutput) -> None:
        """After each optimizer step; ``taken`` is False for a step skipped for non-finite
        gradients. ``output`` (:class:`~ddpkit.training._step.StepOutput`): this rank's loss,
        the lr and the gradient norm of the step. The model's gradients are still the step's
        (synchronised; unscaled and clipped where the step did so); the next step sets them to None
        before its first forward, so a callback may backpropagate through the model (a GAN's
        generator step through its discriminator) without changing the next step."""

    def on_validation_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After each validation, once it is recorded and counted (early stopping, the best
        weights): at an epoch's end (before ``on_epoch_end``), every
        ``TrainerConfig.val_every_steps`` steps (before that step's snapshot), or where
        ``max_steps`` stopped the run inside an epoch. ``metrics``: the ``val/...`` metrics, with
        ``epoch`` (epochs completed) and ``step``."""

    def on_epoch_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After an epoch's validation and records, before its snapshots (which hold what the
        callback changed). Setting ``trainer.stopped_by`` (a string) ends training after this
        epoch; raising ends it at once, on every rank that raises."""

    def on_fit_end(self, trainer: Trainer) -> None:
        """When training ends without an error: epochs done, max_steps, early stopping, or a stop
        signal (then just before ``fit()`` raises :class:`~ddpkit.Preempted`)."""


def call_step_end(callbacks: Sequence[Any], trainer: Trainer, output: StepOutput) -> None:
    """Call each callback's ``on_step_end(trainer, taken, output)``."""
    for cb in callbacks:
        method = getattr(cb, "on_step_end", None)
        if method is not None:
            method(trainer, output.taken, output)


def call(callbacks: Sequence[Any], hook: str, *args: Any) -> None:
    """Call ``hook`` on each callback that has it, in order."""
    for cb in callbacks:
        method = getattr(cb, hook, None)
        if method is not None:
            method(*args)


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def own_parts(
    window: Any, callbacks: Sequence[Any], extra_state: Mapping[str, Any] | None
) -> dict[str, Any]:
    """What each rank keeps its own of in a snapshot: its unagreed losses (``window``), the
    callbacks that have a ``state_dict``/``load_state_dict`` (under their ``state_key`` attribute,
    or their class name), and the script's ``extra_state``. Each rank saves and gets back its own: a
    best-so-far value or a hidden state may differ between ranks."""
    parts: dict[str, Any] = {"loss_window": window}
    for cb in callbacks:
        if _stateful(cb):
            key = f"callback:{getattr(cb, 'state_key', None) or type(cb).__qualname__}"
            if key in parts:
                raise ConfigError(
                    f"two callbacks keep their state under {key!r}: give each a distinct "
                    "`state_key` attribute"
                )
            parts[key] = cb
    for name, obj in (extra_state or {}).items():
        if not _stateful(obj):
            raise ConfigError(
                f"extra_state[{name!r}] is a {type(obj).__name__}, which has no state_dict() and "
                "load_state_dict(): give an object with both (e.g. a small class around the value)"
            )
        parts[f"extra:{name}"] = obj
    return parts
