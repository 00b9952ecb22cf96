"""The launcher's environment: the ranks (:mod:`ddpkit.platforms`), ``ddpkit run``'s timeout."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import replace

from ddpkit import platforms
from ddpkit._errors import ConfigError
from ddpkit.platforms._base import LaunchEnv

# The range of --join-timeout and --collective-timeout: torch overflows past 30 days; below a second
# the process group's own setup times out.
MAX_TIMEOUT = 30 * 24 * 3600.0
MIN_TIMEOUT = 1.0

_SECONDS = f"use a number of seconds from {MIN_TIMEOUT:.0f} to {MAX_TIMEOUT:.0f} (30 days)"


def parse_seconds(option: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{option} {text[:40]!r}: {_SECONDS}") from None
    if not (math.isfinite(value) and MIN_TIMEOUT <= value <= MAX_TIMEOUT):
        raise ConfigError(f"{option} {value}: {_SECONDS}")
    return value


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """The ranks as the platform that started this process names them, and the timeout."""
    env = os.environ if env is None else env
    info = platforms.read_world(env)
    if "DDPKIT_COLLECTIVE_TIMEOUT" in env and info.launcher != "none":
        seconds = parse_seconds("DDPKIT_COLLECTIVE_TIMEOUT", env["DDPKIT_COLLECTIVE_TIMEOUT"])
        info = replace(info, collective_timeout=seconds)
    return info
