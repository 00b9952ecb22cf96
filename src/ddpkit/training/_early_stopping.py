"""Early stopping: training ends once a validation metric has not improved for ``patience`` epochs
(or validations, with ``TrainerConfig.val_every_steps``).

It shares its metric, its direction and its comparison (:func:`~ddpkit.snapshot._export.is_better`)
with the best weights the run keeps (:class:`~ddpkit.snapshot._export.BestWeights`): the epoch that
resets the patience is the epoch whose weights ``best.pt`` holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddpkit._errors import ConfigError
from ddpkit.snapshot._export import is_better
from ddpkit.training._config import EarlyStoppingConfig


class EarlyStopping:
    """Counts validations without improvement of ``config.metric`` (one per epoch, unless
    ``val_every_steps``); its state is part of every snapshot."""

    def __init__(self, config: EarlyStoppingConfig) -> None:
        self.config = config
        self.best: float | None = None
        """The best value of the metric so far."""
        self.bad_epochs = 0
        """Validations (epochs, by default) since it last improved; the name is kept for snapshots'
        sake."""

    @property
    def should_stop(self) -> bool:
        patience = self.config.patience
        return (
            self.config.metric is not None and patience is not None and self.bad_epochs >= patience
        )

    def update(self, metrics: Mapping[str, Any]) -> None:
        """Take an epoch's metrics (the same on every rank, so every rank decides alike)."""
        metric = self.config.metric
        if metric is None:
            return
        if metric not in metrics:
            raise ConfigError(
                f"early_stopping.metric={metric!r} is not among the epoch's metrics "
                f"{sorted(metrics)}: give the Trainer val_data, or name one of these"
            )
        value = float(metrics[metric])
        if is_better(value, self.best, self.config.mode):
            self.best, self.bad_epochs = value, 0
        else:
            self.bad_epochs += 1

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_epochs = state["best"], int(state["bad_epochs"])
