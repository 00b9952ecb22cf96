"""MPI: Open MPI's or MPICH's ``mpiexec``, which name the ranks but no rendezvous address."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from ddpkit._errors import ConfigError
from ddpkit._internals.store import serve_new_store
from ddpkit.platforms import _slurm as slurm
from ddpkit.platforms._base import LaunchEnv, checked, read_int

NAME = "mpi"

VARIANTS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)  # fmt: skip
"""(rank, world size, local rank, local world size) as Open MPI and MPICH export them."""


def _variant(env: Mapping[str, str]) -> tuple[str, str, str, str] | None:
    return next((names for names in VARIANTS if names[0] in env and names[1] in env), None)


def detect(env: Mapping[str, str]) -> bool:
    return _variant(env) is not None


def world(env: Mapping[str, str]) -> LaunchEnv:
    variant = _variant(env)
    assert variant is not None  # asked only where detect() said yes
    rank_var, size_var, local_var, local_size_var = variant
    return checked(
        LaunchEnv(
            rank=read_int(env, rank_var),
            local_rank=read_int(env, local_var, 0),
            world_size=read_int(env, size_var),
            local_world_size=read_int(env, local_size_var, 1),
            launcher=NAME,
            # if exported; else rendezvous_store()
            master_addr=env.get("MASTER_ADDR"),
            master_port=read_int(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
            restart_count=slurm.restarts(env),
        )
    )


_served: Any = None  # rank 0's store server, kept for the life of the process


def rendezvous_store(launch: LaunchEnv, timeout: timedelta) -> Any:
    """The job's store, served by rank 0 on a port it binds and keeps (``MASTER_PORT`` if exported),
    its address (rank 0's host name unless ``MASTER_ADDR`` says) sent to every rank through
    ``mpi4py``. For an ``mpiexec`` job that does not export both."""
    global _served
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError(
            "started by mpiexec without MASTER_ADDR and MASTER_PORT: install mpi4py (pip install "
            "'ddpkit[mpi]') so the ranks can agree on rank 0's address, or export both (mpiexec -x "
            "MASTER_ADDR -x MASTER_PORT)"
        ) from None
    import socket

    import torch.distributed as dist

    address: tuple[str, int] | str | None = None
    if launch.rank == 0:
        host = launch.master_addr or socket.gethostname()
        try:  # on every interface, as torch's
            _served, port = serve_new_store(host, timeout, bind="", port=launch.master_port or 0)
            address = (host, port)
        except OSError as err:  # sent to every rank, which would else wait for rank 0 forever
            address = (
                f"rank 0 cannot serve the job's store on port {launch.master_port} "
                f"({err.strerror}): export another MASTER_PORT, or none"
            )
    address = MPI.COMM_WORLD.bcast(address, root=0)
    if isinstance(address, str):
        raise ConfigError(address)
    host, port = address
    if launch.rank == 0:
        return _served
    return dist.TCPStore(host, port, launch.world_size, is_master=False, timeout=timeout)
