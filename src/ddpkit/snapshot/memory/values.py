"""Values of a snapshot in memory without pickle: a JSON skeleton whose tensors are laid out raw.

Nothing a slot holds is unpickled on resume (a slot file is as trusted as the memory folder, and pickle runs
code): containers are tagged in the JSON (:func:`flatten`) so that tuples stay tuples (``random.setstate``
refuses a list), dict keys keep their types and numpy scalars and arrays come back as they were. A long tuple
of ints (python's RNG state) goes into the data region as int64.
"""

from __future__ import annotations

import array
import json
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ddpkit.distributed.collectives import tensor_bytes

ALIGN = 64
"""Each tensor of a data region starts at a multiple of this many bytes."""


class UnsupportedValue(TypeError):
    """A value of the state that :func:`flatten` cannot write without pickle."""


DTYPES = {
    str(d): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    )
}


def flatten(value: Any, tensors: list[torch.Tensor]) -> Any:
    """A JSON-able skeleton of ``value`` whose tensors are appended to ``tensors`` and referenced by index.

    Written here rather than with ``torch.save``: that costs ~200 us per call (its zip container), a tenth of a
    small model's step, where the snapshot's stall must stay within 5%. Containers are tagged, so that tuples
    stay tuples (``random.setstate`` refuses a list) and dict keys keep their types.
    """
    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"t": len(tensors) - 1}
    if kind is dict:
        if all(type(k) is str for k in value):
            return {"m": {k: flatten(v, tensors) for k, v in value.items()}}
        return {"d": [[flatten(k, tensors), flatten(v, tensors)] for k, v in value.items()]}
    if kind in (tuple, list):
        # Python's RNG state is a tuple of 625 ints: as one int64 tensor it costs a copy, not 625 JSON numbers.
        if len(value) >= 32 and set(map(type, value)) == {int}:
            try:
                packed = array.array("q", value)  # ~20x faster than torch.tensor(value) for 625 ints
            except OverflowError:
                packed = None
            if packed is not None:
                tensors.append(torch.frombuffer(packed, dtype=torch.int64))
                return {"i": [len(tensors) - 1, kind is tuple]}
        return {"u" if kind is tuple else "l": [flatten(x, tensors) for x in value]}
    np = sys.modules.get("numpy")  # a numpy value exists only where numpy is imported: never imported here
    if np is not None and isinstance(value, np.generic):
        return {"n": [value.dtype.str, value.item()]}
    if np is not None and isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        tensors.append(torch.from_numpy(np.ascontiguousarray(value).reshape(-1).view(np.uint8)))
        return {"a": [len(tensors) - 1, value.dtype.str, list(value.shape)]}
    if isinstance(value, torch.dtype):
        return {"dt": str(value)}
    raise UnsupportedValue(f"a value of type {kind.__name__} cannot go into a memory snapshot")


def _numpy() -> Any:
    try:
        import numpy
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "this memory snapshot holds numpy values (a numpy generator's state, arrays): reading it needs numpy "
            '(pip install "ddpkit[examples]" or numpy)'
        ) from None
    return numpy


def unflatten(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The inverse of :func:`flatten`."""
    if not isinstance(skeleton, dict):
        return skeleton
    ((tag, body),) = skeleton.items()
    if tag == "t":
        return tensors[body]
    if tag == "m":
        return {k: unflatten(v, tensors) for k, v in body.items()}
    if tag == "d":
        return {unflatten(k, tensors): unflatten(v, tensors) for k, v in body}
    if tag == "l":
        return [unflatten(x, tensors) for x in body]
    if tag == "u" and isinstance(body, list):
        return tuple(unflatten(x, tensors) for x in body)
    if tag == "i":
        values = tensors[body[0]].tolist()
        return tuple(values) if body[1] else values
    if tag == "n":
        return _numpy().dtype(body[0]).type(body[1])
    if tag == "a":
        index, dtype, shape = body
        return tensors[index].numpy().view(_numpy().dtype(dtype)).reshape(shape).copy()
    if tag == "dt":
        return DTYPES[body]
    raise ValueError(f"unknown tag {tag!r} in a memory snapshot")


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
            raise UnsupportedValue(f"a tensor of dtype {t.dtype} cannot go into a memory snapshot")
        spec = Spec(str(t.dtype), tuple(t.shape), offset)
        specs.append(spec)
        offset += -(-spec.nbytes // ALIGN) * ALIGN
    return specs, offset


def checked_specs(raw: Any, region_size: int) -> list[Spec]:
    """The specs of a manifest or blob (``[[dtype, shape, offset], ...]``), each checked to lie whole and aligned
    inside a data region of ``region_size`` bytes before anything views it. Raises ``ValueError`` naming the
    first that does not: a slot's CRC-32s show a torn or flipped byte, not a manifest written to lie."""
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
        # The product stops once past the region: one of thousands of large sizes costs quadratic time.
        nbytes = 0 if 0 in shape else DTYPES[dtype].itemsize
        for n in shape if nbytes else ():
            nbytes *= n
            if nbytes > region_size:
                break
        if offset + nbytes > region_size:
            raise ValueError(
                f"tensor {i} ({dtype}{str(shape)[:80]} at {offset}) lies past the end of the data region "
                f"({region_size} bytes)"
            )
        spec = Spec(dtype, tuple(shape), offset)
        specs.append(spec)
    return specs


def views(region: torch.Tensor, specs: Sequence[Spec]) -> list[torch.Tensor]:
    """Tensors that view ``region`` (uint8) at each spec's place."""
    return [region[s.offset : s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape) for s in specs]


def encode_blob(value: Any) -> bytes:
    """``value`` as one self-contained byte string (JSON skeleton and raw tensors): what ranks exchange."""
    tensors: list[torch.Tensor] = []
    skeleton = flatten(value, tensors)
    specs, size = layout(tensors)
    head = json.dumps({"v": skeleton, "s": [[s.dtype, s.shape, s.offset] for s in specs]}).encode()
    region = torch.zeros(size, dtype=torch.uint8)
    for dst, src in zip(views(region, specs), tensors):
        dst.copy_(src.detach())
    return struct.pack("<Q", len(head)) + head + tensor_bytes(region)


def decode_blob(data: bytes | memoryview) -> Any:
    """The inverse of :func:`encode_blob`; ``ValueError`` if ``data`` is not a whole blob."""
    if len(data) < 8:
        raise ValueError(f"a blob of {len(data)} bytes is shorter than its header")
    (n,) = struct.unpack_from("<Q", data)
    if 8 + n > len(data):
        raise ValueError(f"a blob's header says {n} bytes of description, and {len(data) - 8} follow")
    head = json.loads(bytes(data[8 : 8 + n]))
    if not isinstance(head, dict) or "v" not in head:
        raise ValueError("a blob's description is malformed")
    region = (
        torch.frombuffer(bytearray(data[8 + n :]), dtype=torch.uint8)
        if len(data) > 8 + n
        else torch.empty(0, dtype=torch.uint8)
    )
    specs = checked_specs(head.get("s"), region.numel())
    return unflatten(head["v"], [v.clone() for v in views(region, specs)])
