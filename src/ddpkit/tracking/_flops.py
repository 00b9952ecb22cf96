"""FLOPs per sample and the device's peak: what model FLOPs utilisation (MFU) is made of.

MFU = (the model's FLOPs per sample x samples a second) / (the peak FLOP/s of every device of the
job). The FLOPs of a sample are counted once, by :class:`torch.utils.flop_counter.FlopCounterMode`
over the first micro-batch's forward and backward of a run (matmuls, convolutions and attention, as
the counter counts; elementwise work is left out, as MFU conventionally does). The counter has no
formula for the CPU's fused attention kernels: :data:`ATTENTION` gives them the standard count. The
peak comes from the table below, by the device's name and the precision the matmuls run in; a
device not in it, and the CPU, get no MFU rather than a guess (``LoggingConfig.peak_flops`` gives
one's peak by hand).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from ddpkit._internals.compiler import cpu_attention_ops

_T = 1e12

# Dense (no structured sparsity) tensor-core peaks, FLOP/s, from the vendors' datasheets; fp16 and
# bf16 with fp32 accumulation (what PyTorch's matmuls use), fp32 without tensor cores. Where a card
# has no TF32 (Volta, Turing), fp32 matmuls run at the fp32 peak; where it has no bf16, bf16 is
# absent (no MFU).
#   H100 SXM / PCIe / NVL: NVIDIA H100 Tensor Core GPU datasheet (2023): bf16 989.4 / 756.5 / 835,
#     tf32 494.7 / 378 / 417.5, fp32 66.9 / 51.2 / 60 TFLOPS (the datasheet's "with sparsity"
#     figures halved).
#   H200 SXM / NVL: NVIDIA H200 datasheet (2024): as the H100 SXM / NVL (the same compute, more
#     memory).
#   A100 40GB and 80GB, SXM and PCIe: NVIDIA A100 datasheet: bf16 312, tf32 156, fp32 19.5 TFLOPS.
#   L4: NVIDIA L4 datasheet: bf16 121, tf32 60, fp32 30.3 TFLOPS (sparsity halved).
#   A10G: AWS's variant of the A10, with no datasheet of its own; the NVIDIA A10 datasheet's bf16
#     125, tf32 62.5, fp32 31.2 TFLOPS (sparsity halved).
#   V100 SXM2 / PCIe: NVIDIA V100 datasheet: fp16 125 / 112, fp32 15.7 / 14 TFLOPS.
#   T4: NVIDIA T4 datasheet: fp16 65, fp32 8.1 TFLOPS.
#   RTX 4090: NVIDIA Ada GPU architecture whitepaper, appendix: fp16/bf16 with fp32 accumulate
#     165.2, tf32 82.6, fp32 82.6 TFLOPS.
#   RTX 3090: NVIDIA Ampere GA102 GPU architecture whitepaper: fp16/bf16 with fp32 accumulate 71,
#     tf32 35.6, fp32 35.6 TFLOPS.
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
    """The dense peak FLOP/s of the GPU named ``device_name`` (``torch.cuda.get_device_name()``) for
    matmuls in ``dtype`` (``"bf16"``, ``"fp16"``, ``"tf32"`` or ``"fp32"``); None for a device or
    dtype not in the table."""
    for pattern, peaks in _PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            peak = peaks.get(dtype)
            return None if peak is None else peak * _T
    return None


def matmul_dtype(precision: str) -> str:
    """The dtype the matmuls of a run at ``TrainerConfig.precision`` run in: fp32 ones in TF32 where
    allowed."""
    if precision in ("bf16", "fp16"):
        return precision
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def device_peak(device: torch.device, precision: str) -> float | None:
    """The peak FLOP/s of ``device`` at ``precision``; None on the CPU and for a GPU not in the
    table."""
    if device.type != "cuda":
        return None
    return peak_flops(torch.cuda.get_device_name(device), matmul_dtype(precision))


def attention_flops(query: Any, key: Any, value: Any, *_args: Any, **_kwargs: Any) -> int:
    """The forward FLOPs of ``softmax(query @ key^T) @ value`` for shapes ``[batch, heads, length,
    head dim]`` (key and value may have fewer heads, shared by groups of the query's): two batched
    matmuls over every pair of positions, those a mask hides included (the standard count ignores
    causality)."""
    batch, heads, q_len, q_dim = query
    k_len, v_dim = key[-2], value[-1]
    # scores: [q_len, q_dim] @ [q_dim, k_len]; out: [q_len, k_len] @ [k_len, v_dim]
    return 2 * batch * heads * q_len * k_len * (q_dim + v_dim)


def attention_backward_flops(
    grad_out: Any, query: Any, key: Any, value: Any, *_args: Any, **_kwargs: Any
) -> int:
    """The backward FLOPs of :func:`attention_flops`'s product: twice the forward's, the four
    batched matmuls of the unfused backward (the scores' and the value's gradients from the
    output's, the query's and the key's from the scores'). A fused kernel also recomputes the
    scores, which is not the model's work."""
    return 2 * attention_flops(query, key, value)


ATTENTION: dict[Any, Any] = {
    op: formula
    for op, formula in zip(cpu_attention_ops(), (attention_flops, attention_backward_flops))
    if op is not None
}
"""Formulas for the fused attention kernels :class:`~torch.utils.flop_counter.FlopCounterMode`
counts nothing for (the CPU's), as its ``custom_mapping`` (called with the op's arguments as shapes,
as its own formulas are): the standard count, 6N + 12 x layers x heads x head dim x length a token,
which the unfused (math) path gives."""


class FlopCount:
    """The FLOPs of one micro-batch's forward and backward, counted once, and the samples they were
    for."""

    def __init__(self) -> None:
        self.flops: float | None = None
        self.samples = 0

    @property
    def per_sample(self) -> float | None:
        return self.flops / self.samples if self.flops and self.samples else None

    @contextmanager
    def counting(self, samples: int) -> Iterator[None]:
        """Count what runs inside (a forward and its backward) as the FLOPs of ``samples``
        samples."""
        with FlopCounterMode(display=False, custom_mapping=ATTENTION) as counter:
            yield
        self.flops, self.samples = float(counter.get_total_flops()), samples


def mfu(
    flops_per_sample: float | None, samples_per_s: float, peak: float | None, devices: int
) -> float | None:
    """Model FLOPs utilisation: the FLOP/s the samples needed over the peak of ``devices``
    devices."""
    if not flops_per_sample or not peak:
        return None
    return flops_per_sample * samples_per_s / (peak * devices)
