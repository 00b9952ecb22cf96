"""How often the copies in memory are taken (:func:`interval_of`): after the first saves, the
smallest interval whose copy stays within :data:`STALL_BUDGET` of a step and whose transfer to other
nodes within :data:`TRANSFER_BUDGET` (docs/snapshots.md, "The interval it takes"), and what was
measured to choose it (:class:`Interval`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STALL_BUDGET = 0.05
"""The share of a step the copy to memory may hold the training loop when the interval is chosen."""
TRANSFER_BUDGET = 0.02
"""The share of a step a transfer of the copies to other nodes may cost when the interval is
chosen."""
TUNE_AFTER = 8
"""Saves (one per step) measured before the interval is chosen; twice as many where copies go to
other nodes, every other one of them sent
(:meth:`~ddpkit.snapshot._memory.MemoryStore._choose_interval`)."""


@dataclass(frozen=True)
class Interval:
    """The interval of the copies, once chosen: every ``every_steps`` steps, for a copy's median
    stall and a step's median time (ms); with copies on other nodes, their number (``replicas``,
    the rank's own included), the bytes a rank sends each time (``copy_bytes``), a transfer's
    median time beside training (``transfer_ms``) and the CPU time its thread takes
    (``transfer_cpu_ms``), and what a transfer adds to a step (``transfer_cost_ms``: a step and its
    save with a transfer beside it against one without, medians), the largest over the ranks."""

    every_steps: int
    stall_ms: float
    step_ms: float
    replicas: int = 1
    copy_bytes: int = 0
    transfer_ms: float = 0.0
    transfer_cpu_ms: float = 0.0
    transfer_cost_ms: float = 0.0


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else 0.0


def interval_of(
    starts: list[float],
    sent: list[bool],
    stalls: list[float],
    waits: list[float],
    cpus: list[float],
    *,
    copies: bool,
    paired: bool,
) -> tuple[int, float, float, float, float]:
    """Every how many steps a copy goes, from the first saves (one a step): ``starts[i]`` when
    save i began, ``stalls[i]`` how long it held the loop (with the wait for its transfer), of it
    ``waits[i]`` the waits, ``sent[i]`` whether it went to other nodes, ``cpus`` each transfer's
    thread's CPU. The smallest N whose copy's own stall stays within :data:`STALL_BUDGET` of a step
    and, with ``copies`` on other nodes, whose transfer's cost within :data:`TRANSFER_BUDGET`. A
    transfer costs its wait and its thread's CPU, at least; ``paired`` (every other save sent): the
    whole of it, a save and its next step with a transfer beside them against those without (gloo's
    threads, the turns of a shared core). The first two saves, which map the slots, are left out.
    Returns (N, stall, step, CPU, cost), in seconds."""
    starts, sent, stalls, waits = starts[2:], sent[2:], stalls[2:], waits[2:]
    stall = median(stalls)
    # a cycle: a save and the step after it, from its start to the next save's
    cycles = [(b - a, was, s) for a, b, was, s in zip(starts, starts[1:], sent, stalls)]
    # a step: a cycle less its save (and the wait for the save's transfer, counted in its stall)
    steps = [c - s for c, was, s in cycles if not (paired and was)]
    step = max(median(steps), 1e-9) if steps else 1.0
    cpu, cost = median(cpus), 0.0
    wanted = max(1, math.ceil(stall / (STALL_BUDGET * step)))
    if copies:  # the copy's own stall, and its transfer to other nodes
        own = median([s - w for s, w in zip(stalls, waits)])
        cost = median([w for w, was in zip(waits, sent) if was]) + cpu
        if paired:
            with_, without = ([c for c, was, _ in cycles if was is on] for on in (True, False))
            cost = max(cost, median(with_) - median(without))
        wanted = max(
            1,
            math.ceil(own / (STALL_BUDGET * step)),
            math.ceil(cost / (TRANSFER_BUDGET * step)),
        )
    return wanted, stall, step, cpu, cost
