"""What ``on_step_end`` callbacks learn about the optimizer step just done, at no cost in
communication.

The loss is this rank's own: the mean over its samples in the step's micro-batches. The mean over
all ranks would need a collective in every step; the Trainer agrees on it only every
``LoggingConfig.every_steps`` steps (the ``train/loss`` record). The learning rate is the one the
step used (read before a per-step scheduler moves it), the gradient norm the global one (over all
ranks and shards, before clipping) that clipping computed, or that the strategy computed anyway
(fsdp).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from ddpkit.snapshot._state import TrainState
from ddpkit.training._loss_window import LossWindow
from ddpkit.training._step import OptimizerStep


class StopReason(str, Enum):
    """Why ``fit()`` ended (``trainer.stopped_by``); a callback may stop training with a reason of
    its own."""

    EPOCHS = "epochs"
    MAX_STEPS = "max_steps"
    EARLY_STOPPING = "early_stopping"
    SIGNAL = "signal"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StepOutput:
    """One optimizer step, as ``on_step_end(trainer, taken, output)`` gets it (on every rank)."""

    taken: bool
    """False for a step skipped (non-finite gradients, or an fp16 overflow)."""
    step: int
    """Optimizer steps taken so far, this one included if taken."""
    epoch: int
    """Epochs completed before this step."""
    lr: float
    """The first param group's learning rate during this step."""
    grad_norm: float | None
    """The global gradient norm before clipping, where it was computed (``clip_grad_norm``, or
    fsdp); else None."""
    samples: float | torch.Tensor
    """This rank's samples in the step (with a ``count_fn``, its counted items: a tensor on an
    accelerator, not yet read)."""
    losses: Sequence[torch.Tensor | float]
    """This rank's micro-batch losses (each a mean over its samples); tensors on an accelerator, not
    yet read."""
    sizes: Sequence[float | torch.Tensor]
    """Their samples (or counted items)."""

    @property
    def loss(self) -> float:
        """This rank's mean loss over its samples in the step (read from the device when asked for:
        a host sync on an accelerator, nothing on the CPU). Not the mean over ranks."""
        samples = float(self.samples)
        if not samples:
            return float("nan")
        return (
            math.fsum(float(loss) * float(size) for loss, size in zip(self.losses, self.sizes))
            / samples
        )


def step_output(
    taken: bool, state: TrainState, optimizer_step: OptimizerStep, window: LossWindow
) -> StepOutput:
    """The step just done, from the pieces of the Trainer that know it (read after the window ended
    the step)."""
    losses, sizes = window.last_step
    norm = optimizer_step.step_norm
    return StepOutput(
        taken=taken,
        step=state.step,
        epoch=state.epoch,
        lr=float(optimizer_step.lr),
        grad_norm=float(norm) if taken and norm is not None else None,
        # no read of a count left on the device: a callback reads it if it asks
        samples=sum(sizes, 0.0),
        losses=losses,
        sizes=sizes,
    )
