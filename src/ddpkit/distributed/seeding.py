"""Seeding and RNG state: identical model initialisation on every rank, and states a snapshot can restore."""

from __future__ import annotations

import hashlib
import random
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
# states around a batch. numpy's own get_state copies its 624 words into a new array and a dict (~10-50 us);
# its bit generator's documented ctypes view of the same state struct reads them as bytes for well under 1 us.

_MT_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], then int pos
_numpy_view: tuple[int, Any] | None = None  # (id of the bit generator, a ctypes view of its state), per process


def _numpy_words() -> Any:
    """A ctypes view of the global numpy generator's Mersenne Twister words and position, or None where that
    view does not match what ``np.random.get_state()`` says (another numpy layout): then draws are watched by
    ``get_state``."""
    global _numpy_view
    if np is None:
        return None
    import ctypes

    bit_generator = np.random.mtrand._rand._bit_generator
    if _numpy_view is None or _numpy_view[0] != id(bit_generator):
        view = None
        try:
            view = (ctypes.c_char * _MT_BYTES).from_address(bit_generator.ctypes.state_address)
            kind, keys, pos, *_ = cast(tuple, np.random.get_state())
            expected = keys.astype("<u4").tobytes() + int(pos).to_bytes(4, "little", signed=True)
            view = view if kind == "MT19937" and view.raw == expected else None
        except (AttributeError, TypeError, ValueError):
            view = None
        _numpy_view = (id(bit_generator), view)
    return _numpy_view[1]


def draw_marks() -> tuple[Any, ...]:
    """The states of the generators :func:`seed_sample` seeds, cheap to take (~5 us in all on the CI machine,
    python's being most of it) and to compare with :func:`drawn_since`, and restorable with
    :func:`set_draw_marks`.

    numpy's legacy generator keeps the second of a pair of normal draws apart from its Mersenne Twister words;
    that cache is not part of the marks: a batch whose only draw is a cached normal left by an earlier draw
    goes unseen. Loader workers start with none cached (their generators are freshly seeded).
    """
    words = _numpy_words()
    npy = words.raw if words is not None else (np.random.get_state() if np is not None else None)
    cuda = torch.cuda.get_rng_state() if _cuda_in_use() else None
    return random.getstate(), npy, torch.default_generator.get_state(), cuda


def drawn_since(marks: tuple[Any, ...]) -> bool:
    """True when a generator :func:`draw_marks` covers has drawn since ``marks`` were taken."""
    py, npy, cpu, cuda = marks
    now_py, now_npy, now_cpu, now_cuda = draw_marks()
    if py != now_py or not torch.equal(cpu, now_cpu):
        return True
    if cuda is not None and (now_cuda is None or not torch.equal(cuda, now_cuda)):
        return True
    if isinstance(npy, bytes):
        return npy != now_npy
    return npy is not None and not all(np.array_equal(a, b) for a, b in zip(npy, now_npy))


def set_draw_marks(marks: tuple[Any, ...]) -> None:
    """Put the generators back as :func:`draw_marks` found them (numpy's cached normal draw aside)."""
    import ctypes

    py, npy, cpu, cuda = marks
    random.setstate(py)
    if isinstance(npy, bytes):
        words = _numpy_words()
        ctypes.memmove(ctypes.addressof(words), npy, len(npy))
    elif npy is not None:
        np.random.set_state(npy)
    torch.default_generator.set_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
