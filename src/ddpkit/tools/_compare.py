"""How two runs of ``ddpkit check`` differ, step by step (:func:`compare`), and how much of it is
rounding (:class:`Tolerance`)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

QUANTITIES = ("loss", "grad", "weights")
# A parameter whose gradient is this small next to the whole gradient gets only rounding noise (a
# bias BatchNorm cancels), which Adam turns into full-size steps: left out of the weights.
SILENT_GRADIENT = 1e-6
EXACT = 2.0**-29
"""float64's unit roundoff over float32's. N ranks sum in another order than one process, so their
runs differ by rounding, and in float32 a ReLU input within rounding of 0 falls on either side of
it: through BatchNorm such a flip moves every gradient by 1e-3, the size of a real difference under
a warm-up. In float64 the same sums differ by this much less, and a flip needs an input within 1e-16
of 0: the runs are judged there, with ``rtol * EXACT`` as the tolerance."""


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
    """What a run that raised raised."""
    silent: int = 0
    """Parameters left out of the weights' comparison (``SILENT_GRADIENT``)."""
    model: list[str] = field(default_factory=list)
    """Per step, the model whose weights differ most (a step_fn Trainer's, by name)."""

    def first(self, tol: Tolerance) -> tuple[int, str, float] | None:
        """(step, quantity, relative difference) of the first difference beyond ``tol``."""
        for step, d in enumerate(self.diffs):
            for q in ("grad", "loss", "weights"):
                if d.get(q, 0.0) > tol.at(step, q):
                    return step, q, d[q]
        return None

    def worst(self) -> float:
        return max((max(d.values()) for d in self.diffs), default=0.0)

    def differs(self, tol: Tolerance) -> bool:
        return self.error is not None or self.first(tol) is not None


REACH = 1000
"""How far beyond rounding's measured reach (:class:`Tolerance`) a difference must go to be real:
N ranks and one process differ by rounding at every sum of every step, a nudge of the weights
moves them once."""


@dataclass(frozen=True)
class Tolerance:
    """The largest relative difference that is rounding: ``floor``, or :data:`REACH` times what a
    nudge of one unit in the last place of every initial weight moved the 1-process run by, at the
    same step and in the same quantity (``reach``: the nudged run against the run)."""

    floor: float
    reach: tuple[dict[str, float], ...] = ()

    def at(self, step: int, quantity: str) -> float:
        moved = self.reach[step].get(quantity, 0.0) if step < len(self.reach) else 0.0
        return max(self.floor, REACH * moved)

    def largest(self) -> float:
        return max([self.floor, *(REACH * v for d in self.reach for v in d.values())])


def _silent_mask(reference: dict[str, Any], steps: int) -> tuple[torch.Tensor | None, int]:
    """The weights' elements to compare: those of parameters whose gradient was above rounding
    noise at every step so far in the reference; and how many parameters are left out."""
    sizes = reference.get("sizes")
    if not sizes or not steps:
        return None, 0
    grads = reference["grad"][:steps]
    keep = [
        all(float(g[end - n : end].norm()) > SILENT_GRADIENT * float(g.norm()) for g in grads)
        for n, end in zip(sizes, itertools.accumulate(sizes))
    ]
    mask = torch.cat([torch.full((n,), k) for n, k in zip(sizes, keep)])
    return mask, keep.count(False)


def compare(a: dict[str, Any], b: dict[str, Any]) -> Comparison:
    """``a`` against ``b`` (the reference), step by step, over the steps both completed; the
    weights of models by name (a step_fn Trainer's) model by model, the largest counted."""
    n = min(len(a["loss"]), len(b["loss"]))
    diffs = []
    silent = 0
    worst_model = []
    for i in range(n):
        mask, silent = _silent_mask(b, i + 1)
        wa, wb = a["weights"][i], b["weights"][i]
        if mask is not None:
            wa, wb = wa[mask], wb[mask]
        d = {"loss": _rel(a["loss"][i], b["loss"][i]), "weights": _rel(wa, wb)}
        if i < min(len(a["grad"]), len(b["grad"])):  # a step_fn Trainer's are not kept
            d["grad"] = _rel(a["grad"][i], b["grad"][i])
        if a.get("models") and b.get("models"):
            by_model = {
                name: _rel(w, b["models"][i].get(name, torch.zeros(0)))
                for name, w in a["models"][i].items()
            }
            worst_model.append(max(by_model, key=lambda name: by_model[name]))
            d["weights"] = max(by_model.values())
        diffs.append(d)
    return Comparison(diffs, a["error"] or b["error"], silent, worst_model)


@dataclass
class Verdict:
    """A set-up's outcome: the N-rank run against one process, and one process against itself."""

    ranks: Comparison
    repeat: Comparison

    def differs(self, tol: Tolerance) -> bool:
        return self.ranks.differs(tol) or self.repeat.differs(tol)

    def size(self) -> float:
        if self.ranks.error or self.repeat.error:
            return math.inf
        return max(self.ranks.worst(), self.repeat.worst())

    def closest(self, tol: Tolerance) -> tuple[float, float]:
        """The difference nearest its tolerance (of either comparison), and that tolerance."""
        pairs = [
            (d[q], tol.at(step, q))
            for c in (self.ranks, self.repeat)
            for step, d in enumerate(c.diffs)
            for q in d
        ]
        return max(pairs, key=lambda p: p[0] / p[1], default=(0.0, tol.floor))
