"""A step that follows the mean over items (a language model's tokens), not over samples.

A language model's loss is a mean over the tokens whose labels count, and micro-batches hold different numbers
of them (padding, ``ignore_index``). Weighing each micro-batch's mean by its samples, as the Trainer does by
default, makes a token of a short micro-batch weigh more than one of a long micro-batch; accumulation or more
ranks then change the model. With ``count_fn(batch)``, the number of items a micro-batch's mean loss is over,
the step's gradient is that of the mean over every item of the step's global batch:

    DDP averages the ranks' gradients and the micro-batches' gradients add up, so the step's gradient is
    ``sum_i grad(mean_i) / d_i / world``. With ``d_i = total / (count_i * world)`` that is
    ``sum_i count_i * grad(mean_i) / total``: every item alike, whichever rank and micro-batch holds it.

``total``, the items of the whole step, needs the counts of every micro-batch on every rank before the first
backward. The counts come from the batches alone (labels, masks), so the step's micro-batches are read first
(they are already in memory or prefetched), counted, and ONE all-reduce of one number per step gives the total.
Scaling the gradients after the backward passes needs the same all-reduce plus a pass over every gradient, and
would have to come before the strategy's finiteness check and clipping; scaling the losses needs neither. The
counts stay tensors (no host sync on an accelerator) and the all-reduce is issued asynchronously, so it overlaps
the first forward.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed.collectives import comm_device, is_live
from ddpkit.training.steps import MicroBatch, Step

CountFn = Callable[[Any], "int | torch.Tensor"]
"""``count_fn(batch)``: how many items (e.g. tokens whose label is not ignored) the batch's mean loss is over."""


def item_divisor(count: torch.Tensor, world_size: int, total: torch.Tensor) -> torch.Tensor:
    """What a rank divides its micro-batch's mean loss by so that the step follows the mean over ``total``
    items (see the module's docstring); float64, as ``count`` and ``total`` are counts."""
    return total / (count * world_size)


class WeightedStep:
    """A step's micro-batches with their item counts, the all-reduce of the step's total in flight.

    Iterating yields the micro-batches with ``samples`` the item count and ``divisor`` from :func:`item_divisor`;
    the first is yielded at once, and :meth:`divisor` of a micro-batch waits for the total only when its loss is
    about to be scaled, so the all-reduce overlaps the first forward.
    """

    def __init__(self, step: Step, count_fn: CountFn, world_size: int, group: Any = None) -> None:
        # Read every micro-batch of the step: the total must be known before the first backward.
        self.micro = list(step.micro_batches)
        self.world_size = world_size
        counts = [_as_count(count_fn(m.batch)) for m in self.micro]
        device = comm_device(group)
        self.counts = counts
        self.total = torch.stack([c.to(device) for c in counts]).sum()
        self._work = None
        if is_live(group):
            self._work = dist.all_reduce(self.total, group=group, async_op=True)

    @classmethod
    def of(cls, step: Step, count_fn: CountFn | None, world_size: int, group: Any = None) -> WeightedStep | None:
        """The weighted step, or None without ``count_fn`` (the step weighs samples)."""
        return None if count_fn is None else cls(step, count_fn, world_size, group)

    def __iter__(self) -> Iterator[MicroBatch]:
        for micro, count in zip(self.micro, self.counts):
            yield replace(micro, samples=count)  # type: ignore[arg-type]  # a count: int or a 0-dim tensor

    def divisor(self, micro: MicroBatch) -> torch.Tensor:
        """The divisor of ``micro``'s mean loss; the first call waits for the step's total."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        count = micro.samples if isinstance(micro.samples, torch.Tensor) else torch.tensor(micro.samples)
        return item_divisor(count.to(self.total.device, torch.float64), self.world_size, self.total)


def scale_loss(loss: torch.Tensor, micro: MicroBatch, weighted: WeightedStep | None) -> torch.Tensor:
    """``micro``'s mean loss divided by its divisor in the step: per item with ``weighted``, else per sample."""
    if weighted is not None:
        return loss / weighted.divisor(micro).to(loss.dtype)
    return loss / micro.divisor if micro.divisor != 1 else loss  # 1: the loss as it is, bit for bit


def _as_count(value: Any) -> torch.Tensor:
    # float64: counts stay exact up to 2**53 items, where float32 would round above 2**24.
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"count_fn returned a tensor of shape {tuple(value.shape)}: return one number")
        return value.detach().reshape(()).to(torch.float64)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64)
    raise TypeError(f"count_fn returned a {type(value).__name__}: return an int or a 0-dim tensor")
