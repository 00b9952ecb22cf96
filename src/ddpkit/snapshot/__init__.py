"""Snapshots, in one package: when a run snapshots, what it holds, where it goes, and how a run resumes.

- :mod:`~ddpkit.snapshot.schedule`: :class:`SnapshotConfig` and when a snapshot is due;
- :mod:`~ddpkit.snapshot.trainer`: the state gathered from the Trainer's parts, its save and its resume (the one
  object the Trainer talks to);
- :mod:`~ddpkit.snapshot.run_record`: what a run was built with, and the refusal of a resume of another run;
- the disk backend: :mod:`~ddpkit.snapshot.manager` (``step-N`` folders through torch's distributed checkpoint,
  valid once their marker is written), :mod:`~ddpkit.snapshot.storage`, :mod:`~ddpkit.snapshot.folders`,
  :mod:`~ddpkit.snapshot.layout`, :mod:`~ddpkit.snapshot.loading`, :mod:`~ddpkit.snapshot.staging`;
- the memory backend, :mod:`ddpkit.snapshot.memory` (copies in shared memory that outlive a worker), imported
  only when a run asks for it;
- the run directory's lock (:mod:`~ddpkit.snapshot.run_dir`), the exported weights (:mod:`~ddpkit.snapshot.export`)
  and the best weights (:mod:`~ddpkit.snapshot.best`).
"""
