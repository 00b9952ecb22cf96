"""Seeding and RNG state: identical model initialisation on every rank, and states a snapshot can
restore."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

from ddpkit.distributed._runtime import Group, get_runtime

try:  # numpy is optional: seed and save it only when it is installed
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


def mix_seed(*values: int | str) -> int:
    """A 32-bit seed from several values, different for every combination.

    ``torch.Generator.manual_seed`` keeps only the low 32 bits of its argument, so packing
    ``(seed, epoch)`` as ``seed << 32 | epoch`` would ignore the seed; a hash spreads every input
    over those 32 bits.
    """
    text = ",".join(map(str, values)).encode("utf-8", "surrogateescape")  # a name's own bytes
    digest = hashlib.blake2b(text, digest_size=4).digest()
    return int.from_bytes(digest, "little")


STREAMS = ("shuffle", "loader", "rank", "dropout", "reseed", "sample")
"""The random streams ddpkit derives from a run's seed, one name each:

- ``shuffle``: the sample order of an epoch, keyed by the epoch;
- ``loader``: the loader's generator (its workers' base seeds), keyed by the rank;
- ``rank``: each rank's python, numpy and torch streams once the model is wrapped
  (:func:`seed_rank`: dropout masks, augmentation in the main process);
- ``dropout``: :class:`~ddpkit.nn._dropout.GlobalBatchDropout` masks, keyed by (epoch, step);
- ``reseed``: a rank's streams after a resume at another world size, keyed by (step, rank);
- ``sample``: the random draws of one sample's loading (augmentation), keyed by (epoch, index): the
  same whichever rank or loader worker loads it, and however many there are.
"""


def stream_seed(stream: str, seed: int, *keys: int) -> int:
    """The seed of ``stream`` (one of :data:`STREAMS`) for ``keys``.

    The name is part of the hash, so two streams never share a seed, whatever their keys: with one
    unnamed mix, the loader's seed of rank ``r`` and the shuffle seed of epoch ``r`` were the same
    number.
    """
    if stream not in STREAMS:
        raise ValueError(f"unknown random stream {stream!r}: one of {STREAMS}")
    return mix_seed(stream, seed, *keys)


def seed_everything(seed: int, per_rank: bool = False, group: Group = None) -> int:
    """Seed python, numpy and torch (CPU and every CUDA device); return the seed used.

    The same seed on every rank makes model initialisation identical everywhere (DDP also broadcasts
    rank 0's weights when it wraps a model, but buffers created later and any randomness before
    wrapping still need it). Once the model is wrapped, :func:`~ddpkit.prepare_model` gives each
    rank its own streams from this seed and the rank (:func:`seed_rank`): dropout masks then differ
    between ranks, as between the samples of one process. ``per_rank=True`` adds the rank to the
    seed, so ranks draw different random streams from here on, before any model is wrapped: for
    reinforcement learning environments.
    """
    if per_rank:
        seed = seed + get_runtime(group).rank
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


def seed_rank(seed: int, rank: int) -> int:
    """Seed python, numpy and torch (CPU and every CUDA device) with rank ``rank``'s own stream of
    ``seed`` (the ``rank`` stream); return the seed used.

    Called once the weights are the same on every rank (:func:`~ddpkit.prepare_model` after DDP's
    broadcast, the Trainer after its strategy's): with :func:`seed_everything`'s one seed
    everywhere, each rank would draw the same dropout masks and augmentations for its share of the
    global batch, which one process never does. Rank 0's stream is a world of one's, so a world of
    one draws as rank 0 of N.
    """
    rank_seed = stream_seed("rank", seed, rank)
    random.seed(rank_seed)
    if np is not None:
        np.random.seed(rank_seed)
    torch.manual_seed(rank_seed)  # also seeds every CUDA device
    return rank_seed


def cuda_in_use() -> bool:
    """True when this process has initialised CUDA: then its generators draw, and are saved and
    seeded.

    Never initialises CUDA itself, and is False in a loader worker forked from a process that had
    (CUDA cannot be used there at all; touching it would raise).
    """
    return torch.cuda.is_initialized()


def rng_state() -> dict[str, Any]:
    """The RNG states of this process: python, numpy, torch CPU and each CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        # As plain values and a tensor, so a snapshot loads with torch.load(weights_only=True).
        legacy = np.random.get_state()
        # the global generator is a Mersenne Twister: the 5-tuple form
        assert isinstance(legacy, tuple)
        kind, keys, pos, has_gauss, gauss = legacy
        state["numpy"] = (
            kind,
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(gauss),
        )
    if cuda_in_use():  # dropout on the GPU draws from these; before CUDA is initialised nothing has
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
