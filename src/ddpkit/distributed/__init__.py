"""The distributed runtime: who this process is, the collectives, rank-aware printing, seeding, stop signals."""

from __future__ import annotations

from typing import TypeAlias

from torch.distributed import ProcessGroup

Group: TypeAlias = ProcessGroup | None
"""A process group, or None for the world (the default group): what every ``group=`` of ddpkit takes."""
