"""Two training runs of the same steps, compared step by step: the global loss, the all-reduced
gradients, and the weights after each step, as relative differences of whole tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

QUANTITIES = ("loss", "grad", "weights")


def _rel(a: Any, b: Any) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        return math.inf
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return 0.0 if torch.equal(a.nan_to_num(), b.nan_to_num()) else math.inf
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@dataclass
class Comparison:
    """How two runs of the same steps differ."""

    diffs: list[dict[str, float]]
    """Per step, the relative difference of each quantity."""
    error: str | None = None
    """A run that raised, and what it raised."""
    silent: int = 0
    """Parameters left out of the weights' comparison: their gradients are rounding noise (see
    compare)."""

    def first(self, rtol: float) -> tuple[int, str, float] | None:
        """(step, quantity, relative difference) of the first difference beyond ``rtol``."""
        for step, d in enumerate(self.diffs):
            for q in ("grad", "loss", "weights"):
                if d[q] > rtol:
                    return step, q, d[q]
        return None

    def worst(self) -> float:
        return max((max(d.values()) for d in self.diffs), default=0.0)

    def differs(self, rtol: float) -> bool:
        return self.error is not None or self.first(rtol) is not None


# A parameter whose gradient is this small next to the whole gradient gets only rounding noise: a
# bias that BatchNorm cancels, for one. Adam divides a gradient by its own size, so it moves such a
# parameter by a full learning rate in a direction set by the noise, and two runs that agree to 1e-7
# move it in opposite directions.
SILENT_GRADIENT = 1e-6


def _silent_mask(reference: dict[str, Any], steps: int) -> tuple[torch.Tensor | None, int]:
    """Elements of the weights to compare: those of parameters whose gradient was above rounding
    noise at every step so far, in the reference run; and how many parameters are left out."""
    sizes = reference.get("sizes")
    if not sizes or not steps:
        return None, 0
    keep = []
    for i in range(len(sizes)):
        start = sum(sizes[:i])
        alive = all(
            float(g[start : start + sizes[i]].norm()) > SILENT_GRADIENT * float(g.norm())
            for g in reference["grad"][:steps]
        )
        keep.append(alive)
    mask = torch.cat([torch.full((n,), k) for n, k in zip(sizes, keep)])
    return mask, keep.count(False)


def compare(a: dict[str, Any], b: dict[str, Any]) -> Comparison:
    """``a`` against ``b`` (the reference), step by step, over the steps both completed."""
    error = a["error"] or b["error"]
    n = min(len(a["loss"]), len(b["loss"]))
    diffs = []
    silent = 0
    for i in range(n):
        mask, silent = _silent_mask(b, i + 1)
        wa, wb = (
            (a["weights"][i], b["weights"][i])
            if mask is None
            else (a["weights"][i][mask], b["weights"][i][mask])
        )
        diffs.append(
            {
                "loss": _rel(a["loss"][i], b["loss"][i]),
                "grad": _rel(a["grad"][i], b["grad"][i]),
                "weights": _rel(wa, wb),
            }
        )
    return Comparison(diffs, error, silent)


@dataclass
class Verdict:
    """A set-up's outcome: the N-rank run against one process, and one process against itself."""

    ranks: Comparison
    repeat: Comparison

    def differs(self, rtol: float) -> bool:
        return self.ranks.differs(rtol) or self.repeat.differs(rtol)

    def size(self) -> float:
        if self.ranks.error or self.repeat.error:
            return math.inf
        return max(self.ranks.worst(), self.repeat.worst())
