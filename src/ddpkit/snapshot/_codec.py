"""The one codec of a snapshot's values, for the disk and the memory alike: a value becomes a
tagged JSON *skeleton* whose tensors (and numpy arrays, as bytes) are set aside in a list and
referenced by index (:func:`encode`; :func:`decode` is its inverse, and never unpickles). The
types it holds: docs/snapshots.md ("What a snapshot can hold"); anything else raises
:class:`UnsupportedValue` at the save. A slot's or a blob's tensors lie raw in one byte region
(:class:`Spec`).
"""

from __future__ import annotations

import array
import base64
import collections
import contextlib
import datetime as dt
import decimal
import fractions
import hashlib
import io
import json
import math
import pathlib
import re
import struct
import sys
import uuid
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ddpkit._errors import ConfigError
from ddpkit.distributed._collectives import tensor_bytes

FORMAT = 3
"""The format of a disk snapshot's value files; a file of another is refused by name."""

_INT64 = 1 << 63
MAX_DEPTH = 100
"""How deep containers may nest in a value (a list in a dict is 2 deep), counted alike on saving and
loading, so that a save never writes what a load cannot read."""
_DEEP = "a value nested less deeply, whose containers do not hold themselves"
_CONTAINERS = frozenset({
    dict, list, tuple, set, frozenset, collections.OrderedDict, collections.defaultdict,
    collections.Counter, collections.deque,
})  # fmt: skip
"""What nests, on saving: what :data:`_CONTAINER_TAGS` tags."""
_CONTAINER_TAGS = frozenset({"m", "d", "u", "l", "o", "dd", "ct", "s", "fs", "q"})
_NAN = struct.pack(">d", float("nan"))
_FACTORIES = {
    f.__name__: f
    for f in (list, dict, set, frozenset, tuple, int, float, complex, str, bytes, bool)
}
_PATHS = {
    c.__name__: c
    for c in (
        pathlib.PosixPath,
        pathlib.WindowsPath,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
    )
}
_TORCH_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


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
        # 0 before a product of the other sizes, which a manifest may make large
        return 0 if 0 in self.shape else math.prod(self.shape) * DTYPES[self.dtype].itemsize


def capped_numel(sizes: Sequence[int], cap: int) -> int:
    """The product of ``sizes``, or ``cap + 1`` once past ``cap`` (else it takes quadratic time)."""
    if 0 in sizes:
        return 0
    n = 1
    for s in sizes:
        n *= s
        if n > cap:
            return cap + 1
    return n


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
    whole and aligned inside a data region of ``region_size`` bytes before anything views it;
    ``ValueError`` naming the first that does not."""
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
        if offset + capped_numel(shape, region_size) * DTYPES[dtype].itemsize > region_size:
            raise ValueError(
                f"tensor {i} ({dtype}{str(shape)[:80]} at {offset}) lies past the end of the data "
                f"region ({region_size} bytes)"
            )
        specs.append(Spec(dtype, tuple(shape), offset))
    return specs


def views(region: torch.Tensor, specs: Sequence[Spec]) -> list[torch.Tensor]:
    """Tensors that view ``region`` (uint8) at each spec's place."""
    return [
        region[s.offset : s.offset + s.nbytes].view(DTYPES[s.dtype]).view(s.shape) for s in specs
    ]


class UnsupportedValue(ConfigError):
    """A value a snapshot cannot hold; the message names where it is and what to do."""


class FormatError(ValueError):
    """A value file of another format than :data:`FORMAT`."""


class _Refused(Exception):
    def __init__(self, value: Any, why: str = "", advice: str = "") -> None:
        self.value, self.why, self.advice = value, why, advice


def _b64(data: bytes | bytearray) -> str:
    return base64.b64encode(data).decode("ascii")


def _pairs(items: Any, tensors: list[torch.Tensor], d: int) -> list[list[Any]]:
    return [[_enc(k, tensors, d), _enc(v, tensors, d)] for k, v in items]


def _tz(tz: Any, value: Any) -> Any:
    if tz is None:
        return None
    if type(tz) is dt.timezone:
        offset, name = tz.utcoffset(None), tz.tzname(None)
        named = None if name == dt.timezone(offset).tzname(None) else name
        return ["tz", offset.days, offset.seconds, offset.microseconds, named]
    zoneinfo = sys.modules.get("zoneinfo")
    if zoneinfo is not None and type(tz) is zoneinfo.ZoneInfo and tz.key is not None:
        return ["zi", tz.key]
    raise _Refused(value, f" with a tzinfo of type {type(tz).__name__}")


def _clock(v: Any) -> list[Any]:
    """A datetime's or a time's hour, minute, second, microsecond, fold and zone."""
    return [v.hour, v.minute, v.second, v.microsecond, v.fold, _tz(v.tzinfo, v)]


def _defaultdict(v: Any, t: list[torch.Tensor], d: int) -> Any:
    factory = v.default_factory
    name = "" if factory is None else getattr(factory, "__name__", "?")
    if factory is not None and _FACTORIES.get(name) is not factory:
        raise _Refused(v, f" whose default_factory is {name}, not a builtin type", "a dict")
    return {"dd": [name, _pairs(v.items(), t, d)]}


_ENCODERS: dict[type, Any] = {
    complex: lambda v, t, d: {"c": [_float(v.real), _float(v.imag)]},
    bytes: lambda v, t, d: {"b": _b64(v)},
    bytearray: lambda v, t, d: {"ba": _b64(v)},
    collections.OrderedDict: lambda v, t, d: {"o": _pairs(v.items(), t, d)},
    collections.defaultdict: _defaultdict,
    collections.Counter: lambda v, t, d: {"ct": _pairs(v.items(), t, d)},
    set: lambda v, t, d: {"s": [_enc(x, t, d) for x in v]},
    frozenset: lambda v, t, d: {"fs": [_enc(x, t, d) for x in v]},
    collections.deque: lambda v, t, d: {"q": [v.maxlen, [_enc(x, t, d) for x in v]]},
    range: lambda v, t, d: {"r": [_enc(v.start, t, d), _enc(v.stop, t, d), _enc(v.step, t, d)]},
    **{c: (lambda v, t, d: {"p": [type(v).__name__, str(v)]}) for c in _PATHS.values()},
    dt.datetime: lambda v, t, d: {"DT": [v.year, v.month, v.day, *_clock(v)]},
    dt.date: lambda v, t, d: {"D": [v.year, v.month, v.day]},
    dt.time: lambda v, t, d: {"T": _clock(v)},
    dt.timedelta: lambda v, t, d: {"TD": [v.days, v.seconds, v.microseconds]},
    decimal.Decimal: lambda v, t, d: {"dec": str(v)},
    fractions.Fraction: lambda v, t, d: {
        "fr": [_enc(v.numerator, t, d), _enc(v.denominator, t, d)]
    },
    uuid.UUID: lambda v, t, d: {"uuid": v.hex},
    torch.dtype: lambda v, t, d: {"dt": str(v)},
    torch.device: lambda v, t, d: {"dv": str(v)},
    torch.Size: lambda v, t, d: {"sz": list(v)},
}


def _tensor(value: torch.Tensor, tensors: list[torch.Tensor]) -> Any:
    kind = type(value)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        raise _Refused(
            value, " (a subclass of torch.Tensor)", "a plain tensor (.as_subclass(torch.Tensor))"
        )
    if value.layout is not torch.strided or value.device.type == "meta":
        raise _Refused(
            value, f" of layout {value.layout} on {value.device}", "a dense tensor (.to_dense())"
        )
    if str(value.dtype) not in DTYPES:
        raise _Refused(value, f" of dtype {value.dtype}", "a tensor of another dtype")
    tensors.append(value)
    if kind is torch.nn.Parameter:
        return {"P": [len(tensors) - 1, value.requires_grad]}
    return {"t": len(tensors) - 1}


def _dtype_name(dtype: Any) -> str:
    # by its character: 'q' (longlong) and 'l' (int64) are both '<i8', of two scalar types
    return dtype.str if dtype.kind in "mMUS" else dtype.str[0] + dtype.char


def _numpy_value(value: Any, np: Any, tensors: list[torch.Tensor]) -> Any:
    dtype = value.dtype
    scalar = isinstance(value, np.generic)
    # an empty str_ or bytes_ is of itemsize 0; an array of itemsize 0 has no bytes to hold
    if dtype.kind not in "biufcmMUS" or (dtype.itemsize == 0 and not scalar):
        raise _Refused(value, f" of dtype {dtype}")
    if scalar:
        return {"n": [_dtype_name(dtype), value.tobytes().hex()]}
    if type(value) is not np.ndarray:
        raise _Refused(value, " (a subclass of numpy.ndarray)", "a plain array (numpy.asarray)")
    fortran = value.ndim > 1 and value.flags.f_contiguous and not value.flags.c_contiguous
    flat = np.ascontiguousarray(value.T if fortran else value).reshape(-1).view(np.uint8)
    tensors.append(torch.from_numpy(flat if flat.flags.writeable else flat.copy()))
    return {"a": [len(tensors) - 1, _dtype_name(dtype), list(value.shape), "F" if fortran else "C"]}


def _float(value: float) -> Any:
    # JSON's NaN is one NaN: another (its sign, its payload) is kept by its bits.
    if value == value or struct.pack(">d", value) == _NAN:
        return value
    return {"f": struct.pack(">d", value).hex()}


def _enc(value: Any, tensors: list[torch.Tensor], depth: int = 0) -> Any:
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return value
    if kind is float:
        return value if value == value else _float(value)
    if kind is int:  # JSON holds any int, but python reads back at most 4300 digits
        return value if -_INT64 <= value < _INT64 else {"I": hex(value)}
    if depth >= MAX_DEPTH and kind in _CONTAINERS:  # containers alone count: _dec counts alike
        raise _Refused(value, f" nested more than {MAX_DEPTH} levels deep", _DEEP)
    d = depth + 1
    if kind is dict:
        if all(type(k) is str for k in value):
            return {"m": {k: _enc(v, tensors, d) for k, v in value.items()}}
        return {"d": _pairs(value.items(), tensors, d)}
    if kind is tuple or kind is list:
        # Python's RNG state is a tuple of 625 ints: packed as one int64 tensor
        if len(value) >= 32 and set(map(type, value)) == {int}:
            with contextlib.suppress(OverflowError):  # an int beyond int64: one by one
                tensors.append(torch.frombuffer(array.array("q", value), dtype=torch.int64))
                return {"i": [len(tensors) - 1, kind is tuple]}
        return {"u" if kind is tuple else "l": [_enc(x, tensors, d) for x in value]}
    if isinstance(value, torch.Tensor):
        return _tensor(value, tensors)
    encoder = _ENCODERS.get(kind)
    if encoder is not None:
        return encoder(value, tensors, d)
    # a numpy value exists only where numpy is imported: never imported here
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, (np.generic, np.ndarray)):
        return _numpy_value(value, np, tensors)
    raise _Refused(value)


def _children(value: Any) -> list[tuple[str, Any]]:
    """``(how to name it, child)`` for each value inside a container, in :func:`_enc`'s order."""
    kind = type(value)
    if kind in (dict, collections.OrderedDict, collections.defaultdict, collections.Counter):
        out = []
        for k, v in value.items():
            name = f".{k}" if type(k) is str else f"[{k!r:.60}]"
            out += [(f"{name} (its key)", k), (name, v)]
        return out
    if kind in (list, tuple, collections.deque):
        return [(f"[{i}]", v) for i, v in enumerate(value)]
    if kind in (set, frozenset):
        return [(" (an element)", v) for v in value]
    return []


def _where(value: Any, target: Any, path: str) -> str | None:
    if value is target:
        return path
    for name, child in _children(value):
        found = _where(child, target, path + name)
        if found is not None:
            return found
    return None


def _advice(value: Any) -> str:
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):
        return "a tuple or a dict"
    if hasattr(type(value), "__dataclass_fields__"):
        return "a dict (dataclasses.asdict)"
    if any(c.__module__ == "enum" for c in type(value).__mro__):
        return "its .value"
    return "a list, a dict or a str"


def encode(value: Any, tensors: list[torch.Tensor], where: str = "") -> Any:
    """A JSON-able skeleton of ``value`` whose tensors are appended to ``tensors``, by index;
    :class:`UnsupportedValue` naming the first value it cannot hold, as a path under ``where``."""
    try:
        return _enc(value, tensors)
    except _Refused as refused:
        bad = refused.value
        at = (where + (_where(value, bad, "") or "")).lstrip(".") or "the state"
        kind = f"{type(bad).__module__}.{type(bad).__qualname__}".removeprefix("builtins.")
        raise UnsupportedValue(
            f"ddpkit: a snapshot cannot hold {at}, a {kind}{refused.why}: convert it in "
            f"state_dict(), e.g. to {refused.advice or _advice(bad)} (what a snapshot holds: "
            "docs/snapshots.md, 'What a snapshot can hold')"
        ) from None
    except RecursionError:
        raise UnsupportedValue(
            f"ddpkit: a snapshot cannot hold {where or 'the state'}: it is nested too deeply or "
            "holds itself"
        ) from None


def copied(value: Any, where: str = "") -> Any:
    """``value`` as a load gives it back, its tensors detached copies on the CPU: what a snapshot
    keeps of a state that goes on changing. Refuses what :func:`encode` refuses."""
    tensors: list[torch.Tensor] = []
    skeleton = encode(value, tensors, where)
    return decode(skeleton, [t.detach().to("cpu", copy=True) for t in tensors])


def fingerprint(value: Any) -> str:
    """A text of ``value`` that two values share exactly when they are equal, in any process:
    tensors and arrays by every element, sets and dicts in a sorted order (a set's order changes
    with the hash seed), NaN equal to itself; a value the codec cannot hold, by type and repr."""
    tensors: list[torch.Tensor] = []
    try:
        skeleton = encode(value, tensors)
    except UnsupportedValue:
        # its repr, less the addresses a default repr shows (another in every process)
        shown = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))
        return f"<a {type(value).__module__}.{type(value).__qualname__}: {shown}>"
    return json.dumps(_canonical(skeleton, tensors), sort_keys=True)


def _canonical(s: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(s, list):
        return [_canonical(x, tensors) for x in s]
    if not isinstance(s, dict):
        return s
    ((tag, body),) = s.items()
    if tag == "m":  # str keys: json.dumps sorts them
        return {tag: {k: _canonical(v, tensors) for k, v in body.items()}}
    if tag in ("t", "P", "a", "i"):  # a tensor's (or array's, packed ints') index: its contents
        index = body if tag == "t" else body[0]
        t = alone(tensors[index]).cpu()
        raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
        data = tensor_bytes(raw)
        # the values, to be read in a refusal, where they are few and of a kind JSON holds
        shown: Any = hashlib.sha256(data).hexdigest()
        if t.numel() <= 16 and not t.is_complex():
            try:
                shown = t.tolist()
            except (TypeError, RuntimeError):  # bit and quantized dtypes
                pass
        exact = "" if isinstance(shown, str) else data.hex()  # the hash, or the bits themselves
        contents = [str(t.dtype), list(t.shape), shown, exact]
        return {tag: contents if tag == "t" else [contents, *body[1:]]}
    if tag in ("s", "fs"):  # in the order of their texts
        return {tag: sorted((_canonical(x, tensors) for x in body), key=_text)}
    if tag in ("d", "ct", "dd"):  # dicts compare without their order
        pairs = body[1] if tag == "dd" else body
        ordered = sorted((_canonical(p, tensors) for p in pairs), key=_text)
        return {tag: [body[0], ordered] if tag == "dd" else ordered}
    return {tag: _canonical(body, tensors)}


def _text(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _numpy() -> Any:
    try:
        import numpy
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "this snapshot holds numpy values (a numpy generator's state, arrays): reading it "
            "needs numpy "
            '(pip install "ddpkit[examples]" or numpy)'
        ) from None
    return numpy


def _index(body: Any, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if type(body) is not int or not 0 <= body < len(tensors):
        raise ValueError(f"a tensor index {str(body)[:20]} out of range")
    return tensors[body]


def _untz(raw: Any) -> Any:
    if raw is None:
        return None
    if raw[0] == "tz":
        offset = dt.timedelta(raw[1], raw[2], raw[3])
        return dt.timezone(offset, raw[4]) if raw[4] is not None else dt.timezone(offset)
    if raw[0] == "zi" and type(raw[1]) is str:
        import zoneinfo

        return zoneinfo.ZoneInfo(raw[1])
    raise ValueError("an unknown time zone")


def _array(body: Any, tensors: Sequence[torch.Tensor]) -> Any:
    np = _numpy()
    index, dtype_str, shape, order = body
    raw, dtype = _index(index, tensors), np.dtype(dtype_str)
    if (
        dtype.kind not in "biufcmMUS"
        or dtype.itemsize == 0
        or raw.dtype != torch.uint8
        or order not in "CF"
    ):
        raise ValueError(f"an array of dtype {dtype_str!r:.40} that no save writes")
    flat = raw.detach().cpu().reshape(-1).numpy().view(dtype)
    if order == "F":
        return flat.reshape(shape[::-1]).T.copy(order="K")
    return flat.reshape(shape).copy()


def _dec(s: Any, tensors: Sequence[torch.Tensor], depth: int = 0) -> Any:
    if not isinstance(s, dict):
        if isinstance(s, list):
            raise ValueError("an untagged list")
        return s
    ((tag, body),) = s.items()
    if tag == "f":  # a NaN other than JSON's
        return struct.unpack(">d", bytes.fromhex(body))[0]
    if depth >= MAX_DEPTH and tag in _CONTAINER_TAGS:
        raise ValueError(f"values nested more than {MAX_DEPTH} levels deep, which no save writes")
    d = depth + 1
    if tag == "m":
        return {k: _dec(v, tensors, d) for k, v in body.items()}
    if tag == "t":
        return _index(body, tensors)
    if tag == "u":
        return tuple(_dec(x, tensors, d) for x in body)
    if tag == "l":
        return [_dec(x, tensors, d) for x in body]
    if tag == "d":
        return dict(_decoded_pairs(body, tensors, d))
    if tag == "i":
        packed = _index(body[0], tensors)
        if packed.dtype != torch.int64:
            raise ValueError("packed ints that are not int64")
        return tuple(packed.tolist()) if body[1] else packed.tolist()
    if tag == "n":
        np = _numpy()
        dtype = np.dtype(body[0])
        if dtype.kind not in "biufcmMUS" or (dtype.itemsize == 0 and dtype.kind not in "US"):
            raise ValueError(f"a numpy scalar of dtype {body[0]!r:.40} that no save writes")
        if dtype.itemsize == 0:
            return dtype.type()  # '' of str_ or bytes_
        return np.frombuffer(bytes.fromhex(body[1]), dtype=dtype)[0]
    if tag == "a":
        return _array(body, tensors)
    if tag == "P":
        return torch.nn.Parameter(_index(body[0], tensors), requires_grad=bool(body[1]))
    decoder = _DECODERS.get(tag)
    if decoder is None:
        raise ValueError(f"an unknown tag {tag!r:.20}")
    return decoder(body, tensors, d)


HASH_COLLISIONS = 64
"""Keys of one set or dict sharing a hash, at most: a table of n keys of one hash takes n x n
steps to build (integers k x (2**61 - 1), which Python hashes alike, would hold a resume)."""


def _decoded_pairs(body: Any, tensors: Sequence[torch.Tensor], d: int) -> list[tuple[Any, Any]]:
    return _distinct_hashes([(_dec(k, tensors, d), _dec(v, tensors, d)) for k, v in body])


def _distinct_hashes(pairs: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """``pairs``, refused where more than :data:`HASH_COLLISIONS` of their keys share hashes."""
    if len(pairs) > HASH_COLLISIONS and len(pairs) - len({hash(k) for k, _ in pairs}) > (
        HASH_COLLISIONS
    ):
        raise ValueError(
            f"a set or dict of {len(pairs)} keys, many of one hash, which no save writes"
        )
    return pairs


def _datetime(body: Any) -> dt.datetime:
    year, month, day, hour, minute, second, micro, fold, tz = body
    return dt.datetime(year, month, day, hour, minute, second, micro, tzinfo=_untz(tz), fold=fold)


def _time(body: Any) -> dt.time:
    hour, minute, second, micro, fold, tz = body
    return dt.time(hour, minute, second, micro, tzinfo=_untz(tz), fold=fold)


def _keys(body: Any, tensors: Sequence[torch.Tensor], d: int) -> list[Any]:
    return [k for k, _ in _distinct_hashes([(_dec(x, tensors, d), None) for x in body])]


_DECODERS: dict[str, Any] = {  # the inverse of _ENCODERS: (body, tensors, depth) -> value
    "I": lambda b, t, d: int(b, 16),
    "c": lambda b, t, d: complex(_dec(b[0], t, d), _dec(b[1], t, d)),
    "b": lambda b, t, d: base64.b64decode(b, validate=True),
    "ba": lambda b, t, d: bytearray(base64.b64decode(b, validate=True)),
    "o": lambda b, t, d: collections.OrderedDict(_decoded_pairs(b, t, d)),
    "dd": lambda b, t, d: collections.defaultdict(
        _FACTORIES[b[0]] if b[0] else None, _decoded_pairs(b[1], t, d)
    ),
    "ct": lambda b, t, d: collections.Counter(dict(_decoded_pairs(b, t, d))),
    "s": lambda b, t, d: set(_keys(b, t, d)),
    "fs": lambda b, t, d: frozenset(_keys(b, t, d)),
    "q": lambda b, t, d: collections.deque((_dec(x, t, d) for x in b[1]), b[0]),
    "r": lambda b, t, d: range(*(_dec(x, t, d) for x in b)),
    "p": lambda b, t, d: _PATHS[b[0]](b[1]),
    "DT": lambda b, t, d: _datetime(b),
    "D": lambda b, t, d: dt.date(*b),
    "T": lambda b, t, d: _time(b),
    "TD": lambda b, t, d: dt.timedelta(*b),
    "dec": lambda b, t, d: decimal.Decimal(b),
    "fr": lambda b, t, d: fractions.Fraction(_dec(b[0], t, d), _dec(b[1], t, d)),
    "uuid": lambda b, t, d: uuid.UUID(hex=b),
    "dt": lambda b, t, d: _TORCH_DTYPES[b],
    "dv": lambda b, t, d: torch.device(b),
    "sz": lambda b, t, d: torch.Size(b),
}


def decode(skeleton: Any, tensors: Sequence[torch.Tensor]) -> Any:
    """The inverse of :func:`encode`; a skeleton that no save writes raises one of
    :data:`MALFORMED` (and never runs code)."""
    try:
        return _dec(skeleton, tensors)
    # Fraction(1, 0), Decimal("x"), torch.device("x")
    except (ArithmeticError, RuntimeError, OSError) as err:
        raise ValueError(
            f"a value that no save writes ({type(err).__name__}: {str(err)[:80]})"
        ) from None


MALFORMED = (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError)
"""What :func:`decode` (and reading a value file or a blob) raises for data that no save writes."""


def encode_blob(value: Any, where: str = "") -> bytes:
    """``value`` as one byte string (JSON skeleton and raw tensors): what ranks exchange."""
    tensors: list[torch.Tensor] = []
    skeleton = encode(value, tensors, where)
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
        raise ValueError(
            f"a blob's header says {n} bytes of description, and {len(data) - 8} follow"
        )
    head = json.loads(bytes(data[8 : 8 + n]))
    if not isinstance(head, dict) or "v" not in head:
        raise ValueError("a blob's description is malformed")
    region = (
        torch.frombuffer(bytearray(data[8 + n :]), dtype=torch.uint8)
        if len(data) > 8 + n
        else torch.empty(0, dtype=torch.uint8)
    )
    specs = checked_specs(head.get("s"), region.numel())
    return decode(head["v"], [v.clone() for v in views(region, specs)])


def alone(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor that owns exactly its bytes, a copy where it does not: torch.save writes a
    view's whole storage, and a storage of a part of an element makes a file torch.load refuses."""
    t = t.detach().resolve_conj().resolve_neg()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def file_bytes(skeleton: Any, tensors: Sequence[torch.Tensor]) -> bytes:
    """The contents of a value file: an encoded value (:func:`encode`) as ``torch.save`` of plain
    data (the format, the skeleton as JSON text, the tensors): ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    text = json.dumps(skeleton, separators=(",", ":"))
    torch.save({"format": FORMAT, "values": text, "tensors": [alone(t) for t in tensors]}, buffer)
    return buffer.getvalue()


def _stored_only(file: Path) -> None:
    """Refuse a value file with a compressed entry (``torch.save`` writes none)."""
    try:
        with zipfile.ZipFile(file) as archive:
            entries = archive.infolist()
    except zipfile.BadZipFile:
        return  # not a zip archive: torch.load says what it is
    size = file.stat().st_size
    for entry in entries:
        if entry.compress_type != zipfile.ZIP_STORED or entry.file_size > size:
            raise FormatError(
                f"its entry {entry.filename[:80]!r} is compressed ({entry.compress_size} bytes "
                f"that inflate to {entry.file_size}), which no save writes"
            )


def read_file(file: Path, map_location: Any = None) -> Any:
    """The value that :func:`file_bytes` wrote to ``file``. Raises ``pickle.UnpicklingError`` where
    the file holds anything but plain data (nothing of it is unpickled), :class:`FormatError` for a
    file of another format, and one of :data:`MALFORMED` for one whose values no save writes."""
    _stored_only(file)
    saved = torch.load(file, map_location=map_location, weights_only=True)
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        found = saved.get("format") if isinstance(saved, dict) else None
        raise FormatError(f"format {found}" if type(found) is int else "no format number")
    tensors = saved.get("tensors")
    if not isinstance(saved.get("values"), str) or not isinstance(tensors, list):
        raise ValueError("its values are not a skeleton and tensors")
    return decode(json.loads(saved["values"]), tensors)
