"""Starting a job (internal: the public face is the ``ddpkit`` command and :func:`ddpkit.spawn`).

The core: ``ddpkit run`` (:mod:`~ddpkit._launch.launcher`) over torchrun's elastic agent
(:mod:`~ddpkit._launch.agent`), its rendezvous (:mod:`~ddpkit._launch.rendezvous`), the workers,
the stall watch, the summary of a failed job (:mod:`~ddpkit._launch.failure`), and ``spawn`` for
notebooks.

Extras, imported only by the command that uses them (``import ddpkit`` imports none):

- the fork server (:mod:`~ddpkit._launch.forkserver`): workers forked from a warm process;
- the rendezvous backend, relay and authentication of a multi-node job
  (:mod:`~ddpkit._launch.rendezvous.backend`, :mod:`~ddpkit._launch.rendezvous.relay`,
  :mod:`~ddpkit._launch.rendezvous.auth`);
- the writers: ``ddpkit sbatch`` (:mod:`~ddpkit._launch.sbatch`) and ``ddpkit k8s``
  (:mod:`~ddpkit._launch.k8s`, :mod:`~ddpkit._launch.manifests`).
"""
