"""How fast a run goes: samples (and tokens) a second, MFU, and each rank's phases, at every log
window.

What the Trainer holds: :class:`~ddpkit.tracking._timings.StepTimings` (each rank's phases), the
FLOPs of a sample (:mod:`ddpkit.tracking._flops`, counted at the first step where a peak is known),
the work of a window that is not training (a validation), and the run's slowest rank for its
summary. See docs/speed.md for how to read the numbers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddpkit.data._loader import batch_len
from ddpkit.tracking._flops import FlopCount, device_peak, mfu
from ddpkit.tracking._timings import RankTimes, RunSpeed, StepTimings


@dataclass
class Aside:
    """Work of a window set aside (:meth:`Speed.aside`)."""

    seconds: float = 0.0
    """How long the work set aside took (known once it is done)."""


class Speed:
    """A run's speed, measured on every rank and gathered at each log window
    (``LoggingConfig.step_timings``).

    ``peak``: the peak FLOP/s of one device (``LoggingConfig.peak_flops``, else the table's for a
    known GPU); with one, the FLOPs of the first micro-batch's forward and backward are counted once
    and MFU is reported. ``compiled`` (the model runs under ``torch.compile``): no MFU (counting
    would run the first step eagerly), and DDP's buffer broadcast stays in ``compute``.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        *,
        enabled: bool,
        precision: str,
        world_size: int,
        peak_flops: float | None = None,
        compiled: bool = False,
    ) -> None:
        self.enabled, self.world_size = enabled, world_size
        self.timings = StepTimings(model, device, enabled, compiled, world_size > 1)
        self.peak = (
            (peak_flops or device_peak(device, precision)) if enabled and not compiled else None
        )
        self.flops = FlopCount()
        self.to_count = self.peak is not None
        """The next micro-batch's FLOPs are to be counted (:meth:`counting`): the first one's, once
        a peak is known."""
        self.run = RunSpeed()
        self.aside_seconds = 0.0
        """This rank's seconds of work set aside (:meth:`aside`) since the window started."""
        self._cuda = device.type == "cuda"

    @contextmanager
    def aside(self) -> Iterator[Aside]:
        """Around work inside a log window that is not training (a validation): its seconds are
        left out of the window's wall time (:meth:`window_seconds`), with the timings on or off.
        On CUDA the window's queued work is waited for first: it is training's."""
        if self._cuda:
            torch.cuda.current_stream().synchronize()
        took = Aside()
        start = time.perf_counter()
        try:
            yield took
        finally:
            took.seconds = time.perf_counter() - start
            self.aside_seconds += took.seconds

    def window_seconds(self, start: float, end: float) -> float:
        """The wall time of the window from ``start`` to ``end`` (``time.perf_counter()``) less the
        work set aside in it; the next window's count starts afresh."""
        aside, self.aside_seconds = self.aside_seconds, 0.0
        return end - start - aside

    def counting(self, batch: Any) -> AbstractContextManager[None]:
        """Around the forward and backward of a micro-batch: the first one's FLOPs are counted."""
        if not self.to_count:
            return nullcontext()
        self.to_count = False
        return self.flops.counting(batch_len(batch))

    def row(self, wall: float, items: float | None) -> list[float]:
        """This rank's phases in the window ending here, for the window's agreement to gather;
        empty when off. ``items``: this rank's items (tokens) in the window's steps, under
        ``count_fn``."""
        return self.timings.row(wall, items or 0.0) if self.enabled else []

    def times(self, table: list[list[float]], wall: float, steps: int) -> RankTimes | None:
        """Every rank's phases in the window, from every rank's :meth:`row` (in rank order); None
        when off."""
        if not self.enabled:
            return None
        times = StepTimings.times(table, wall, steps)
        if steps:
            self.run.add(times, steps)
        return times

    def rates(self, times: RankTimes, tokens: bool) -> dict[str, float]:
        """Samples (and tokens, with ``tokens``) a second over all ranks, and MFU where it is
        known."""
        seconds = max(times.wall, 1e-9)
        out = {"samples_per_s": times.samples / seconds}
        if tokens:
            out["tokens_per_s"] = times.items / seconds
        utilisation = mfu(self.flops.per_sample, out["samples_per_s"], self.peak, self.world_size)
        if utilisation is not None:
            out["mfu"] = utilisation
        return out

    def close(self) -> None:
        self.timings.close()
