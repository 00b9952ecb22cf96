"""The commands: ``ddpkit run`` (:mod:`.run`, its options in :mod:`.options`), ``ddpkit sbatch``,
``ddpkit k8s``."""
