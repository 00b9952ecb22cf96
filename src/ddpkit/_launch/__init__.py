"""Starting a job (internal: the public face is the ``ddpkit`` command and :func:`ddpkit.spawn`).

The core: ``ddpkit run`` (:mod:`~ddpkit._launch.launcher`) over torchrun's elastic agent
(:mod:`~ddpkit._launch.agent`), its rendezvous, the workers, the stall watch, and ``spawn`` for
notebooks.

Extras, imported only by the command that uses them (``import ddpkit`` imports none):

- the fork server (:mod:`~ddpkit._launch.forkserver`, :mod:`~ddpkit._launch.forked_workers`):
  workers forked from a warm process;
- the rendezvous relay and its authentication (:mod:`~ddpkit._launch.rendezvous_relay`,
  :mod:`~ddpkit._launch.rendezvous_auth`);
- the writers: ``ddpkit sbatch`` (:mod:`~ddpkit._launch.sbatch`) and ``ddpkit k8s``
  (:mod:`~ddpkit._launch.k8s`, :mod:`~ddpkit._launch.manifests`).
"""
