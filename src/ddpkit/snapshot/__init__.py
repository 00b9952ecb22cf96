"""Snapshots: one front door (:mod:`~ddpkit.snapshot._snapshots`) over a disk store and a memory
store; each module's part: docs/snapshots.md, "How the package is laid out".
"""

from ddpkit.snapshot._disk import SnapshotWriteError
from ddpkit.snapshot._state import SnapshotSchedule

__all__ = ["SnapshotSchedule", "SnapshotWriteError"]
