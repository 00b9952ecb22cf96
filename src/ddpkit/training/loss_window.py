"""A rank's training losses between two agreements of the ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ddpkit.distributed.collectives import all_reduce


@dataclass
class Agreed:
    """What the ranks agreed on: the window's loss x samples and samples over all ranks, and a stop flag."""

    loss_sum: float
    samples: float
    stop: bool

    @property
    def mean(self) -> float:
        return self.loss_sum / self.samples if self.samples else float("nan")


class LossWindow:
    """This rank's training losses since the ranks last agreed on the mean; a skipped step's are dropped.

    On an accelerator the losses stay tensors until the ranks agree: reading each would wait for the device.
    On the CPU (``on_host``) their values are read at once: a read is free there, and keeping the tiny tensors
    alive between steps fragments the heap the next steps' activations are allocated from.
    """

    def __init__(self, on_host: bool) -> None:
        self.on_host = on_host
        self.losses: list[torch.Tensor | float] = []
        self.sizes: list[int] = []
        self.steps = 0  # steps taken
        self.tried = 0  # steps taken or skipped
        self._step_start = 0

    def add(self, loss: torch.Tensor, size: int) -> None:
        self.losses.append(loss.item() if self.on_host else loss.detach())
        self.sizes.append(size)

    def step_is_finite(self) -> bool:
        return all(math.isfinite(float(loss)) for loss in self.losses[self._step_start :])

    def end_step(self, taken: bool) -> None:
        self.tried += 1
        if taken:
            self.steps += 1
        else:
            del self.losses[self._step_start :], self.sizes[self._step_start :]
        self._step_start = len(self.losses)

    def local_sum(self, device: torch.device) -> torch.Tensor:
        """Sum of loss x samples over this rank's micro-batches, in float64."""
        if self.on_host or not self.losses:
            total = math.fsum(float(loss) * size for loss, size in zip(self.losses, self.sizes))
            return torch.tensor(total, dtype=torch.float64, device=device)
        sizes = torch.tensor(self.sizes, dtype=torch.float64, device=device)
        losses = [loss for loss in self.losses if isinstance(loss, torch.Tensor)]  # all of them, off the host
        return torch.stack([loss.reshape(()).to(torch.float64) for loss in losses]) @ sizes

    def clear(self) -> None:
        self.losses, self.sizes, self.steps, self.tried, self._step_start = [], [], 0, 0, 0

    def agree(self, device: torch.device, stop: bool, group: Any) -> Agreed:
        """The global loss sum and sample count since the last agreement, and whether any rank must stop.

        Collective (one small all-reduce): every rank calls it after the same steps.
        """
        sums: dict[str, torch.Tensor | float] = {
            "loss": self.local_sum(device),
            "samples": sum(self.sizes),
            "stop": float(stop),
        }
        total = all_reduce(sums, group=group)
        return Agreed(float(total["loss"]), float(total["samples"]), bool(total["stop"]))
