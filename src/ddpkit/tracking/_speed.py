"""How fast a run goes: each rank's phases (data, compute, comm, optimizer, snapshot) per log
window and the rank that holds the others up, samples (and tokens) a second, and MFU from the FLOPs
of a sample and the device's peak. What each phase holds and how it is marked: docs/speed.md.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from ddpkit._internals.compiler import at_backward_end, cpu_attention_ops
from ddpkit.data._loader import batch_len
from ddpkit.strategies._prepare import accumulation_of_a_parameter

PHASES = ("data", "compute", "comm", "optimizer", "snapshot")
BUSY = ("data", "compute", "optimizer", "snapshot")  # a rank's own work; comm is waiting
SLOW_RATIO = 1.2
"""A rank is named slow when its busy time per step is more than this times the median of the other
ranks' (itself left out), ..."""
SLOW_SHARE = 0.05
"""... and the excess is at least this share of the step's wall time."""


class StepTimings:
    """This rank's phase times since the last window's end.

    The step's observer (:class:`~ddpkit.training._step.StepObserver`) calls :meth:`start_step`,
    :meth:`before_optimizer`, :meth:`after_optimizer` around each step, :meth:`data` for each batch
    it takes, and wraps snapshot work in :meth:`phase`.
    A step of several optimizers marks each optimizer step the same way, and each synchronising
    backward's end (:meth:`backward_returned`), until :meth:`end_step`. Disabled, every call is a
    no-op. ``compiled``: DDP's buffer broadcast stays in ``compute``. Without ``communicates`` (a
    world of one) no ``comm`` is marked. How the step's last gradient is marked (an anchor
    parameter's hook under DDP, else the loss's node): docs/speed.md.
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
        self._communicates = communicates
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.samples = 0  # this rank's samples read in the window
        self._cuda = enabled and device.type == "cuda"
        self._events: list[Any] = []  # CUDA: free events, reused from window to window
        self._used: list[Any] = []  # CUDA: the window's events
        self._data_in_compute = 0.0  # host data waits inside the compute spans
        self._spans: dict[str, list[tuple[Any, Any]]] = {  # CUDA: the window's event pairs
            p: [] for p in ("compute", "comm", "optimizer")
        }
        self._last_grad: Any = None
        self._anchor: Any = None  # DDP: a parameter's accumulation node, with the armed hook
        self._anchor_hook: Any = None
        self._armed = False
        self._anchor_checked = False  # the first synchronising backward is marked both ways
        self._outer_at: float | None = None
        self._anchor_at: float | None = None
        self._hooks: list[Any] = []
        self._forward_start: Any = None
        self._stepping = False  # between start_step and before_optimizer
        if enabled and communicates:
            # no forward hooks under torch.compile (traced), nor where DDP broadcasts no buffers
            if (
                isinstance(model, DistributedDataParallel)
                and not compiled
                and model.will_sync_module_buffers()
            ):
                self._hooks.append(model.register_forward_pre_hook(self._ddp_forward))
                self._hooks.append(model.module.register_forward_pre_hook(self._module_forward))
            # held: a node nobody holds is made anew each forward, without the hook
            self._anchor = None if compiled else accumulation_of_a_parameter(model)
            if self._anchor is not None:
                self._anchor_hook = self._anchor.register_prehook(self._accumulating)
                self._hooks.append(self._anchor_hook)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._anchor = self._anchor_hook = None

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
        # on CUDA, on the caller's stream once it waits for the gradients': after every kernel
        self._last_grad = self._mark()
        if self._anchor is not None and not self._anchor_checked:
            self._outer_at = time.perf_counter()

    def _anchor_ready(self) -> None:
        self._anchor_at = time.perf_counter()

    def _check_anchor(self) -> None:
        """After the first synchronising backward, marked both ways: an anchor that marked before
        the loss's node (a nested backward) is dropped, and the loss's node marks every step."""
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
        self._start, self._data_before = start, self.seconds["data"]
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
        """The compute since :meth:`_compute_from` ends now (less the data and comm in it); now."""
        now = self._mark()
        self._stepping = False
        data = self.seconds["data"] - self._data_before
        if self._last_grad is not None:
            comm_start, self._last_grad = self._last_grad, None
            self._span("comm", comm_start, now)
        # the data and comm inside the span (every comm span is inside one) are taken out at the
        # window's end (on CUDA the host's data wait is device idle time)
        self._span("compute", self._start, now)
        self._data_in_compute += data
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
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.enabled:
                self.seconds[name] += time.perf_counter() - start

    def row(self, wall: float, items: float) -> list[float]:
        """This rank's phases in the window that ends here, its ``wall`` seconds, samples and
        ``items`` (tokens), for the window's agreement to gather (:meth:`LossWindow.agree
        <ddpkit.training._step.LossWindow.agree>`). The window's counts start afresh. On CUDA,
        waits for the window's last event."""
        seconds = dict(self.seconds)
        if self._cuda:
            torch.cuda.current_stream().synchronize()
            for phase, spans in self._spans.items():
                seconds[phase] += sum(a.elapsed_time(b) for a, b in spans) / 1000
                spans.clear()
            self._events += self._used
            self._used = []
        seconds["compute"] -= seconds["comm"] + self._data_in_compute
        self._data_in_compute = 0.0
        local = [seconds[p] for p in PHASES] + [wall, float(self.samples), float(items)]
        # in place: the loader's pass holds this dict
        self.seconds.update(dict.fromkeys(PHASES, 0.0))
        self.samples = 0
        return local


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
    """A window's phases per rank in ms per step (lists in rank order); all ranks' samples."""

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
    """The run's slowest rank over all its windows: phase ms summed per rank, and the windows each
    named slow."""

    def __init__(self) -> None:
        self.phases: dict[str, list[float]] = {}
        self.step_ms: list[float] = []
        self.slow_windows: dict[int, int] = {}
        self.windows = 0

    def add(self, times: RankTimes, steps: int) -> None:
        if not self.step_ms:
            self.phases = {p: [0.0] * len(times.step_ms) for p in PHASES}
            self.step_ms = [0.0] * len(times.step_ms)
        for r in range(len(self.step_ms)):
            self.step_ms[r] += times.step_ms[r] * steps
            for p in PHASES:
                self.phases[p][r] += times.ms[p][r] * steps
        self.windows += 1
        slowest = times.slowest()
        if slowest.slow:
            self.slow_windows[slowest.rank] = self.slow_windows.get(slowest.rank, 0) + 1

    def summary(self) -> str | None:
        """A line for the run's summary: the slowest rank over the run, its excess and phase; None
        for fewer than 2 ranks."""
        if len(self.step_ms) < 2:
            return None
        total = RankTimes(
            ms=self.phases, step_ms=self.step_ms, wall=0.0, samples=0.0, items=0.0
        ).slowest()
        windows = f"slow in {self.slow_windows.get(total.rank, 0)} of {self.windows} windows"
        if total.slow:
            return (
                f"  slowest rank {total.rank}: {total.ratio:.2f}x the other ranks' median busy "
                f"time, mostly {total.phase}; {windows}"
            )
        return (
            f"  ranks even (busiest: rank {total.rank}, {total.ratio:.2f}x the other ranks' "
            f"median busy time); {windows}"
        )


# Dense tensor-core peaks in TFLOPS (fp16 and bf16 with fp32 accumulation) from the vendors'
# datasheets, "with sparsity" figures halved: H100 and H200 (SXM, PCIe, NVL), A100, L4, A10 (for
# AWS's A10G), V100, T4; the RTX 4090 and 3090 from NVIDIA's Ada and GA102 whitepapers. Without
# TF32 (Volta, Turing) fp32 matmuls run at the fp32 peak; without bf16, no MFU.
_PEAKS: list[tuple[str, dict[str, float]]] = [
    (r"H100.*PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"H100.*NVL|H200.*NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (r"H100|H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10G\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"V100.*PCIE", {"fp16": 112.0, "tf32": 14.0, "fp32": 14.0}),
    (r"V100", {"fp16": 125.0, "tf32": 15.7, "fp32": 15.7}),
    (r"\bT4\b", {"fp16": 65.0, "tf32": 8.1, "fp32": 8.1}),
    (r"RTX 4090(?! ?[Dd])", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    (r"RTX 3090(?! ?Ti)", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
]


def peak_flops(device_name: str, dtype: str) -> float | None:
    """The dense peak FLOP/s of the GPU named ``device_name`` for matmuls in ``dtype`` (``"bf16"``,
    ``"fp16"``, ``"tf32"`` or ``"fp32"``); None for a device or dtype not in the table."""
    for pattern, peaks in _PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            peak = peaks.get(dtype)
            return None if peak is None else peak * 1e12  # TFLOPS
    return None


def device_peak(device: torch.device, precision: str) -> float | None:
    """The peak FLOP/s of ``device`` at ``TrainerConfig.precision`` (fp32 matmuls in TF32 where
    allowed); None on the CPU or a GPU not in the table."""
    if device.type != "cuda":
        return None
    if precision not in ("bf16", "fp16"):
        precision = "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return peak_flops(torch.cuda.get_device_name(device), precision)


def _attention(query: Any, key: Any, value: Any, *_args: Any, **_kwargs: Any) -> int:
    return sdpa_flop_count(query, key, value)


def _attention_backward(_grad: Any, query: Any, key: Any, value: Any, *_a: Any, **_k: Any) -> int:
    return 2 * sdpa_flop_count(query, key, value)


# The standard count for the CPU's fused attention kernels, which ``FlopCounterMode`` counts nothing
# for before torch 2.15 (its ``custom_mapping``): the forward's two batched matmuls over every pair
# of positions, masked ones included, and twice that for the backward, the unfused path's four
# (torch's own backward formula, used on CUDA, counts the scores' recomputation as a fifth).
ATTENTION: dict[Any, Any] = {
    op: formula
    for op, formula in zip(cpu_attention_ops(), (_attention, _attention_backward))
    if op is not None
}


@dataclass
class Aside:
    """Work of a window set aside (:meth:`Speed.aside`)."""

    seconds: float = 0.0
    """How long the work set aside took (known once it is done)."""


class Speed:
    """A run's speed, measured on every rank and gathered at each log window. With a peak
    (``peak_flops``, else the table's), the first micro-batch's FLOPs are counted once and MFU is
    reported; ``compiled``: no MFU (counting would run the first step eagerly)."""

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
        self.flops_per_sample: float | None = None
        """From the first micro-batch's forward and backward (:meth:`counting`)."""
        self.to_count = self.peak is not None
        """The next micro-batch's FLOPs are to be counted: the first one's, once a peak is known."""
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
        return self._count(batch_len(batch))

    @contextmanager
    def _count(self, samples: int) -> Iterator[None]:
        with FlopCounterMode(display=False, custom_mapping=ATTENTION) as counter:
            yield
        self.flops_per_sample = counter.get_total_flops() / samples or None

    def row(self, wall: float, items: float | None) -> list[float]:
        """This rank's phases in the window ending here, for the window's agreement to gather;
        empty when off. ``items``: this rank's items (tokens) in the window's steps, under
        ``count_fn``."""
        return self.timings.row(wall, items or 0.0) if self.enabled else []

    def times(self, table: list[list[float]], wall: float, steps: int) -> RankTimes | None:
        """Every rank's :meth:`row` (in rank order), per step of a window of ``steps`` steps; None
        when off."""
        if not self.enabled:
            return None
        per_step = 1000 / max(steps, 1)
        times = RankTimes(
            ms={p: [row[i] * per_step for row in table] for i, p in enumerate(PHASES)},
            step_ms=[row[len(PHASES)] * per_step for row in table],
            wall=wall,
            samples=sum(row[len(PHASES) + 1] for row in table),
            items=sum(row[len(PHASES) + 2] for row in table),
        )
        if steps:
            self.run.add(times, steps)
        return times

    def rates(self, times: RankTimes, tokens: bool) -> dict[str, float]:
        """Samples (and tokens, with ``tokens``) a second over all ranks, and MFU where known."""
        seconds = max(times.wall, 1e-9)
        out = {"samples_per_s": times.samples / seconds}
        if tokens:
            out["tokens_per_s"] = times.items / seconds
        if self.flops_per_sample and self.peak:  # the FLOP/s the samples needed over the peak's
            out["mfu"] = (
                self.flops_per_sample * out["samples_per_s"] / (self.peak * self.world_size)
            )
        return out

    def close(self) -> None:
        self.timings.close()
