"""Snapshots: the one front door a hand loop and the Trainer save and resume through
(:mod:`~ddpkit.snapshot._snapshots`), when a run snapshots (:mod:`~ddpkit.snapshot._state`), the
check that a snapshot resumes only its run (:mod:`~ddpkit.snapshot._run_record`), and two stores:
the disk (:mod:`~ddpkit.snapshot._disk`, its folders :mod:`~ddpkit.snapshot._folders` and DCP files
:mod:`~ddpkit.snapshot._dcp`) and shared memory (:mod:`~ddpkit.snapshot._memory`, its files
:mod:`~ddpkit.snapshot._slots`, imported only when a run asks for it). Besides: the codec of every
value (:mod:`~ddpkit.snapshot._codec`), the run directory's lock (:mod:`~ddpkit.snapshot._run_dir`)
and the weights files (:mod:`~ddpkit.snapshot._export`).
"""

from ddpkit.snapshot._disk import SnapshotManager, SnapshotWriteError
from ddpkit.snapshot._state import SnapshotSchedule

__all__ = ["SnapshotManager", "SnapshotSchedule", "SnapshotWriteError"]
