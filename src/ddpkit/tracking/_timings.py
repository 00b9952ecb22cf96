"""Where each rank's step time goes, and which rank holds the others up.

Each rank splits its steps into phases, in seconds summed over a log window:

- ``data``: blocked in the loader's ``next()`` (the host's wait; the batch's copy to the device is
  ``compute``);
- ``compute``: the rest of the forward and backward passes of the step's micro-batches;
- ``comm``: the gradient synchronisation that the backward did not hide: from the moment the last
  gradient of the step's synchronising backward is accumulated to the moment ``backward()``
  returns. DDP all-reduces buckets while the backward still runs; what is left when the last
  gradient is ready is the wait for the slowest bucket's all-reduce, that is, for the slowest rank
  to reach it, and the copy of the averaged gradients back. The all-reduce's own time, where the
  backward hid it, is not in it. The moment is marked by a callback of the autograd engine, which
  it runs once every gradient is accumulated, in the order callbacks were queued. It must be queued
  ahead of the callbacks that wait for the gradients' collectives: DDP's, queued at the last
  gradient, and FSDP's, queued at the root module's output. Under DDP, which requires a gradient
  for every parameter (unless ``find_unused_parameters`` or ``static_graph``), it is queued by a
  hook on the gradient accumulation of one parameter, registered once and armed for the step's
  synchronising backward: it runs before that gradient is accumulated, so no later than the last
  gradient, where DDP queues its wait (checked once, against the other way: a parameter whose
  gradient is accumulated in a nested backward, as under reentrant activation checkpointing,
  would mark too early). Elsewhere (FSDP, ``torch.compile``), by a hook on the loss's node,
  which the backward runs first, registered each step: ~40 us more a step under 2-rank DDP than
  the armed hook (bench/backward_mark.py). A hook on every parameter would cost one Python call
  per parameter (hundreds, in a deep model). In a world of one nothing is marked: there is no
  ``comm``, and the backward's end is where it returns. Also the broadcast of the module's
  buffers that DDP does before each forward (``broadcast_buffers``), from DDP's forward starting
  to the wrapped module's: it too waits for every rank;
- ``optimizer``: the strategy's gradient check, clipping, the optimizer and per-step scheduler step;
- ``snapshot``: the copy in memory after a step and the snapshot's save.

A rank's *busy* time is all but ``comm``: in DDP every rank waits at the all-reduce for the slowest,
so every rank's wall time per step is the same and the slowest rank is the one with the most busy
time; the others show its excess as ``comm``. At each window's end the ranks' phases travel in the
loss's agreement, a few float64 per rank in its one all-gather (no collective of their own, none per
step).

On the CPU the phases are host clock times. On CUDA, ``compute``, ``comm`` and ``optimizer`` are
read from CUDA events on the current stream (the host runs ahead of the device, and its clock would
show where it waited, not where the device worked), resolved at the window's end, when the loss's
agreement waits for the device anyway.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddpkit._internals.compiler import at_backward_end
from ddpkit.strategies._prepare import accumulation_of_a_parameter

PHASES = ("data", "compute", "comm", "optimizer", "snapshot")
# a rank's own work; comm is waiting for the others
BUSY = ("data", "compute", "optimizer", "snapshot")
SLOW_RATIO = 1.2
"""A rank is named slow when its busy time per step is more than this times the median of the other
ranks' (itself left out: at 2 ranks a median with it would be the mean of the two, and a rank would
need to be 1.5x the other to pass 1.2x), ..."""
SLOW_SHARE = 0.05
"""... and the excess is at least this share of the step's wall time (a tiny phase's noise is not
news)."""


class StepTimings:
    """This rank's phase times since the last window's end (see the module's docstring).

    The Trainer calls :meth:`start_step`, :meth:`before_optimizer`, :meth:`after_optimizer` around
    each step, :meth:`data` for each batch it takes, and wraps snapshot work in :meth:`phase`.
    A step of several optimizers (``step_fn``) marks each optimizer step the same way, and each
    synchronising backward's end (:meth:`backward_returned`); what runs between them is
    ``compute``, until :meth:`end_step`. Disabled, every call is a no-op. ``compiled`` (the model
    runs under ``torch.compile``): DDP's broadcast of buffers before the forward is not timed as
    ``comm`` (it stays in ``compute``). Without ``communicates`` (a world of one) no ``comm`` is
    marked: the backward's end is where it returns.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        enabled: bool = True,
        compiled: bool = False,
        communicates: bool = True,
    ) -> None:
        self.enabled = enabled
        # a world of one: nothing to wait for after the last gradient, and no hook to pay for it
        self._communicates = communicates
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.samples = 0  # this rank's samples read in the window
        self._cuda = enabled and device.type == "cuda"
        self._events: list[Any] = []  # CUDA: free events, reused from window to window
        self._used: list[Any] = []  # CUDA: the window's events
        self._data_in_compute = 0.0  # CUDA: host data waits inside the compute spans
        self._spans: dict[str, list[tuple[Any, Any]]] = {
            p: [] for p in ("compute", "comm", "optimizer")
        }
        self._last_grad: Any = None
        # DDP: the accumulation of a parameter that gets a gradient in every backward, with a hook
        # that marks the step's synchronising backward when armed (see sync_backward)
        self._anchor: Any = None
        self._anchor_hook: Any = None
        self._armed = False
        # The first synchronising backward is marked both ways, to check the anchor's mark lands
        # where the loss's node's does (see _check_anchor).
        self._anchor_checked = False
        self._outer_at: float | None = None
        self._anchor_at: float | None = None
        self._hooks: list[Any] = []
        self._forward_start: Any = None
        # between start_step and before_optimizer: an evaluation's forward is not a step's
        self._stepping = False
        # A world of one, even wrapped in DDP (`ddpkit run --nproc 1`), waits for nobody: no hook.
        if enabled and communicates:
            # Under torch.compile the forward's hooks would be traced (a clock read in the
            # graph): not timed there. Nor where DDP broadcasts nothing (no buffers, or
            # broadcast_buffers=False): a module with a forward hook takes its slow call path.
            if (
                isinstance(model, DistributedDataParallel)
                and not compiled
                and getattr(model, "will_sync_module_buffers", lambda: True)()
            ):
                self._hooks.append(model.register_forward_pre_hook(self._ddp_forward))
                self._hooks.append(model.module.register_forward_pre_hook(self._module_forward))
            # Held with its hook (DDP holds it too): a node nobody holds is made anew each
            # forward, without the hook.
            self._anchor = None if compiled else accumulation_of_a_parameter(model)
            if self._anchor is not None:
                self._anchor_hook = self._anchor.register_prehook(self._accumulating)
                self._hooks.append(self._anchor_hook)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._anchor = self._anchor_hook = None

    # The clock: host seconds on the CPU, CUDA events (resolved at the window's end) on a GPU.
    def _mark(self) -> Any:
        if not self._cuda:
            return time.perf_counter()
        event = self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)
        event.record()
        self._used.append(event)
        return event

    def _span(self, phase: str, start: Any, end: Any) -> None:
        if self._cuda:
            self._spans[phase].append((start, end))
        else:
            self.seconds[phase] += end - start

    def sync_backward(self, loss: torch.Tensor) -> None:
        """Before ``loss.backward()``, the step's synchronising backward (its last micro-batch's):
        the moment its last gradient is ready is marked, the start of ``comm``."""
        if not (self.enabled and self._communicates):
            return
        if self._anchor is not None:
            self._armed = True
            if self._anchor_checked:
                return
        node = loss.grad_fn
        if node is not None:
            node.register_prehook(self._backward_started)

    def _backward_started(self, _grad_outputs: Any) -> None:
        at_backward_end(self._grads_ready)

    def _accumulating(self, _grad_outputs: Any) -> None:
        # the anchor parameter's gradient is about to be accumulated, in any backward through the
        # model (every micro-batch's, a callback's): only the step's synchronising one is marked
        if self._armed:
            self._armed = False
            at_backward_end(self._grads_ready if self._anchor_checked else self._anchor_ready)

    def _grads_ready(self) -> None:
        # on CUDA the engine runs callbacks on the caller's stream, once it waits for the
        # gradients' streams: the event follows every gradient's kernel
        self._last_grad = self._mark()
        if self._anchor is not None and not self._anchor_checked:
            self._outer_at = time.perf_counter()

    def _anchor_ready(self) -> None:
        self._anchor_at = time.perf_counter()

    def _check_anchor(self) -> None:
        """After the first synchronising backward, marked both ways. The engine runs a backward's
        callbacks in the order they were queued, so the anchor's runs after the loss node's, unless
        the anchor's gradient was accumulated in a backward nested in the step's (a block under
        reentrant activation checkpointing), whose callbacks run when it ends, before the step's
        backward is done: then the anchor would mark too early, and the loss's node marks every
        step."""
        outer, anchor = self._outer_at, self._anchor_at
        self._outer_at = self._anchor_at = None
        if outer is None:  # the loss had no node: nothing to check against yet
            return
        if anchor is not None and anchor >= outer:
            self._anchor_checked = True
            return
        self._hooks.remove(self._anchor_hook)
        self._anchor_hook.remove()
        self._anchor = self._anchor_hook = None

    def _ddp_forward(self, _module: nn.Module, _args: Any) -> None:
        if self._stepping:
            self._forward_start = self._mark()

    def _module_forward(self, _module: nn.Module, _args: Any) -> None:
        if self._forward_start is not None:
            self._span("comm", self._forward_start, self._mark())
            self._forward_start = None

    def data(self, seconds: float, samples: int) -> None:
        """A batch taken from the loader: ``seconds`` waited in its ``next()``, and its samples."""
        if self.enabled:
            self.seconds["data"] += seconds
            self.samples += samples

    def start_step(self) -> None:
        """Before the step reads its first micro-batch."""
        if self.enabled:
            self._compute_from(self._mark())
            # armed by a step whose backward raised before reaching the anchor: not this step's
            self._last_grad, self._armed = None, False

    def _compute_from(self, start: Any) -> None:
        self._start, self._data_before, self._comm_before = (
            start,
            self.seconds["data"],
            self.seconds["comm"],
        )
        self._stepping = True

    def backward_returned(self) -> None:
        """After a synchronising backward returned, where more of the step follows before the
        optimizer's (a step of several optimizers): its ``comm`` ends here."""
        if self.enabled and self._last_grad is not None:
            comm_start, self._last_grad = self._last_grad, None
            self._span("comm", comm_start, self._mark())

    def before_optimizer(self) -> None:
        """After the step's last backward (the synchronising one) has returned."""
        if not self.enabled:
            return
        self._armed = False
        if self._anchor is not None and not self._anchor_checked:
            self._check_anchor()
        self._mid = self._end_compute()

    def _end_compute(self) -> Any:
        """The compute since :meth:`_compute_from` ends now: its span less the data and comm in it;
        the mark of now."""
        now = self._mark()
        self._stepping = False
        data = self.seconds["data"] - self._data_before
        if self._last_grad is not None:
            comm_start, self._last_grad = self._last_grad, None
            self._span("comm", comm_start, now)
        # the host's data wait is device idle time inside the span: taken out at the window's end
        if self._cuda:
            self._spans["compute"].append((self._start, now))
            self._data_in_compute += data
        else:
            self.seconds["compute"] += (
                now - self._start - data - (self.seconds["comm"] - self._comm_before)
            )
        return now

    def after_optimizer(self, more: bool = False) -> None:
        """After the optimizer step (taken or skipped). ``more``: the step goes on (a step of
        several optimizers): what follows is ``compute``, until the next :meth:`before_optimizer`
        or :meth:`end_step`."""
        if self.enabled:
            end = self._mark()
            self._span("optimizer", self._mid, end)
            if more:
                self._compute_from(end)

    def end_step(self) -> None:
        """After a step of several optimizers: the compute since its last optimizer step ends."""
        if self.enabled and self._stepping:
            self._end_compute()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as ``name`` (host time: snapshot work waits for what it copies)."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def _resolve(self) -> dict[str, float]:
        """The window's phase seconds; on CUDA, waits for the window's last event."""
        seconds = dict(self.seconds)
        if self._cuda:
            torch.cuda.current_stream().synchronize()
            for phase, spans in self._spans.items():
                seconds[phase] += sum(a.elapsed_time(b) for a, b in spans) / 1000
                spans.clear()
            seconds["compute"] -= seconds["comm"] + self._data_in_compute
            self._data_in_compute = 0.0
            self._events += self._used
            self._used = []
        return seconds

    def row(self, wall: float, items: float) -> list[float]:
        """This rank's phases in the window that ends here, its ``wall`` seconds, samples and
        ``items`` (tokens), for the window's agreement to gather (:meth:`LossWindow.agree
        <ddpkit.training._loss_window.LossWindow.agree>`). The window's counts start afresh."""
        seconds = self._resolve()
        local = [seconds[p] for p in PHASES] + [wall, float(self.samples), float(items)]
        # in place: the loader's pass holds this dict
        self.seconds.update(dict.fromkeys(PHASES, 0.0))
        self.samples = 0
        return local

    @staticmethod
    def times(table: list[list[float]], wall: float, steps: int) -> RankTimes:
        """Every rank's :meth:`row`, in rank order, per step of a window of ``steps`` steps."""
        per_step = 1000 / max(steps, 1)
        ms = {p: [row[i] * per_step for row in table] for i, p in enumerate(PHASES)}
        return RankTimes(
            ms=ms,
            step_ms=[row[len(PHASES)] * per_step for row in table],
            wall=wall,
            samples=sum(row[len(PHASES) + 1] for row in table),
            items=sum(row[len(PHASES) + 2] for row in table),
        )


@dataclass(frozen=True)
class Slowest:
    rank: int
    excess_ms: float
    """Its busy time per step minus the median of the other ranks'."""
    ratio: float
    """Its busy time over the median of the other ranks'."""
    phase: str
    """The busy phase whose excess over the other ranks' median of it is the largest."""
    slow: bool
    """Over both thresholds (``SLOW_RATIO``, ``SLOW_SHARE``): worth naming."""

    def text(self) -> str:
        return f"rank {self.rank} +{self.excess_ms:.3g}ms ({self.phase})"


@dataclass(frozen=True)
class RankTimes:
    """A window's phases per rank, in ms per step (lists in rank order), and the samples of all
    ranks."""

    ms: dict[str, list[float]]
    step_ms: list[float]
    """Each rank's wall time per step (the window's wall time over its steps)."""
    wall: float
    """This rank's window, in seconds."""
    samples: float
    items: float

    @cached_property
    def busy_ms(self) -> list[float]:
        return [sum(self.ms[p][r] for p in BUSY) for r in range(len(self.step_ms))]

    def slowest(self) -> Slowest:
        return self._slowest

    @cached_property
    def _slowest(self) -> Slowest:
        busy = self.busy_ms
        rank = max(range(len(busy)), key=busy.__getitem__)
        if len(busy) == 1:
            return Slowest(rank, 0.0, 1.0, BUSY[0], False)

        def others(values: list[float]) -> float:  # the median without the rank judged
            return statistics.median(values[:rank] + values[rank + 1 :])

        median = others(busy)
        excess = busy[rank] - median
        phase = max(BUSY, key=lambda p: self.ms[p][rank] - others(self.ms[p]))
        ratio = busy[rank] / median if median > 0 else float("inf") if busy[rank] > 0 else 1.0
        slow = ratio > SLOW_RATIO and excess >= SLOW_SHARE * statistics.median(self.step_ms)
        return Slowest(rank, excess, ratio, phase, slow)

    def record(self) -> dict[str, Any]:
        """The window's ``ranks`` record: per-rank lists, and the slowest rank."""
        out: dict[str, Any] = {f"{p}_ms": _rounded(v) for p, v in self.ms.items()}
        out |= {"busy_ms": _rounded(self.busy_ms), "step_ms": _rounded(self.step_ms)}
        s = self.slowest()
        out |= {
            "slowest_rank": s.rank,
            "slowest_excess_ms": round(s.excess_ms, 3),
            "slowest_ratio": round(s.ratio, 3),
            "slowest_phase": s.phase,
            "slow": s.slow,
        }
        return out


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]


class RunSpeed:
    """The run's slowest rank over all its windows: busy ms summed per rank, and the windows each
    named slow."""

    def __init__(self) -> None:
        self.busy: list[float] = []
        self.phases: dict[str, list[float]] = {}
        self.step_ms: list[float] = []
        self.slow_windows: dict[int, int] = {}
        self.windows = 0

    def add(self, times: RankTimes, steps: int) -> None:
        if not self.busy:
            self.busy = [0.0] * len(times.step_ms)
            self.phases = {p: [0.0] * len(times.step_ms) for p in PHASES}
            self.step_ms = [0.0] * len(times.step_ms)
        for r, v in enumerate(times.busy_ms):
            self.busy[r] += v * steps
            self.step_ms[r] += times.step_ms[r] * steps
            for p in PHASES:
                self.phases[p][r] += times.ms[p][r] * steps
        self.windows += 1
        slowest = times.slowest()
        if slowest.slow:
            self.slow_windows[slowest.rank] = self.slow_windows.get(slowest.rank, 0) + 1

    def summary(self) -> str | None:
        """A line for the run's summary: the slowest rank over the run, its excess and phase."""
        if not self.busy:
            return None
        total = RankTimes(
            ms=self.phases, step_ms=self.step_ms, wall=0.0, samples=0.0, items=0.0
        ).slowest()
        named = self.slow_windows.get(total.rank, 0)
        if len(self.busy) == 1:
            return None
        windows = f"slow in {named} of {self.windows} windows"
        if total.slow:
            return (
                f"  slowest rank {total.rank}: {total.ratio:.2f}x the other ranks' median busy "
                f"time, mostly {total.phase}; {windows}"
            )
        return (
            f"  ranks even (busiest: rank {total.rank}, {total.ratio:.2f}x the other ranks' "
            f"median busy time); {windows}"
        )
