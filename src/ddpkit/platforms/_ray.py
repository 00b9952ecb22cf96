"""Ray Train: its workers carry torchrun's variables (:mod:`ddpkit.platforms._torchrun`) and, as
every Ray worker process, the raylet's pid. Nothing here imports Ray; the count of Ray Train's
restarts is kept through a private Ray API behind a check (:mod:`ddpkit._internals.ray_train`)."""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.platforms import _torchrun as torchrun
from ddpkit.platforms._base import LaunchDefault, LaunchEnv

NAME = "ray"


def detect(env: Mapping[str, str]) -> bool:
    # Ray Train's workers carry torchrun's variables (and the raylet's pid): Ray started them,
    # unless torchrun's agent did inside a Ray task.
    return torchrun.detect(env) and "RAY_RAYLET_PID" in env and not torchrun.started_by_agent(env)


def world(env: Mapping[str, str]) -> LaunchEnv:
    """torchrun's reading of the ranks, as launcher ``"ray"``; its ``restart_count`` is set by
    :func:`ddpkit.distributed._runtime.init`, which counts the starts."""
    return torchrun.world(env, launcher=NAME)


def launch_defaults(env: Mapping[str, str]) -> list[LaunchDefault]:
    """None: Ray Train starts its workers itself, never through ``ddpkit run``."""
    return []


def job_id(env: Mapping[str, str]) -> str:
    """The Ray job (``RAY_JOB_ID``, one per driver), ``""`` where unset."""
    return env.get("RAY_JOB_ID", "")
