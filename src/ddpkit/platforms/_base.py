"""What every platform gives, :class:`Platform` and its :class:`LaunchEnv`; and
:class:`LaunchDefault`, an option of ``ddpkit run`` an operator set (Kubernetes')."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ddpkit._errors import ConfigError


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "none"
    """The ``NAME`` of the platform that read it: ``"torchrun"`` (also ``ddpkit run`` and
    ``ddpkit.spawn``), ``"slurm"``, ``"mpi"``, ``"pytorchjob"``, ``"ray"`` or ``"none"``."""
    master_addr: str | None = None
    master_port: int | None = None
    collective_timeout: float | None = None
    """Seconds a collective may wait before it raises, as ``ddpkit run --collective-timeout`` set it
    (``DDPKIT_COLLECTIVE_TIMEOUT``); None for ``init()``'s default."""
    restart_count: int = 0
    """How many times the job has been restarted: by torchrun's agent, by SLURM requeues (both add
    up under ``srun ddpkit run``), or as counted under Ray Train."""


@dataclass(frozen=True)
class LaunchDefault:
    """A default of one of ``ddpkit run``'s options, and the variables it was read from."""

    option: str
    value: str
    source: str
    """The variables, as the launch summary names them (``PET_MASTER_ADDR:PET_MASTER_PORT``)."""


@runtime_checkable
class Platform(Protocol):
    """One platform ddpkit reads (in :mod:`ddpkit.platforms`). Each function reads the
    environment it is given (``os.environ``, or a dict in a test) and nothing else."""

    NAME: str
    """The platform's name, as :attr:`LaunchEnv.launcher` holds it."""

    def detect(self, env: Mapping[str, str]) -> bool:
        """Whether this platform started this process (asked in :data:`PLATFORMS`' order)."""
        ...

    def world(self, env: Mapping[str, str]) -> LaunchEnv:
        """This process's place in the job (:class:`~ddpkit._errors.ConfigError` naming the variable
        to fix); asked only where :func:`detect` said yes."""
        ...


LAUNCHER_NAMES = {
    "torchrun": "torchrun/ddpkit run", "slurm": "SLURM srun", "mpi": "mpiexec",
    "pytorchjob": "a PyTorchJob", "ray": "Ray Train",
}  # fmt: skip
"""Each launcher as messages name it."""


def read_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    """``env[name]`` as an integer (``default`` where unset and given), else a ConfigError."""
    if name not in env and default is not None:
        return default
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer; fix or unset {name}") from None


def checked(info: LaunchEnv) -> LaunchEnv:
    """``info`` when its ranks and sizes fit together, else a ConfigError naming its launcher."""
    source = LAUNCHER_NAMES.get(info.launcher, info.launcher)
    if info.world_size < 1:
        raise ConfigError(f"world size {info.world_size} from {source} must be >= 1")
    if not 0 <= info.rank < info.world_size:
        raise ConfigError(
            f"rank {info.rank} is outside the world of {info.world_size} processes set by "
            f"{source}; each rank must be in [0, world size)"
        )
    if not 1 <= info.local_world_size <= info.world_size:
        raise ConfigError(
            f"{info.local_world_size} processes on this node but {info.world_size} in the whole "
            f"job ({source}); the local world size must be between 1 and the world size"
        )
    if not 0 <= info.local_rank < info.local_world_size:
        raise ConfigError(
            f"local rank {info.local_rank} is outside the {info.local_world_size} processes of "
            f"this node set by {source}"
        )
    return info
