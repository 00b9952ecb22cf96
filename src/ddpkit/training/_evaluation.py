"""How a batch becomes a loss and metrics (:class:`BatchLoss`, the default cross-entropy), and
exact distributed evaluation: every sample counted once, metrics reduced as sums and counts.

Ranks hold shares that differ by up to one sample (see :mod:`ddpkit.data`), so they run different
numbers of batches. Nothing collective may happen per batch: evaluation calls the unwrapped module
(a DDP forward can broadcast buffers, a collective a rank with fewer batches would never join) and
reduces once at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import nullcontext
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

from ddpkit._errors import ConfigError, checked_arguments
from ddpkit.data import build_eval_loader, to_device
from ddpkit.data._loader import batch_len
from ddpkit.distributed import Group
from ddpkit.distributed import _progress as marks
from ddpkit.distributed._collectives import MetricSums
from ddpkit.distributed._progress import Phase
from ddpkit.distributed._runtime import get_runtime
from ddpkit.strategies._prepare import rank_zeros, unwrap

MetricFn = Callable[[nn.Module, Any], Mapping[str, Any]]
"""``metric_fn(model, batch)`` returns named per-sample values (shape ``[batch]``), or
``(sum, count)`` pairs; the means over all samples are reported."""


_METRIC_FN = (
    "pass metric_fn=lambda model, batch: {name: per-sample values}, which reads the batch as it is"
)


def inputs_and_targets(batch: Any, remedy: str) -> tuple[Any, Any]:
    """``batch`` as ``(inputs, targets)``, each a tensor or a sequence of them (the inputs may be a
    dict, which goes to the model whole); else a ConfigError that says what the batch is and ends
    with ``remedy``."""
    pair = isinstance(batch, (list, tuple)) and len(batch) == 2
    if (
        pair
        and isinstance(batch[0], (torch.Tensor, list, tuple, Mapping))
        and isinstance(batch[1], (torch.Tensor, list, tuple))
    ):
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        what = f"a dict with keys {list(batch)}"
    elif isinstance(batch, (list, tuple)):
        what = (
            f"a {type(batch).__name__} of {len(batch)} "
            f"({', '.join(type(part).__name__ for part in batch)})"
        )
    else:
        what = f"a {type(batch).__name__}"
    raise ConfigError(f"the batch is {what}, not an (inputs, targets) pair of tensors: {remedy}")


def classification_metrics(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """Per-sample cross-entropy ``loss`` and ``accuracy`` for an ``(input, class index)`` batch.

    Refuses a model with one output column or float targets (a regression model): both would report
    numbers that mean nothing (a loss of 0, an accuracy of 0); use :func:`regression_metrics`
    there."""
    inputs, targets = inputs_and_targets(batch, _METRIC_FN)
    logits = model(inputs)
    check_classification(
        logits, targets, "classification_metrics (evaluate's default metric_fn)", indices_only=True
    )
    return {
        "loss": F.cross_entropy(logits, targets, reduction="none"),
        "accuracy": (logits.argmax(dim=1) == targets).float(),
    }


def regression_metrics(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """Per-sample mean squared error ``loss`` (averaged over output features) for an
    ``(input, target)`` batch."""
    inputs, targets = inputs_and_targets(batch, _METRIC_FN)
    err = (model(inputs) - targets).pow(2)
    return {"loss": err.reshape(err.shape[0], -1).mean(dim=1)}


@torch.no_grad()
@checked_arguments
def evaluate(
    model: nn.Module,
    data: Dataset | Iterable[Any],
    metric_fn: MetricFn = classification_metrics,
    *,
    batch_size: int = 256,
    group: Group = None,
    autocast: Callable[[], Any] | None = None,
) -> dict[str, float]:
    """Means of ``metric_fn``'s per-sample values over every sample of ``data``, on every rank.

    ``data`` is a dataset (sharded here with no padding) or a loader that is already sharded without
    padding, such as one from :func:`~ddpkit.build_eval_loader`. Every rank of ``group`` must call
    this.
    """
    # Anything else is taken for a map-style dataset; build_eval_loader refuses one that is not.
    loader = (
        data
        if isinstance(data, (DataLoader, list))
        else build_eval_loader(cast(Dataset, data), batch_size, group=group)
    )
    module = unwrap(model)
    if isinstance(module, nn.ModuleDict):  # several models by name (a step_fn Trainer's)
        module = nn.ModuleDict({name: unwrap(m) for name, m in module.items()})
    _sync_buffers(model)
    device = get_runtime().device
    # a frozen BatchNorm stays in eval mode afterwards
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    sums = MetricSums()
    # Marked at every batch for the launcher's stall watch: a rank slower through its shard than
    # the others (an unpadded shard, slower data) makes progress, and is not taken for stalled
    # while they wait for it in the metrics' all-reduce.
    try:
        with marks.phase(Phase.EVALUATION):
            for batch in loader:
                marks.mark(Phase.EVALUATION)
                batch = to_device(batch, device)
                with autocast() if autocast is not None else nullcontext():
                    values = metric_fn(module, batch)
                for name, value in values.items():
                    if isinstance(value, tuple):
                        sums.update(name, value[0], count=int(value[1]))
                    else:
                        sums.update(name, value)
    finally:
        for m, training in modes:
            m.training = training
    return sums.compute(group)


def _sync_buffers(model: nn.Module) -> None:
    """Rank 0's buffers (BatchNorm's running statistics) in every DDP of ``model``, as DDP's next
    forward gives them: evaluation calls the unwrapped module, which holds each rank's own."""
    for ddp in model.modules():
        if isinstance(ddp, DDP) and ddp.broadcast_buffers:
            rank_zeros(ddp.module.buffers(), ddp.process_group)


# -- The default loss: cross-entropy that refuses outputs it does not fit (a regression's one
# column trains nothing at loss 0); shapes and dtypes only, so no wait for the device.

_REGRESSION = (
    "pass loss_fn=torch.nn.functional.mse_loss and metric_fn=ddpkit.regression_metrics "
    "(or your own)"
)


def check_classification(
    outputs: Any,
    targets: Any,
    where: str = "the default loss (cross-entropy)",
    indices_only: bool = False,
) -> None:
    """Raise :class:`ConfigError` unless ``outputs`` are class scores and ``targets`` class indices
    (or, unless ``indices_only``, class probabilities of the same shape)."""
    fix = "pass metric_fn=ddpkit.regression_metrics (or your own)" if indices_only else _REGRESSION
    if isinstance(outputs, Mapping):
        raise ConfigError(
            f"{where} needs a tensor of class scores, and the model returned a dict "
            f"({', '.join(map(str, outputs))}): pass batch_loss_fn=lambda model, batch: ... that "
            "computes the loss from the model's outputs, and metric_fn for validation"
        )
    if not isinstance(outputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise ConfigError(
            f"{where} needs (inputs, targets) batches and a model that returns a tensor, got "
            f"outputs of type {type(outputs).__name__} and targets of type "
            f"{type(targets).__name__}: pass batch_loss_fn"
        )
    if outputs.dim() < 2 or outputs.shape[1] < 2:
        raise ConfigError(
            f"{where} needs one score per class in dimension 1, and the model returns shape "
            f"{tuple(outputs.shape)}: with one column the loss is 0 whatever the weights. For "
            "regression, " + fix
        )
    if targets.is_floating_point() and (indices_only or targets.shape != outputs.shape):
        wanted = "integer class indices" + (
            "" if indices_only else " (or class probabilities shaped like the outputs)"
        )
        raise ConfigError(
            f"{where} needs {wanted}, and the targets are "
            f"{str(targets.dtype).removeprefix('torch.')} of shape {tuple(targets.shape)} for "
            f"outputs of shape {tuple(outputs.shape)}. For regression, " + fix
        )


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(outputs, targets)`` after :func:`check_classification`."""
    check_classification(outputs, targets)
    return F.cross_entropy(outputs, targets)


# -- How the Trainer turns a batch into a loss, and into validation metrics.

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BatchLossFn = Callable[[nn.Module, Any], torch.Tensor]

CountFn = Callable[[Any], "int | torch.Tensor"]
"""``count_fn(batch)``: how many items (e.g. tokens whose label is not ignored) the batch's mean
loss is over."""


_BATCH_LOSS_FN = (
    "the loss takes (inputs, targets) batches; pass batch_loss_fn=lambda model, batch: <the "
    "batch's mean loss> to the Trainer (with metric_fn=lambda model, batch: {name: per-sample "
    "values} for validation)"
)


class BatchLoss:
    """How the Trainer turns a batch into a loss, and into validation metrics:
    ``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches (cross-entropy by
    default), or ``batch_loss_fn(model, batch)``. Metrics are ``metric_fn(model, batch)``'s; by
    default loss and accuracy for classification, or the loss of one's own weighted by batch size
    (by its items under ``count_fn``: docs/language-models.md)."""

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
