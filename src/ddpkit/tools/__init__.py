"""Extras over the training primitives, run by the ``ddpkit`` command: ``ddpkit bench`` (will more
GPUs help?), ``ddpkit check`` (do N ranks train the same model as one process?) and ``ddpkit env``.
``import ddpkit`` imports none of it.

A script tells ``bench`` and ``check`` what to train with a ``ddpkit_workload()`` that returns a
:class:`Workload`.
"""

from ddpkit.tools._workload import Workload

__all__ = ["Workload"]
