"""After a validation: early stopping and the best weights, one metric and one comparison, decided alike everywhere.

The metrics are agreed over ranks (:func:`~ddpkit.evaluate` is exact), so every rank takes the same decisions; only
rank 0 writes the best weights, but every rank joins gathering them (a collective under ``fsdp``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddpkit.distributed.collectives import broadcast_object
from ddpkit.snapshot.best import BestWeights
from ddpkit.training.early_stopping import EarlyStopping


class Validation:
    """Takes each validation's metrics to early stopping and the best weights; says when training must stop."""

    def __init__(
        self,
        early_stopping: EarlyStopping,
        best_weights: BestWeights,
        model_weights: Callable[[], Mapping[str, torch.Tensor]],
        log: Callable[[str, int, dict[str, Any]], None],
    ) -> None:
        self.early_stopping, self.best_weights = early_stopping, best_weights
        self.model_weights, self.log = model_weights, log

    def resume(self, group: Any) -> None:
        """Read the best so far: the file is on rank 0's disk, and every rank must know it to decide alike."""
        best = self.best_weights
        best.load()
        best.value, best.epoch = broadcast_object((best.value, best.epoch), group=group)

    def update(self, metrics: Mapping[str, Any], epoch: int, step: int) -> bool:
        """Count the metrics towards early stopping, keep the weights if best; True when training must stop."""
        self.early_stopping.update(metrics)
        best = self.best_weights
        if best.update(metrics, self.model_weights, epoch, step) and best.metric is not None:
            self.log("event", step, {"event": "best", "file": best.path.name, best.metric: best.value})
        return self.early_stopping.should_stop
