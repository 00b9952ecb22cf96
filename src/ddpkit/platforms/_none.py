"""No launcher: plain ``python train.py``, a world of one. Always detected, so asked last."""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.platforms._base import LaunchDefault, LaunchEnv

NAME = "none"


def detect(env: Mapping[str, str]) -> bool:
    return True


def world(env: Mapping[str, str]) -> LaunchEnv:
    return LaunchEnv()


def launch_defaults(env: Mapping[str, str]) -> list[LaunchDefault]:
    return []
