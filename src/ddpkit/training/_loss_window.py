"""A rank's training losses between two agreements of the ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ddpkit.distributed import Group
from ddpkit.distributed._collectives import gather_values


@dataclass
class Agreed:
    """What the ranks agreed on: the window's loss x samples and samples over all ranks, and a stop
    flag."""

    loss_sum: float
    samples: float
    stop: bool
    means: dict[str, float] = field(default_factory=dict)
    """The mean of each named loss (a step of several models: each ``backward(loss, name)``'s)."""
    rows: list[list[float]] = field(default_factory=list)
    """Every rank's ``row`` passed to :meth:`LossWindow.agree`, in rank order."""
    fault: int = 0
    """The errno of a failed write of the run directory on some rank (0: none)."""

    @property
    def mean(self) -> float:
        return self.loss_sum / self.samples if self.samples else float("nan")


class LossWindow:
    """This rank's training losses since the ranks last agreed on the mean; a skipped step's are
    dropped.

    On an accelerator the losses stay tensors until the ranks agree: reading each would wait for the
    device. On the CPU (``on_host``) their values are read at once: a read is free there, and
    keeping the tiny tensors alive between steps fragments the heap the next steps' activations are
    allocated from.
    """

    def __init__(self, on_host: bool) -> None:
        self.on_host = on_host
        self.losses: list[torch.Tensor | float] = []
        self.sizes: list[float | torch.Tensor] = []  # samples, or items (see ddpkit.training._step)
        self.names: list[str] = []  # each loss's name, in a step of several models (else none)
        self.steps = 0  # steps taken
        self.tried = 0  # steps taken or skipped
        self._step_start = 0
        self.last_step: tuple[list[torch.Tensor | float], list[float | torch.Tensor]] = ([], [])

    def add(self, loss: torch.Tensor, size: int | torch.Tensor, name: str | None = None) -> None:
        self.losses.append(loss.item() if self.on_host else loss.detach())
        self.sizes.append(
            float(size) if self.on_host or not isinstance(size, torch.Tensor) else size.detach()
        )
        if name is not None:
            self.names.append(name)

    def step_is_finite(self) -> bool:
        return all(math.isfinite(float(loss)) for loss in self.losses[self._step_start :])

    def end_step(self, taken: bool) -> None:
        self.tried += 1
        # The step's own losses, for on_step_end (a skipped step's too: they may say why it was
        # skipped).
        self.last_step = (self.losses[self._step_start :], self.sizes[self._step_start :])
        if taken:
            self.steps += 1
        else:
            del (
                self.losses[self._step_start :],
                self.sizes[self._step_start :],
                self.names[self._step_start :],
            )
        self._step_start = len(self.losses)

    def local_sum(self, device: torch.device) -> torch.Tensor:
        """Sum of loss x samples (or items) over this rank's micro-batches, in float64."""
        if self.on_host or not self.losses:
            total = math.fsum(float(loss) * size for loss, size in zip(self.losses, self.sizes))
            return torch.tensor(total, dtype=torch.float64, device=device)
        # item counts, left on the device
        if any(isinstance(size, torch.Tensor) for size in self.sizes):
            sizes = torch.stack(
                [torch.as_tensor(s, dtype=torch.float64, device=device) for s in self.sizes]
            )
        else:
            sizes = torch.tensor(self.sizes, dtype=torch.float64, device=device)
        # Tensors, off the host; numbers where a snapshot restored them (the float64 of the same
        # values).
        losses = [
            torch.as_tensor(loss, dtype=torch.float64, device=device).reshape(())
            for loss in self.losses
        ]
        return torch.stack(losses) @ sizes

    def state_dict(self) -> dict[str, Any]:
        """The losses not yet agreed on (a snapshot between two agreements): each rank's own, as
        numbers, so that the resumed run's agreement sums the very values the uninterrupted run's
        does."""
        state = {
            "losses": [float(loss) for loss in self.losses],
            "sizes": [float(size) for size in self.sizes],
            "steps": self.steps,
            "tried": self.tried,
        }
        return state | {"names": list(self.names)} if self.names else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses, self.sizes = list(state["losses"]), list(state["sizes"])
        self.names = list(state.get("names", []))
        self.steps, self.tried = int(state["steps"]), int(state["tried"])
        self._step_start = len(self.losses)

    def load_rank_states(self, states: list[dict[str, Any]], rank: int) -> None:
        """At another world size: rank 0 takes every old rank's losses, the others none, so that the
        next agreement makes the same sum; the step counts are every rank's alike."""
        counts = {"steps": states[0]["steps"], "tried": states[0]["tried"]}
        if rank == 0:
            mine = {
                "losses": [x for s in states for x in s["losses"]],
                "sizes": [x for s in states for x in s["sizes"]],
                "names": [x for s in states for x in s.get("names", [])],
            }
        else:
            mine = {"losses": [], "sizes": [], "names": []}
        self.load_state_dict(mine | counts)

    def clear(self) -> None:
        self.losses, self.sizes, self.steps, self.tried, self._step_start = [], [], 0, 0, 0
        self.names = []

    def agree(
        self,
        device: torch.device,
        stop: bool,
        group: Group,
        row: Sequence[float] = (),
        fault: int = 0,
    ) -> Agreed:
        """The global loss sum and sample count since the last agreement, whether any rank must
        stop, and every rank's ``row`` (the window's step timings).

        Collective (one small all-gather): every rank calls it after the same steps. One all-gather
        of every rank's sums and row costs what an all-reduce of the sums does (a few numbers: the
        latency is the cost), and saves a second collective for the rows. The totals are summed
        from the table in rank order, the same on every rank.
        """
        mine: dict[str, Any] = {
            "loss": self.local_sum(device),
            "samples": sum(self.sizes),
            "stop": float(stop),
            "fault": float(fault),  # a failed write of the run directory: its errno
        }
        # Named losses (several models): each name's sums too, in the same all-gather. Every rank
        # ran the same step function, so every rank has the same names.
        names = sorted(set(self.names))
        for name in names:
            at = [i for i, n in enumerate(self.names) if n == name]
            mine[f"loss:{name}"] = math.fsum(
                float(self.losses[i]) * float(self.sizes[i]) for i in at
            )
            mine[f"samples:{name}"] = math.fsum(float(self.sizes[i]) for i in at)
        mine["row"] = torch.tensor(list(row), dtype=torch.float64)
        table = gather_values(mine, group)
        total = {k: math.fsum(float(r[k]) for r in table) for k in mine if k != "row"}
        means = {n: total[f"loss:{n}"] / total[f"samples:{n}"] for n in names}
        return Agreed(
            total["loss"],
            total["samples"],
            bool(total["stop"]),
            means,
            [r["row"].tolist() for r in table],
            int(max(float(r["fault"]) for r in table)),
        )


@dataclass
class EpochLoss:
    """The sums agreed so far in the current epoch: loss x samples (or items), and samples; the same
    on every rank. Part of every snapshot, so that a run resumed inside an epoch reports the mean
    over all its steps."""

    loss_sum: float = 0.0
    samples: float = 0.0

    def add(self, agreed: Agreed) -> None:
        self.loss_sum += agreed.loss_sum
        self.samples += agreed.samples

    @property
    def mean(self) -> float:
        return self.loss_sum / self.samples if self.samples else float("nan")

    def reset(self) -> None:
        self.loss_sum, self.samples = 0.0, 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"loss_sum": self.loss_sum, "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_sum, self.samples = float(state["loss_sum"]), float(state["samples"])
