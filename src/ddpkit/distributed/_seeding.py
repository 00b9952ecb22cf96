"""Seeding and RNG state: the same initial weights on every rank, states a snapshot restores."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch
from torch.cuda import is_initialized as cuda_in_use  # whether this process initialised CUDA

from ddpkit._errors import checked_arguments
from ddpkit.distributed._runtime import Group, get_runtime

try:  # numpy is optional: seed and save it only when it is installed
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


def mix_seed(*values: int | str) -> int:
    """A 32-bit seed from several values, different for every combination (a hash: ``manual_seed``
    keeps only the low 32 bits, so ``seed << 32 | epoch`` would drop the seed)."""
    text = ",".join(map(str, values)).encode("utf-8", "surrogateescape")  # a name's own bytes
    digest = hashlib.blake2b(text, digest_size=4).digest()
    return int.from_bytes(digest, "little")


STREAMS = ("shuffle", "loader", "rank", "dropout", "reseed", "sample")
"""The random streams ddpkit derives from a run's seed: ``shuffle`` (an epoch's sample order, by
epoch), ``loader`` (the loader's generator, by rank), ``rank`` (each rank's streams once the model
is wrapped, :func:`seed_rank`), ``dropout`` (:class:`~ddpkit.nn._dropout.GlobalBatchDropout`, by
epoch and step), ``reseed`` (after a resume at another world size, by step and rank), ``sample``
(one sample's loading, by epoch and index, whichever rank or worker loads it)."""


def stream_seed(stream: str, seed: int, *keys: int) -> int:
    """The seed of ``stream`` (one of :data:`STREAMS`) for ``keys``, never another stream's."""
    if stream not in STREAMS:
        raise ValueError(f"unknown random stream {stream!r}: one of {STREAMS}")
    return mix_seed(stream, seed, *keys)


@checked_arguments
def seed_everything(seed: int, per_rank: bool = False, group: Group = None) -> int:
    """Seed python, numpy and torch (CPU and every CUDA device); return the seed used. The same
    seed on every rank makes the initial weights identical; ``per_rank=True`` adds the rank to the
    seed, so ranks draw differently from here on."""
    if per_rank:
        seed = seed + get_runtime(group).rank
    return _seed_all(seed)


def seed_rank(seed: int, rank: int) -> int:
    """Seed python, numpy and torch with rank ``rank``'s own stream of ``seed`` (once the weights
    are the same on every rank: ranks then draw different dropout masks); return the seed used."""
    return _seed_all(stream_seed("rank", seed, rank))


def _seed_all(seed: int) -> int:
    random.seed(seed)
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


def rng_state() -> dict[str, Any]:
    """The RNG states of this process: python, numpy, torch CPU and each CUDA device."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        # plain values and a tensor: a snapshot loads with torch.load(weights_only=True)
        legacy = np.random.get_state()
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
