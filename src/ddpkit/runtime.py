"""One call to start, one frozen object that answers "who am I"."""

from __future__ import annotations

import atexit
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.cluster import LaunchEnv, read_launch_env
from ddpkit.errors import ConfigError

# A hung collective (a rank died, or one rank skipped a collective the others entered) should surface in
# minutes, not after torch's default of 30 minutes for gloo or 10 for nccl.
DEFAULT_TIMEOUT = timedelta(minutes=5)


@dataclass(frozen=True)
class Runtime:
    """This process's place in the job. Built once by :func:`init`; read everywhere else."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None
    """The process group's backend, or None for a world of one run as plain ``python`` (no process group)."""
    launcher: str = "none"
    restart_count: int = 0
    """How many times the launcher has restarted this job's workers after a failure."""
    group: Any = field(default=None, compare=False)
    """The process group that ``rank``, ``world_size`` and ``is_main`` count in: None for the whole job, or a
    group of :func:`ddpkit.split_world` (then ``rank`` is the rank within the group)."""
    group_index: int = 0
    """Which group of :func:`ddpkit.split_world` this is (0 for the whole job)."""

    @property
    def is_main(self) -> bool:
        """True on rank 0 of the runtime's group: the rank that prints, logs and writes that group's files."""
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        """True on local rank 0 of each node: the rank that prepares node-local files."""
        return self.local_rank == 0

    @property
    def distributed(self) -> bool:
        """True when a process group exists, so collectives and DDP are live."""
        return self.backend is not None


_runtime: Runtime | None = None
_generation = 0  # process groups this process has created, for their store prefixes


def _pick_device(launch: LaunchEnv, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if launch.local_world_size > count:
        raise ConfigError(
            f"{launch.local_world_size} processes on this node but only {count} GPU(s) visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): launch with "
            f"--nproc {count} (or --nproc auto), or pass device='cpu' to train on CPU"
        )
    return torch.device("cuda", launch.local_rank)


def _pick_backend(device: torch.device, backend: str | None) -> str:
    if backend is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if "nccl" in backend and not torch.cuda.is_available():
        # The same mistake otherwise ends in "ProcessGroupNCCL is only supported with GPUs, no GPUs found!".
        raise ConfigError(
            f"backend {backend!r} needs CUDA GPUs but none is available on this machine: leave backend unset "
            "(gloo on CPU, nccl on GPU) or pass backend='gloo'"
        )
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(f"backend 'nccl' cannot run collectives on {device}: pass device='cuda' or backend='gloo'")
    return backend


def _init_method(launch: LaunchEnv) -> str:
    if launch.launcher == "slurm":
        return f"tcp://{launch.master_addr}:{launch.master_port}"
    return "env://"


def init(
    backend: str | None = None,
    *,
    device: str | torch.device | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
) -> Runtime:
    """Start this process's part of the job and return its :class:`Runtime`.

    Works the same under ``ddpkit run``, torchrun, SLURM ``srun``, :func:`ddpkit.spawn`, and plain ``python``
    (a world of one with no process group). The device is ``cuda:LOCAL_RANK`` when CUDA is there, else the CPU;
    the backend follows the device (nccl for CUDA, gloo for CPU) unless ``backend`` names one.
    Calling it again returns the same runtime.
    """
    global _runtime
    if _runtime is not None:
        return _runtime
    launch = read_launch_env()
    dev = _pick_device(launch, device)
    if launch.launcher == "none":
        if backend is not None:
            _pick_backend(dev, backend)  # still reject nccl without GPUs, as a real launch would
        _runtime = Runtime(0, 0, 1, 1, dev, None, "none")
        return _runtime
    pg_backend = _pick_backend(dev, backend)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        global _generation
        try:
            store, _, _ = next(dist.rendezvous(_init_method(launch), launch.rank, launch.world_size, timeout=timeout))
            # The rendezvous store outlives a destroyed group, and torch reuses its key prefix: a second init in
            # the same processes would read the first group's addresses. A prefix per init keeps them apart.
            _generation += 1
            dist.init_process_group(
                pg_backend,
                store=dist.PrefixStore(f"ddpkit/{_generation}", store),
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=timeout,
            )
        except (RuntimeError, dist.DistError) as err:
            raise _explain_init_error(err, launch) from err
        atexit.register(_destroy_at_exit)
    _runtime = Runtime(
        launch.rank,
        launch.local_rank,
        launch.world_size,
        launch.local_world_size,
        dev,
        pg_backend,
        launch.launcher,
        launch.restart_count,
    )
    return _runtime


def _explain_init_error(err: Exception, launch: LaunchEnv) -> Exception:
    text = str(err)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return ConfigError(
            f"port {launch.master_port} on {launch.master_addr} is already in use (another job?): run with "
            "`ddpkit run`, which lets the agent pick a free port, or set MASTER_PORT to a free port"
        )
    if "timed out" in text.lower() or "timeout" in text.lower():
        return ConfigError(
            f"rank {launch.rank} could not reach the other ranks at {launch.master_addr}:{launch.master_port} "
            f"(world size {launch.world_size}): check that every rank was started, and that MASTER_ADDR / "
            "--rdzv-endpoint names a host all nodes can reach"
        )
    return err


def get_runtime() -> Runtime:
    """The runtime :func:`init` built; before ``init``, a world of one on the default device."""
    if _runtime is not None:
        return _runtime
    return Runtime(0, 0, 1, 1, torch.device("cpu"), None, "none")


def forget() -> None:
    """Drop the runtime without touching process groups: for a forked child, whose parent's runtime is not its."""
    global _runtime
    _runtime = None


def shutdown() -> None:
    """Destroy the process group (if any) and forget the runtime, so :func:`init` may be called again."""
    global _runtime
    if dist.is_initialized():
        # After a collective returns, a gloo worker thread can still hold the work and its tensors for a moment.
        # If the interpreter is finalising when it lets go, releasing a tensor needs the GIL and the process
        # aborts ("terminate called without an active exception", seen in ~1 of 10 exits; pytorch#179291).
        # There is no handle to wait on, so let the workers settle before tearing down.
        time.sleep(0.1)
        dist.destroy_process_group()
    _runtime = None


def _destroy_at_exit() -> None:
    # Runs while the interpreter is still whole, for scripts that do not call shutdown() themselves.
    if dist.is_initialized():
        shutdown()
