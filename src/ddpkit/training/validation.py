"""When the Trainer validates, and what a validation decides: early stopping and the best weights.

By default the Trainer validates at the end of each epoch. With ``TrainerConfig.val_every_steps = N`` it
validates after every N-th optimizer step instead (counted over the whole run, not within an epoch), and
early stopping counts validations, not epochs: ``patience`` validations without improvement end the run, and
the best weights record the step they were taken at.

Exact on resume: a validation is due at a step count, which a snapshot restores, and it runs before any snapshot
of that step is written, so the early-stopping state a snapshot holds already counts the validation of its own
step. A run killed and resumed validates at the same steps as an uninterrupted one, gets the same values (the
weights at those steps are the same, bit for bit) and so picks the same best step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddpkit.snapshot.best import BestWeights
from ddpkit.training.early_stopping import EarlyStopping

Log = Callable[[str, int, dict[str, Any]], None]


class Validation:
    """Decides when to validate, and records what each validation decides.

    Every rank calls every method after the same steps with the same (agreed) metrics, so every rank decides
    alike; ``weights`` may be a collective (sharded weights gathered on rank 0).
    """

    def __init__(
        self,
        every_steps: int | None,
        early_stopping: EarlyStopping,
        best_weights: BestWeights,
        weights: Callable[[], Mapping[str, torch.Tensor]],
        log: Log,
    ) -> None:
        self.every_steps = every_steps
        self.early_stopping, self.best_weights = early_stopping, best_weights
        self.weights, self.log = weights, log

    @property
    def at_epoch_end(self) -> bool:
        """Validate at epoch ends (the default) rather than every ``every_steps`` optimizer steps."""
        return self.every_steps is None

    def due(self, step: int, taken: bool) -> bool:
        """True after an optimizer step that a step-wise validation follows. A skipped step leaves the step count
        where it was: the validation of that count was done after the step that reached it."""
        return self.every_steps is not None and taken and step % self.every_steps == 0

    def judge(self, metrics: Mapping[str, Any], epoch: int, step: int) -> bool:
        """Take a validation's metrics: update early stopping and the best weights; True if training must stop."""
        self.early_stopping.update(metrics)
        best = self.best_weights
        if best.update(metrics, self.weights, epoch, step) and best.metric is not None:
            event: dict[str, Any] = {"event": "best", "file": best.path.name, best.metric: best.value}
            if best.export_path is not None:
                event["weights"] = best.export_path.name
            self.log("event", step, event)
        return self.early_stopping.should_stop

    def after_step(self, evaluate: Callable[[], dict[str, float]], epoch: int, step: int) -> bool:
        """Validate now (the step is due): record the metrics as a ``val`` record at ``step`` and judge them; True
        if training must stop."""
        metrics = evaluate()
        self.log("val", step, {"epoch": epoch, **metrics})
        return self.judge(metrics, epoch, step)
