"""Seeding and RNG state: identical model initialisation on every rank, and states a snapshot can restore."""

from __future__ import annotations

import hashlib
import random
import sys
from typing import Any

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
# states around each batch; that comparison is on the path of every step. Each state is read through its
# public API: python's getstate (~10 us: a tuple of 625 ints), torch's get_state (~1.3 us: a 5 KiB tensor) and
# numpy's get_state (~45 us: its words copied one by one). numpy's is read only once ``numpy.random`` is
# imported, which neither torch nor ``import numpy`` does: a process without it has no numpy generator to draw
# from, and a batch that imports it (to draw) is taken as drawing. A loader worker, where nothing draws between
# batches, takes the state after one batch as the marks of the next (:class:`~ddpkit.data.loader.SampleSeeder`).
# Every comparison is exact: two Mersenne Twister states are equal only if nothing drew, or the generator was
# set back to the state it had.


def _numpy_random() -> Any:
    """numpy's random module where it is imported already (None otherwise): never imported here."""
    return sys.modules.get("numpy.random")


def draw_marks() -> tuple[Any, ...]:
    """The states of the generators :func:`seed_sample` seeds, to compare with :func:`drawn_since` or
    :func:`changed`, and restorable with :func:`set_draw_marks`: python's, numpy's (None where
    ``numpy.random`` is not imported), torch's CPU generator's and, where this process uses CUDA, the current
    device's."""
    npr = _numpy_random()
    npy = npr.get_state(legacy=False) if npr is not None else None
    cuda = torch.cuda.get_rng_state() if _cuda_in_use() else None
    return random.getstate(), npy, torch.default_generator.get_state(), cuda


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if np is not None:  # ~1 us against ~6 us for torch.equal's dispatch, on 5 KiB
        return bool(a.numpy().tobytes() == b.numpy().tobytes())
    return torch.equal(a, b)


def _same_numpy(a: Any, b: Any) -> bool:
    (sa, sb), (ka, kb) = (a["state"], b["state"]), (a["state"]["key"], b["state"]["key"])
    return (
        a["bit_generator"] == b["bit_generator"]
        and sa["pos"] == sb["pos"]
        and (a.get("has_gauss"), a.get("gauss")) == (b.get("has_gauss"), b.get("gauss"))
        and ka.tobytes() == kb.tobytes()
    )


def changed(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    """True when a generator drew (or was seeded or set to another state) between two :func:`draw_marks`."""
    py0, npy0, cpu0, cuda0 = before
    py1, npy1, cpu1, cuda1 = after
    # The index of python's words first: it moves with every draw but a whole multiple of 624 words.
    if py0[1][-1] != py1[1][-1] or py0[2] != py1[2] or py0 != py1:
        return True
    if not _same_tensor(cpu0, cpu1):
        return True
    if (cuda0 is None) != (cuda1 is None) or (cuda0 is not None and not torch.equal(cuda0, cuda1)):
        return True
    if npy0 is None:
        return npy1 is not None  # numpy.random imported meanwhile, to draw
    return npy1 is None or not _same_numpy(npy0, npy1)


def drawn_since(marks: tuple[Any, ...]) -> bool:
    """True when a generator :func:`draw_marks` covers has drawn since ``marks`` were taken."""
    return changed(marks, draw_marks())


def set_draw_marks(marks: tuple[Any, ...]) -> None:
    """Put the generators back as :func:`draw_marks` found them."""
    py, npy, cpu, cuda = marks
    random.setstate(py)
    npr = _numpy_random()
    if npy is not None and npr is not None:
        npr.set_state(npy)
    torch.default_generator.set_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
