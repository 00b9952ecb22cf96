"""Starting a job: ``ddpkit run`` over torchrun's elastic agent, its rendezvous, workers, stall
watch and failure summary; ``ddpkit sbatch`` and ``ddpkit k8s``; and :func:`ddpkit.spawn`. Internal:
``import ddpkit`` imports :mod:`~ddpkit._launch.spawn` alone, each command the rest it uses.
"""
