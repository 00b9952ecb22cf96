"""How the Trainer turns a batch into a loss, and into validation metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit.errors import ConfigError
from ddpkit.training.evaluation import classification_metrics
from ddpkit.training.losses import cross_entropy
from ddpkit.training.steps import batch_len

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BatchLossFn = Callable[[nn.Module, Any], torch.Tensor]
MetricFn = Callable[[nn.Module, Any], Mapping[str, Any]]


class BatchLoss:
    """How the Trainer turns a batch into a loss, and into validation metrics.

    ``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches (cross-entropy by default), or
    ``batch_loss_fn(model, batch)`` for any other batch. Metrics are ``metric_fn(model, batch)``'s; by default
    loss and accuracy for classification, or, with a loss of one's own, that loss weighted by batch size.
    """

    def __init__(self, loss_fn: LossFn | None, batch_loss_fn: BatchLossFn | None, metric_fn: MetricFn | None) -> None:
        if loss_fn is not None and batch_loss_fn is not None:
            raise ConfigError("pass loss_fn (for (inputs, targets) batches) or batch_loss_fn, not both")
        self.loss_fn = loss_fn or cross_entropy
        self.batch_loss_fn = batch_loss_fn
        default_metrics = classification_metrics if loss_fn is None and batch_loss_fn is None else None
        self.metric_fn = metric_fn or default_metrics

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.batch_loss_fn is not None:
            return self.batch_loss_fn(model, batch)
        inputs, targets = batch
        return self.loss_fn(model(inputs), targets)

    def metrics(self, model: nn.Module, batch: Any) -> Mapping[str, Any]:
        if self.metric_fn is not None:
            return self.metric_fn(model, batch)
        # A loss of one's own without a metric_fn: report the loss, weighted by batch size (exact for mean losses).
        loss = self(model, batch)
        n = batch_len(batch)
        return {"loss": (loss.detach().double() * n, n)}
