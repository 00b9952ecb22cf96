"""Attention's FLOPs on the CPU, and the phases of a step of several optimizers: no processes."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from ddpkit.demo import CHARS, TinyGPT
from ddpkit.tracking._speed import ATTENTION, PHASES, Speed, StepTimings

FUSED = "aten._scaled_dot_product_flash_attention_for_cpu"
# torch's counter has a formula of its own for the fused kernels from 2.15 on (another count than
# the standard one, which ddpkit's mapping keeps): the controls tell which torch they run on
TORCH_COUNTS_FUSED = any(str(op) == FUSED for op in flop_registry)


def _count(model: nn.Module, run: Any, *, math: bool, formula: bool = True) -> tuple[int, set]:
    """The FLOPs the counter gives ``run(model)``'s forward and backward, and the ops it counted;
    ``math``: attention on the unfused path; ``formula``: with ddpkit's formulas."""
    model.zero_grad()
    with (
        sdpa_kernel(SDPBackend.MATH) if math else contextlib.nullcontext(),
        FlopCounterMode(display=False, custom_mapping=ATTENTION if formula else None) as counter,
    ):
        run(model).sum().backward()
    return counter.get_total_flops(), {str(op) for op in counter.get_flop_counts()["Global"]}


@pytest.mark.parametrize(
    ("layers", "width", "heads", "length"), [(4, 64, 4, 64), (2, 32, 2, 16)], ids=["lm", "small"]
)
def test_attention_on_the_cpu_counts_the_standard_flops(layers, width, heads, length):
    """A small GPT (``examples/lm.py``'s defaults, and a smaller one) on the CPU, whose attention
    runs in the fused kernel: its FLOPs are the standard 6N + 12 x layers x heads x head dim x
    length a token (N: the matmuls' weights), what the counter gives the unfused (math) path, and
    what the run's :class:`Speed` counts. Control: without the formula the counter leaves attention
    out, 6N alone (0.861 of the count at the example's defaults)."""
    torch.manual_seed(0)
    model = TinyGPT(len(CHARS), length, width, layers, heads)
    tokens = torch.randint(0, len(CHARS), (3, length))
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    head_dim = width // heads
    standard = 3 * length * (6 * n + 12 * layers * heads * head_dim * length)

    def run(m: nn.Module) -> torch.Tensor:
        return m(tokens)

    fused, ops = _count(model, run, math=False)
    assert FUSED in ops and f"{FUSED}_backward" in ops  # the fused kernels ran
    math, math_ops = _count(model, run, math=True)
    assert "aten.bmm" in math_ops and FUSED not in math_ops
    assert fused == math == standard
    cpu = torch.device("cpu")
    speed = Speed(model, cpu, enabled=True, precision="fp32", world_size=1, peak_flops=1e12)
    with speed.counting(tokens):
        run(model).sum().backward()
    assert speed.flops_per_sample == standard / 3
    # Control: the counter's own mapping leaves the fused kernels out (where it has no formula).
    without, _ = _count(model, run, math=False, formula=False)
    if TORCH_COUNTS_FUSED:
        assert without > 3 * length * 6 * n  # attention counted, by torch's own formula
        return
    assert without == 3 * length * 6 * n < standard
    if (layers, width, heads, length) == (4, 64, 4, 64):
        assert without / standard == pytest.approx(0.861, abs=5e-4)


@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "options"),
    [
        ((2, 4, 5, 8), (2, 4, 5, 8), {"is_causal": True}),
        ((2, 4, 5, 8), (2, 4, 7, 8), {"attn_mask": torch.randn(5, 7)}),  # another length
        ((2, 4, 5, 8), (2, 2, 7, 8), {"enable_gqa": True}),  # 2 query heads a key head
    ],
    ids=["causal", "cross", "grouped"],
)
def test_the_fused_kernels_count_as_the_unfused_path(q_shape, kv_shape, options):
    """The formula against the unfused path's matmuls, where the fused kernel runs: causal (the
    mask hides half of the scores; both count all of them), keys of another length with a mask,
    and grouped-query attention."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g) for s in (q_shape, kv_shape, kv_shape))

    def run(_model: nn.Module) -> torch.Tensor:
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        return F.scaled_dot_product_attention(*inputs, **options)

    fused, ops = _count(nn.Module(), run, math=False)
    if FUSED not in ops:  # torch 2.6 runs grouped-query attention through the matmuls on the CPU
        pytest.skip(f"torch {torch.__version__} runs this attention unfused on the CPU")
    math, math_ops = _count(nn.Module(), run, math=True)
    assert FUSED not in math_ops
    assert fused == math > 0
    control = _count(nn.Module(), run, math=False, formula=False)[0]
    assert (control > 0) if TORCH_COUNTS_FUSED else (control == 0)  # without ddpkit's formula


PAUSE = 0.2


class _SlowBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps PAUSE, before any parameter's gradient is ready."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        time.sleep(PAUSE)
        return grad


def _step_of_two(timings: StepTimings, marked: bool) -> tuple[dict[str, float], float]:
    """One step of two models, as a GAN's step function runs it: per model a backward that sleeps
    PAUSE before its gradients are ready (compute) and queues a wait of PAUSE after them, where DDP
    waits for its all-reduce (comm); then its optimizer step, which sleeps PAUSE (optimizer); then
    PAUSE more of the step's own work (compute). ``marked``: the step's marks as a ``step_fn``'s
    step gives them; else only its start, as before. Returns the phases and the step's time."""
    from ddpkit._internals.compiler import at_backward_end

    def queue_the_wait(_grad: torch.Tensor) -> None:
        at_backward_end(lambda: time.sleep(PAUSE))

    models = [nn.Linear(4, 1), nn.Linear(4, 1)]
    start = time.perf_counter()
    timings.start_step()
    for model in models:
        out = model(_SlowBackward.apply(torch.randn(2, 4, requires_grad=True)))
        out.register_hook(queue_the_wait)
        loss = out.square().mean()
        if marked:
            timings.sync_backward(loss)
        loss.backward()
        if marked:
            timings.backward_returned()
            timings.before_optimizer()
        time.sleep(PAUSE)  # the optimizer step
        if marked:
            timings.after_optimizer(more=True)
        time.sleep(PAUSE)  # the step function's own work after it
    if marked:
        timings.end_step()
    seconds = time.perf_counter() - start
    return dict(zip(PHASES, timings.row(wall=seconds, items=0.0))), seconds


@pytest.mark.parametrize("marked", [True, False], ids=["marked", "control"])
def test_a_step_of_several_optimizers_puts_each_wait_in_its_phase(marked):
    """Two backwards, two optimizer steps and the work between them: each PAUSE in its phase
    (compute 4, comm 2, optimizer 2), the phases together within the step's time. Control: the
    step's start alone, as a ``step_fn``'s step marked it before, records no phase at all."""
    timings = StepTimings(nn.Linear(4, 1), torch.device("cpu"))
    seconds, total = _step_of_two(timings, marked)
    if not marked:
        assert all(v == 0 for v in seconds.values()), seconds
        return
    assert seconds["compute"] >= 4 * PAUSE, seconds
    assert seconds["comm"] >= 2 * PAUSE, seconds
    assert seconds["optimizer"] >= 2 * PAUSE, seconds
    assert sum(seconds[p] for p in PHASES) <= total, (seconds, total)
