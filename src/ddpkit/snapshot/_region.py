"""Tensors laid out raw in one byte region: each at an aligned offset, described by its dtype, shape
and offset (a :class:`Spec`). A memory snapshot's slot holds its tensors so, and so does a blob of
:mod:`ddpkit.snapshot._codec` (what ranks exchange).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ddpkit._errors import ConfigError

ALIGN = 64
"""Each tensor of a data region starts at a multiple of this many bytes."""


_NAMES = (
    "float64 float32 float16 bfloat16 int64 int32 int16 int8 uint64 uint32 uint16 uint8 bool "
    "complex128 complex64 complex32 float8_e4m3fn float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz "
    "float8_e8m0fnu float4_e2m1fn_x2 bits8 bits16 bits1x8 bits2x4 bits4x2"
)
DTYPES = {
    str(d): d for name in _NAMES.split() if isinstance(d := getattr(torch, name, None), torch.dtype)
}
"""The dtypes a region holds, by name: every dtype of the installed torch whose tensors can be
copied on the CPU (the sub-byte ``int1``..``uint7`` cannot, quantized ones are not plain bytes)."""


@dataclass(frozen=True)
class Spec:
    """Where one tensor lies in a data region."""

    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        if 0 in self.shape:  # before a product of the other sizes, which a manifest may make large
            return 0
        n = 1
        for s in self.shape:
            n *= s
        return n * DTYPES[self.dtype].itemsize


def layout(tensors: Sequence[torch.Tensor]) -> tuple[list[Spec], int]:
    """Each tensor's place in a data region (aligned, in order), and the region's size."""
    specs, offset = [], 0
    for t in tensors:
        if str(t.dtype) not in DTYPES:
            raise ConfigError(
                f"ddpkit: a snapshot cannot hold a tensor of dtype {t.dtype}: convert it to "
                "another dtype"
            )
        spec = Spec(str(t.dtype), tuple(t.shape), offset)
        specs.append(spec)
        offset += -(-spec.nbytes // ALIGN) * ALIGN
    return specs, offset


def checked_specs(raw: Any, region_size: int) -> list[Spec]:
    """The specs of a manifest or blob (``[[dtype, shape, offset], ...]``), each checked to lie
    whole and aligned inside a data region of ``region_size`` bytes before anything views it. Raises
    ``ValueError`` naming the first that does not: a slot's CRC-32s show a torn or flipped byte, not
    a manifest written to lie."""
    if not isinstance(raw, list):
        raise ValueError("its tensor layout is not a list")
    specs = []
    for i, item in enumerate(raw):
        if not (isinstance(item, list) and len(item) == 3):
            raise ValueError(f"tensor {i} of its layout is malformed")
        dtype, shape, offset = item
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ValueError(f"tensor {i} has an unknown dtype {str(dtype)[:40]!r}")
        if not isinstance(shape, list) or not all(type(n) is int and 0 <= n < 2**63 for n in shape):
            raise ValueError(f"tensor {i} has a shape that is not a list of sizes")
        if type(offset) is not int or offset < 0 or offset % ALIGN:
            raise ValueError(f"tensor {i} has an offset that is not an aligned position")
        # The product stops once past the region: one of thousands of large sizes costs quadratic
        # time.
        nbytes = 0 if 0 in shape else DTYPES[dtype].itemsize
        for n in shape if nbytes else ():
            nbytes *= n
            if nbytes > region_size:
                break
        if offset + nbytes > region_size:
            raise ValueError(
                f"tensor {i} ({dtype}{str(shape)[:80]} at {offset}) lies past the end of the data "
                f"region ({region_size} bytes)"
            )
        spec = Spec(dtype, tuple(shape), offset)
        specs.append(spec)
    return specs


def views(region: torch.Tensor, specs: Sequence[Spec]) -> list[torch.Tensor]:
    """Tensors that view ``region`` (uint8) at each spec's place."""
    return [
        region[s.offset : s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape) for s in specs
    ]
