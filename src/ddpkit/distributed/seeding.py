"""Seeding and RNG state: identical model initialisation on every rank, and states a snapshot can restore."""

from __future__ import annotations

import hashlib
import random
import struct
import sys
from typing import Any, cast

import torch

from ddpkit.distributed.runtime import get_runtime

try:  # numpy is optional: seed and save it only when it is installed
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


def mix_seed(*values: int | str) -> int:
    """A 32-bit seed from several values, different for every combination.

    ``torch.Generator.manual_seed`` keeps only the low 32 bits of its argument, so packing ``(seed, epoch)`` as
    ``seed << 32 | epoch`` would ignore the seed; a hash spreads every input over those 32 bits.
    """
    digest = hashlib.blake2b(",".join(map(str, values)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


STREAMS = ("shuffle", "loader", "rank", "dropout", "reseed", "sample")
"""The random streams ddpkit derives from a run's seed, one name each:

- ``shuffle``: the sample order of an epoch, keyed by the epoch;
- ``loader``: the loader's generator (its workers' base seeds), keyed by the rank;
- ``rank``: each rank's global torch RNG after wrapping (dropout masks, augmentation in the main process);
- ``dropout``: :class:`~ddpkit.nn.dropout.GlobalBatchDropout` masks, keyed by (epoch, step);
- ``reseed``: a rank's streams after a resume at another world size, keyed by (step, rank);
- ``sample``: the random draws of one sample's loading (augmentation), keyed by (epoch, index): the same
  whichever rank or loader worker loads it, and however many there are.
"""


def stream_seed(stream: str, seed: int, *keys: int) -> int:
    """The seed of ``stream`` (one of :data:`STREAMS`) for ``keys``.

    The name is part of the hash, so two streams never share a seed, whatever their keys: with one unnamed
    mix, the loader's seed of rank ``r`` and the shuffle seed of epoch ``r`` were the same number.
    """
    if stream not in STREAMS:
        raise ValueError(f"unknown random stream {stream!r}: one of {STREAMS}")
    return mix_seed(stream, seed, *keys)


def seed_everything(seed: int, per_rank: bool = False, group: Any = None) -> int:
    """Seed python, numpy and torch (CPU and every CUDA device); return the seed used.

    The same seed on every rank makes model initialisation identical everywhere (DDP also broadcasts rank 0's
    weights when it wraps a model, but buffers created later and any randomness before wrapping still need it).
    ``per_rank=True`` adds the rank to the seed, so ranks draw different random streams: for reinforcement
    learning environments or per-rank augmentation.
    """
    if per_rank:
        seed = seed + get_runtime(group).rank
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


def _cuda_in_use() -> bool:
    """True when this process has initialised CUDA: then its generators draw, and are saved and seeded.

    Never initialises CUDA itself, and is False in a loader worker forked from a process that had (CUDA cannot
    be used there at all; touching it would raise).
    """
    return torch.cuda.is_initialized()


def rng_state() -> dict[str, Any]:
    """The RNG states of this process: python, numpy, torch CPU and each CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        # As plain values and a tensor, so a snapshot loads with torch.load(weights_only=True).
        legacy = np.random.get_state()
        assert isinstance(legacy, tuple)  # the global generator is a Mersenne Twister: the 5-tuple form
        kind, keys, pos, has_gauss, gauss = legacy
        state["numpy"] = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))
    if _cuda_in_use():  # dropout on the GPU draws from these; before CUDA is initialised nothing has
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states saved by :func:`rng_state`."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if np is not None and "numpy" in state:
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        # .cpu(): a snapshot loaded with map_location="cuda" holds these keys on the GPU.
        np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed python, numpy, torch's CPU generator and, where this process uses CUDA, the current CUDA device's
    generator for loading sample ``index`` of ``epoch``.

    ``torch.default_generator.manual_seed``, not ``torch.manual_seed``: the latter also seeds every
    accelerator backend and costs ~200 us, against ~1 us (measured on the CPU CI machine). The CUDA generator
    is seeded only once CUDA is initialised in this process (a sample drawing on the GPU, in the main process
    or a worker that initialised CUDA before its first sample): seeding it before would queue a call per sample.
    """
    s = stream_seed("sample", seed, epoch, index)
    random.seed(s)
    if np is not None:
        np.random.seed(s)
    torch.default_generator.manual_seed(s)
    if _cuda_in_use():
        torch.cuda.manual_seed(s)  # the current device's generator only: where a sample's draws on the GPU go


def loading_rng_state() -> tuple[Any, ...]:
    """The states of the generators :func:`seed_sample` seeds, for ``set_loading_rng_state``: python's,
    numpy's, torch's CPU generator and, where this process uses CUDA, the current device's generator."""
    cuda = torch.cuda.get_rng_state() if _cuda_in_use() else None
    return random.getstate(), np.random.get_state() if np is not None else None, torch.get_rng_state(), cuda


def set_loading_rng_state(state: tuple[Any, ...]) -> None:
    py, npy, cpu, cuda = state
    random.setstate(py)
    if npy is not None:
        np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


# -- watching for draws -----------------------------------------------------------------------------------------
# A loader seeds a sample's generators only when the sample draws, and finds out by comparing the generators'
# states around each batch; that comparison is on the path of every step, at a few microseconds' budget.
# numpy's get_state copies its 624 words into a new array and a dict (~10-50 us), python's getstate builds a
# tuple of 625 ints (~5-15 us), torch's get_state a 5 KiB tensor in a legacy layout. The three Mersenne Twisters
# are read instead as the bytes of their state structs: numpy's through its bit generator's documented ctypes
# address; python's at its object's address, as CPython lays it out (an int index, then 624 words, after the
# object header); torch's in its CPUGeneratorImpl, reached through the generator object's pointer to it (the
# engine's seed, position and 624 words, then the two cached normal samples). Each view is checked once per
# process against getstate/get_state (torch's also after draws and with cached samples set), and where one does
# not match (another layout, another interpreter, another torch) getstate/get_state are used.

_views: tuple[Any, Any, Any, Any] | None = None  # python's view, numpy's view, numpy's bit generator, torch's view


def _view(address: int, want: bytes) -> Any:
    """A ctypes view of ``len(want)`` bytes at ``address``, or None where they are not ``want``."""
    import ctypes

    try:
        view: Any = (ctypes.c_char * len(want)).from_address(address)
    except (TypeError, ValueError, OverflowError):
        return None
    return view if view.raw == want else None


_MT_WORDS = 624
# torch's CPUGeneratorImplState (what get_state returns): seed (u64), left (i32), seeded (i32), next (u64), the
# 624 words as u64, normal_x, normal_y, normal_rho (f64), normal_is_valid (i32), then the float normal sample
# (f32) and whether it is valid (bool). normal_y holds the cached double normal sample.
_TORCH_LEGACY = struct.Struct(f"=QiiQ{_MT_WORDS}QdddixxxxfBxxx")
# The engine in CPUGeneratorImpl (at::mt19937_data_pod): seed (u64), left (i32), seeded (bool), next (u32), the
# words (u32), then std::optional<float> and std::optional<double> (a value, then a flag).
_TORCH_ENGINE = struct.Struct(f"=Qi?xxxI{_MT_WORDS}I")
_TORCH_FLOAT_AT = -(-_TORCH_ENGINE.size // 8) * 8  # after the engine padded to its 8-byte alignment: value, flag
_TORCH_DOUBLE_AT = _TORCH_FLOAT_AT + 8  # optional<double>: 8-byte value, flag
_TORCH_SIZE = _TORCH_DOUBLE_AT + 16


def _torch_state(raw: bytes) -> torch.Tensor:
    """The ``get_state()`` tensor of the generator whose view's bytes are ``raw``: set_state takes it (under the
    generator's lock, checking the engine is valid), so the view itself is never written to."""
    seed, left, seeded, nxt, *words = _TORCH_ENGINE.unpack_from(raw)
    float_sample, has_float = struct.unpack_from("=f?", raw, _TORCH_FLOAT_AT)
    double_sample, has_double = struct.unpack_from("=d?", raw, _TORCH_DOUBLE_AT)
    legacy = _TORCH_LEGACY.pack(
        *(seed, left, int(seeded), nxt, *words),
        *(0.0, double_sample if has_double else 0.0, 0.0, int(has_double)),  # normal_x, normal_y, normal_rho, valid
        *(float_sample if has_float else 0.0, int(has_float)),
    )
    return torch.frombuffer(bytearray(legacy), dtype=torch.uint8)


def _torch_key(raw: bytes) -> tuple[Any, ...]:
    """What get_state reads of the view's bytes: not the padding, nor the value of a normal sample not cached,
    which set_state and manual_seed overwrite with whatever their stack held."""
    f, d = _TORCH_FLOAT_AT, _TORCH_DOUBLE_AT
    return raw[:13], raw[16:f], raw[f + 4] and raw[f : f + 4], raw[d + 8] and raw[d : d + 8]


def _torch_view() -> Any:
    """A view of the default CPU generator's state in its CPUGeneratorImpl, or None where it is not found."""
    import ctypes

    generator = torch._C.default_generator  # the one torch draws from, whatever a script binds to torch's name
    if type(generator) is not torch._C.Generator or generator.device.type != "cpu":
        return None
    start = generator.get_state()
    if start.numel() != _TORCH_LEGACY.size:  # not the Mersenne Twister generator this layout describes
        return None
    legacy = list(_TORCH_LEGACY.unpack(bytes(start.numpy())))
    words = struct.pack(f"={_MT_WORDS}I", *legacy[4 : 4 + _MT_WORDS])
    # THPGenerator: the object header, at::Generator (one intrusive pointer to the CPUGeneratorImpl), then the
    # weak reference list; a layout with anything else there is not read at all.
    if type(generator).__weakrefoffset__ != object.__basicsize__ + struct.calcsize("P"):
        return None
    impl = ctypes.c_void_p.from_address(id(generator) + object.__basicsize__).value
    if not impl:
        return None
    # The engine lies within the first few hundred bytes of the object, which is larger than the words alone:
    # reading 512 bytes from its start stays inside it.
    head = (ctypes.c_char * 512).from_address(impl).raw
    at = next((a for a in range(20, 512 - 8, 4) if head[a : a + 8] == words[:8]), None)
    if at is None or _view(impl + at, words) is None:
        return None
    view: Any = (ctypes.c_char * _TORCH_SIZE).from_address(impl + at - 20)  # the engine's seed, 20 bytes before

    def matches() -> bool:
        return torch.equal(_torch_state(view.raw), generator.get_state())

    try:
        # Every field where get_state says it is: now, after each of two one-element normal draws (one draws a
        # pair and caches the second, the other uses the cached one), and with both cached samples set (no
        # operator of torch's caches a float sample: a state is set that holds one).
        checks = [matches()]
        for _ in range(2):  # on this generator whatever default device or dtype the script has set
            torch.randn((), generator=generator, device="cpu", dtype=torch.float32)
            checks.append(matches())
        legacy[-5:] = [-0.75, 0.0, 1, 1.25, 1]  # normal_y, normal_rho, normal valid, float sample, float valid
        cached = torch.frombuffer(bytearray(_TORCH_LEGACY.pack(*legacy)), dtype=torch.uint8)
        generator.set_state(cached)
        checks.append(matches() and _torch_key(view.raw)[2:] == (struct.pack("=f", 1.25), struct.pack("=d", -0.75)))
        generator.set_state(_torch_state(view.raw))
        checks.append(torch.equal(generator.get_state(), cached))
    except (struct.error, RuntimeError):  # fields outside the view; set_state refusing an invalid engine
        return None
    finally:
        generator.set_state(start)
    return view if all(checks) else None


def _make_views() -> tuple[Any, Any, Any, Any]:
    global _views
    inst = random._inst  # the generator behind random.random() & co.
    words = random.getstate()[1]
    want = words[-1].to_bytes(4, sys.byteorder, signed=True) + struct.pack(f"={len(words) - 1}I", *words[:-1])
    python = _view(id(inst) + 2 * struct.calcsize("P"), want)  # CPython: the object header, then the index
    numpy = bit_generator = None
    if np is not None:
        bit_generator = np.random.mtrand._rand._bit_generator
        kind, keys, pos, *_ = cast(tuple, np.random.get_state())
        if kind == "MT19937":
            want = keys.astype(f"={keys.dtype.char}").tobytes() + int(pos).to_bytes(4, sys.byteorder, signed=True)
            numpy = _view(bit_generator.ctypes.state_address, want)
    _views = (python, numpy, bit_generator, _torch_view())
    return _views


def draw_marks() -> tuple[Any, ...]:
    """The states of the generators :func:`seed_sample` seeds, cheap to take (a few microseconds a batch, with
    the comparison, on the CI machine) and to compare with :func:`drawn_since`, and restorable with :func:`set_draw_marks`.

    numpy's legacy generator keeps the second of a pair of normal draws apart from its Mersenne Twister words;
    that cache is not part of the marks: a batch whose only draw is a cached normal left by an earlier draw
    goes unseen. Loader workers start with none cached (their generators are freshly seeded).
    """
    views = _views
    if views is None or (np is not None and np.random.mtrand._rand._bit_generator is not views[2]):
        views = _make_views()
    python, numpy, _, cpu = views
    py = (python.raw, random._inst.gauss_next) if python is not None else random.getstate()  # type: ignore[attr-defined]
    npy = numpy.raw if numpy is not None else (np.random.get_state() if np is not None else None)
    cuda = torch.cuda.get_rng_state() if _cuda_in_use() else None
    return py, npy, cpu.raw if cpu is not None else torch._C.default_generator.get_state(), cuda


def drawn_since(marks: tuple[Any, ...]) -> bool:
    """True when a generator :func:`draw_marks` covers has drawn since ``marks`` were taken."""
    py, npy, cpu, cuda = marks
    python, numpy, bit_generator, cpu_view = _views or _make_views()
    # Each .raw is a copy of ~2.5 KiB (~0.1 us); a call into memcmp through ctypes would cost more than that.
    if isinstance(py[0], bytes):
        if random._inst.gauss_next != py[1] or python.raw != py[0]:  # type: ignore[attr-defined]
            return True
    elif random.getstate() != py:
        return True
    if isinstance(cpu, bytes):
        now = cpu_view.raw
        if now != cpu and _torch_key(now) != _torch_key(cpu):  # the same bytes: the same state, at ~0.2 us
            return True
    elif not torch.equal(torch._C.default_generator.get_state(), cpu):
        return True
    if cuda is not None and (not _cuda_in_use() or not torch.equal(cuda, torch.cuda.get_rng_state())):
        return True
    if isinstance(npy, bytes):
        if np.random.mtrand._rand._bit_generator is not bit_generator:  # replaced: not the generator marked
            return True
        return numpy.raw != npy
    return npy is not None and not all(np.array_equal(a, b) for a, b in zip(npy, np.random.get_state()))


def set_draw_marks(marks: tuple[Any, ...]) -> None:
    """Put the generators back as :func:`draw_marks` found them (numpy's cached normal draw aside)."""
    import ctypes

    py, npy, cpu, cuda = marks
    python, numpy, _, _ = _views or _make_views()
    if isinstance(py[0], bytes):
        ctypes.memmove(ctypes.addressof(python), py[0], len(py[0]))
        random._inst.gauss_next = py[1]  # type: ignore[attr-defined]  # set by random.gauss(), not in the stubs
    else:
        random.setstate(py)
    if isinstance(npy, bytes):
        ctypes.memmove(ctypes.addressof(numpy), npy, len(npy))
    elif npy is not None:
        np.random.set_state(npy)
    torch._C.default_generator.set_state(_torch_state(cpu) if isinstance(cpu, bytes) else cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
