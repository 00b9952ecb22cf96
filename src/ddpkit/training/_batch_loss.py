"""How the Trainer turns a batch into a loss, and into validation metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ddpkit._errors import ConfigError
from ddpkit.data._loader import batch_len
from ddpkit.training._evaluation import classification_metrics, inputs_and_targets
from ddpkit.training._losses import cross_entropy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BatchLossFn = Callable[[nn.Module, Any], torch.Tensor]
MetricFn = Callable[[nn.Module, Any], Mapping[str, Any]]

CountFn = Callable[[Any], "int | torch.Tensor"]
"""``count_fn(batch)``: how many items (e.g. tokens whose label is not ignored) the batch's mean
loss is over."""


_BATCH_LOSS_FN = (
    "the loss takes (inputs, targets) batches; pass batch_loss_fn=lambda model, batch: <the "
    "batch's mean loss> to the Trainer (with metric_fn=lambda model, batch: {name: per-sample "
    "values} for validation)"
)


class BatchLoss:
    """How the Trainer turns a batch into a loss, and into validation metrics.

    ``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches (cross-entropy by
    default), or ``batch_loss_fn(model, batch)`` for any other batch. Metrics are
    ``metric_fn(model, batch)``'s; by default loss and accuracy for classification, or, with a loss
    of one's own, that loss weighted by batch size.

    ``count_fn(batch)``: how many items (a language model's tokens whose labels count) the batch's
    mean loss is over; each step then follows the mean over every item of its global batch, across
    ranks and micro-batches (:func:`~ddpkit.training._step.loss_divisor`), and so do the training
    loss records and the default validation loss.
    """

    def __init__(
        self,
        loss_fn: LossFn | None,
        batch_loss_fn: BatchLossFn | None,
        metric_fn: MetricFn | None,
        count_fn: CountFn | None = None,
    ) -> None:
        if loss_fn is not None and batch_loss_fn is not None:
            raise ConfigError(
                "pass loss_fn (for (inputs, targets) batches) or batch_loss_fn, not both"
            )
        self.loss_fn = loss_fn or cross_entropy
        self.batch_loss_fn = batch_loss_fn
        default_metrics = (
            classification_metrics if loss_fn is None and batch_loss_fn is None else None
        )
        self.metric_fn = metric_fn or default_metrics
        self.count_fn = count_fn

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.batch_loss_fn is not None:
            return self.batch_loss_fn(model, batch)
        inputs, targets = inputs_and_targets(batch, _BATCH_LOSS_FN)
        return self.loss_fn(model(inputs), targets)

    def metrics(self, model: nn.Module, batch: Any) -> Mapping[str, Any]:
        if self.metric_fn is not None:
            return self.metric_fn(model, batch)
        # A loss of one's own without a metric_fn: report the loss, weighted by batch size (exact
        # for mean losses), or by its items (tokens) with count_fn.
        loss = self(model, batch)
        n = batch_len(batch) if self.count_fn is None else int(self.count_fn(batch))
        return {"loss": (loss.detach().double() * n, n)}
