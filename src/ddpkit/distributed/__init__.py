"""The distributed runtime: who this process is, the collectives, rank-aware printing, seeding, stop
signals."""

from __future__ import annotations

from ddpkit.distributed._runtime import Group, NotInitializedError
from ddpkit.distributed._seeding import mix_seed, rng_state, seed_rank, set_rng_state
from ddpkit.distributed._signals import pending_stop_signal

__all__ = [
    "Group", "NotInitializedError", "mix_seed", "pending_stop_signal", "rng_state", "seed_rank",
    "set_rng_state",
]  # fmt: skip
