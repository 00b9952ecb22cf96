"""Every platform ddpkit reads, one module each, and nothing outside this package reads their
variables.

Each module is a :class:`~ddpkit.platforms._base.Platform`: ``NAME``, ``detect(env)`` (was this
process started by it?), ``world(env)`` (its :class:`~ddpkit.platforms._base.LaunchEnv`: ranks,
sizes, rendezvous address) and ``launch_defaults(env)`` (the defaults of ``ddpkit run``'s options it
set). :func:`current` asks them in the order of :data:`PLATFORMS`:

1. :mod:`~ddpkit.platforms._kubernetes`: a PyTorchJob pod run without torchrun (``RANK`` and
   ``WORLD_SIZE`` but no ``LOCAL_RANK``, inside Kubernetes), before torchrun, which would refuse the
   missing ``LOCAL_RANK``;
2. :mod:`~ddpkit.platforms._ray`: a Ray Train worker, whose variables are torchrun's, so before
   torchrun;
3. :mod:`~ddpkit.platforms._torchrun`: ``ddpkit run``, torchrun, :func:`ddpkit.spawn`, or ``env://``
   by hand; before MPI and SLURM, since ``srun ddpkit run`` and ``mpiexec ddpkit run`` are
   torchrun's ranks;
4. :mod:`~ddpkit.platforms._mpi`: before SLURM, because under ``mpiexec`` in a SLURM job MPICH's and
   Open MPI's launchers start one srun task per node and the ranks inside it, so ``SLURM_PROCID``
   counts nodes there while the MPI variables count ranks;
5. :mod:`~ddpkit.platforms._slurm`: a task ``srun`` started;
6. :mod:`~ddpkit.platforms._none`: a world of one.

:mod:`~ddpkit.platforms._sge` (the slots Grid Engine granted) and :mod:`~ddpkit.platforms._cpus`
(the cores this process may use) read the schedulers for the rest. The writers of these variables
(``ddpkit sbatch``'s script, ``ddpkit k8s``'s manifests, the launcher that starts the workers) live
with what they write.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.platforms import _kubernetes as kubernetes
from ddpkit.platforms import _mpi as mpi
from ddpkit.platforms import _none as none
from ddpkit.platforms import _ray as ray
from ddpkit.platforms import _sge as sge
from ddpkit.platforms import _slurm as slurm
from ddpkit.platforms import _torchrun as torchrun
from ddpkit.platforms._base import LaunchDefault, LaunchEnv, Platform

PLATFORMS: tuple[Platform, ...] = (kubernetes, ray, torchrun, mpi, slurm, none)
"""The platforms in the order :func:`current` asks them (the first that detects itself wins)."""


def current(env: Mapping[str, str]) -> Platform:
    """The platform that started this process, as ``env`` tells it (:mod:`~ddpkit.platforms._none`
    if none)."""
    return next(platform for platform in PLATFORMS if platform.detect(env))


def read_world(env: Mapping[str, str]) -> LaunchEnv:
    """This process's place in the job, read by the platform that started it."""
    return current(env).world(env)


def launch_defaults(env: Mapping[str, str]) -> list[LaunchDefault]:
    """The defaults of ``ddpkit run``'s options that any platform set in ``env``, in
    :data:`PLATFORMS`'s order."""
    return [default for platform in PLATFORMS for default in platform.launch_defaults(env)]


def scheduler(env: Mapping[str, str]) -> str | None:
    """The batch scheduler this process runs under, if any: ``"slurm"`` or ``"sge"``."""
    if slurm.in_job(env):
        return "slurm"
    if sge.in_job(env):
        return "sge"
    return None


__all__ = [
    "PLATFORMS",
    "LaunchDefault",
    "LaunchEnv",
    "Platform",
    "current",
    "launch_defaults",
    "read_world",
    "scheduler",
]


# A job started from inside another (a test run under ``ddpkit run``, on a SLURM node) must not see
# these: its launcher would take the enclosing job's address, ranks or scheduler's grant for its
# own.
LAUNCH_VARIABLES = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "NSLOTS",
        "SGE_TASK_ID",
        "SGE_ROOT",
        "JOB_ID",
    }
)
LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PMI_", "PMIX_", "OMPI_")
"""Variables through which a launcher or a scheduler tells a process where it sits in a job (and the
prefixes of whole families of them, :data:`LAUNCH_PREFIXES`)."""


def without_launch_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``env`` without :data:`LAUNCH_VARIABLES` and without any variable of
    :data:`LAUNCH_PREFIXES`: the environment for a job started from inside another (a test run under
    ``ddpkit run``, a SLURM node)."""
    return {
        k: v
        for k, v in env.items()
        if k not in LAUNCH_VARIABLES and not k.startswith(LAUNCH_PREFIXES)
    }
