"""Ray Train: its workers carry torchrun's variables and the raylet's pid. Imports no Ray."""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.platforms import _torchrun as torchrun
from ddpkit.platforms._base import LaunchEnv

NAME = "ray"


def detect(env: Mapping[str, str]) -> bool:
    # unless torchrun's agent started it inside a Ray task
    return torchrun.detect(env) and "RAY_RAYLET_PID" in env and not torchrun.started_by_agent(env)


def world(env: Mapping[str, str]) -> LaunchEnv:
    """torchrun's reading of the ranks, as launcher ``"ray"``."""
    return torchrun.world(env, launcher=NAME)


def job_id(env: Mapping[str, str]) -> str:
    """The Ray job (``RAY_JOB_ID``, one per driver), ``""`` where unset."""
    return env.get("RAY_JOB_ID", "")
