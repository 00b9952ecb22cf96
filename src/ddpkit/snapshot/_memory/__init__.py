"""Snapshots in shared memory: a copy of each rank's state after steps, which outlives the worker,
so that a restarted job resumes from the step it lost rather than from the last disk snapshot. An
extra: imported only when a run asks for it (``SnapshotConfig(memory=...)``), never by
``import ddpkit``.

- :mod:`~ddpkit.snapshot._memory.folder`: the job's folder in shared memory, made by the agent of
  ``ddpkit run``;
- :mod:`~ddpkit.snapshot._memory.store`: a rank's two slots in it;
- :mod:`~ddpkit.snapshot._memory.slot`: a slot's file format and its checks;
- its values are encoded by :mod:`ddpkit.snapshot._codec`, its tensors laid out by
  :mod:`ddpkit.snapshot._region`;
- :mod:`~ddpkit.snapshot._memory.snapshots`: the Trainer's copies after steps, and their interval;
- :mod:`~ddpkit.snapshot._memory.resume`: which copy a restart resumes from, on every rank alike.
"""
