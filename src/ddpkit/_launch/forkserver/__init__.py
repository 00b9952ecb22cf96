"""The fork server: workers forked from a process that imported torch once for the job.

:mod:`~ddpkit._launch.forkserver.server` is the server (its own process, started as
``python -m ddpkit._launch.forkserver.server``); :mod:`~ddpkit._launch.forkserver.workers` is the
agent's side, which asks it for each worker. An extra: ``import ddpkit`` imports neither.
"""
