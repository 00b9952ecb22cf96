"""The default loss, cross-entropy, made to refuse what it does not fit instead of training nothing.

``F.cross_entropy`` accepts a regression model's outputs and targets without complaint: with one
output column the softmax is 1 and the loss is 0 whatever the weights, so a run "trains" with loss 0
and exits 0. Every check here reads shapes and dtypes only: no value, so no wait for the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ddpkit._errors import ConfigError

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
