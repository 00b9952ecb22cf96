"""Snapshots, in one package: when a run snapshots, what it holds, where it goes, and how a run
resumes.

- :mod:`~ddpkit.snapshot._schedule`: :class:`SnapshotConfig` and when a snapshot is due;
- :mod:`~ddpkit.snapshot._trainer`: the state gathered from the Trainer's parts, its save and its
  resume (the one object the Trainer talks to);
- :mod:`~ddpkit.snapshot._run_record`: what a run was built with, and the refusal of a resume of
  another run;
- the disk backend: :mod:`~ddpkit.snapshot._manager` (``step-N`` folders through torch's distributed
  checkpoint, valid once their marker is written), :mod:`~ddpkit.snapshot._storage`,
  :mod:`~ddpkit.snapshot._folders`, :mod:`~ddpkit.snapshot._layout`,
  :mod:`~ddpkit.snapshot._loading`, :mod:`~ddpkit.snapshot._staging`;
- the memory backend, :mod:`ddpkit.snapshot._memory` (copies in shared memory that outlive a
  worker), imported only when a run asks for it;
- the run directory's lock (:mod:`~ddpkit.snapshot._run_dir`), the exported weights
  (:mod:`~ddpkit.snapshot._export`) and the best weights (:mod:`~ddpkit.snapshot._best`).
"""

from ddpkit.snapshot._manager import SnapshotManager, SnapshotWriteError
from ddpkit.snapshot._schedule import SnapshotSchedule

__all__ = ["SnapshotManager", "SnapshotSchedule", "SnapshotWriteError"]
