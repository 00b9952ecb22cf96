"""The distributed runtime: who this process is, the collectives, rank-aware printing, seeding, stop
signals."""

from __future__ import annotations

from typing import TypeAlias

from torch.distributed import ProcessGroup

Group: TypeAlias = ProcessGroup | None
"""A process group, or None for the world (the default group): what every ``group=`` of ddpkit
takes."""

# After Group: the modules below import it from here.
from ddpkit.distributed._runtime import NotInitializedError  # noqa: E402
from ddpkit.distributed._seeding import mix_seed, rng_state, seed_rank, set_rng_state  # noqa: E402
from ddpkit.distributed._signals import pending_stop_signal  # noqa: E402

__all__ = [
    "Group",
    "NotInitializedError",
    "mix_seed",
    "pending_stop_signal",
    "rng_state",
    "seed_rank",
    "set_rng_state",
]
