"""Every platform ddpkit reads, one module each, each a :class:`~ddpkit.platforms._base.Platform`;
nothing outside this package reads their variables. :func:`current` asks them in the order of
:data:`PLATFORMS`."""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.platforms import _kubernetes as kubernetes
from ddpkit.platforms import _mpi as mpi
from ddpkit.platforms import _ray as ray
from ddpkit.platforms import _slurm as slurm
from ddpkit.platforms import _torchrun as torchrun
from ddpkit.platforms._base import LaunchDefault, LaunchEnv, Platform


class _Alone:
    """No launcher: plain ``python train.py``, a world of one. Always detected, so asked last."""

    NAME = "none"

    @staticmethod
    def detect(env: Mapping[str, str]) -> bool:
        return True

    @staticmethod
    def world(env: Mapping[str, str]) -> LaunchEnv:
        return LaunchEnv()


none = _Alone()

PLATFORMS: tuple[Platform, ...] = (kubernetes, ray, torchrun, mpi, slurm, none)
"""The platforms in the order :func:`current` asks them, the first that detects itself winning (why
this order: docs/runtime.md)."""


def current(env: Mapping[str, str]) -> Platform:
    """The platform that started this process, as ``env`` tells it (a world of one if none)."""
    return next(platform for platform in PLATFORMS if platform.detect(env))


def read_world(env: Mapping[str, str]) -> LaunchEnv:
    """This process's place in the job, read by the platform that started it."""
    return current(env).world(env)


def launch_defaults(env: Mapping[str, str]) -> list[LaunchDefault]:
    """The defaults of ``ddpkit run``'s options set in ``env``: a Kubernetes operator's ``PET_*``
    and JobSet's ``JOB_COMPLETION_INDEX`` (the other launchers start their ranks themselves)."""
    return kubernetes.launch_defaults(env)


def scheduler(env: Mapping[str, str]) -> str | None:
    """The batch scheduler this process runs under, if any: ``"slurm"`` or ``"sge"``."""
    if slurm.job_id(env) is not None:  # a step's task, a batch script, a salloc shell
        return "slurm"
    if "SGE_TASK_ID" in env or "NSLOTS" in env or "JOB_ID" in env and "SGE_ROOT" in env:
        return "sge"
    return None


__all__ = [
    "PLATFORMS", "LaunchDefault", "LaunchEnv", "Platform", "current", "launch_defaults",
    "read_world", "scheduler",
]  # fmt: skip

LAUNCH_VARIABLES = frozenset(
    {
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NSLOTS", "SGE_TASK_ID",
        "SGE_ROOT", "JOB_ID",
    }
)  # fmt: skip
LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PMI_", "PMIX_", "OMPI_")
"""Variables (and prefixes) through which a launcher or scheduler places a process in a job."""


def without_launch_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` without :data:`LAUNCH_VARIABLES` and :data:`LAUNCH_PREFIXES`: for a job
    started from inside another (a test run under ``ddpkit run``, a SLURM node), whose launcher
    would otherwise take the enclosing job's address, ranks or core grant for its own."""
    return {
        k: v
        for k, v in env.items()
        if k not in LAUNCH_VARIABLES and not k.startswith(LAUNCH_PREFIXES)
    }
