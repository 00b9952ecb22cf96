"""One call to start, one frozen object that answers "who am I"."""

from __future__ import annotations

import atexit
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

from ddpkit._errors import ConfigError
from ddpkit._internals import ray_train
from ddpkit.distributed import _progress as progress
from ddpkit.distributed._environment import read_launch_env
from ddpkit.distributed._signals import hold_stop_signals
from ddpkit.platforms import _kubernetes as kubernetes
from ddpkit.platforms import _mpi as mpi
from ddpkit.platforms import _ray as ray
from ddpkit.platforms import _torchrun as torchrun
from ddpkit.platforms._base import LAUNCHER_NAMES, LaunchEnv

Group: TypeAlias = dist.ProcessGroup | None
"""A process group, or None for the world (the default group): what every ``group=`` of ddpkit
takes."""

# A hung collective (a rank died, or one rank skipped a collective the others entered) should
# surface in minutes, not after torch's default of 30 minutes for gloo or 10 for nccl.
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
    """The process group's backend, or None for a world of one run as plain ``python`` (no process
    group)."""
    launcher: str = "none"
    restart_count: int = 0
    """How many times the launcher has restarted this job's workers after a failure."""
    group: Group = field(default=None, compare=False)
    """The process group that ``rank``, ``world_size`` and ``is_main`` count in: None for the whole
    job, or a group of :func:`ddpkit.split_world` (then ``rank`` is the rank within the group)."""
    group_index: int = 0
    """Which group of :func:`ddpkit.split_world` this is (0 for the whole job)."""

    @property
    def is_main(self) -> bool:
        """True on rank 0 of the runtime's group: the rank that prints, logs and writes that group's
        files."""
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
SHUTDOWN_BARRIER_TIMEOUT = timedelta(seconds=30)
_generation = 0  # process groups this process has created, for their store prefixes
# (how it was reached, the rendezvous store), kept across init()s
_store_of: tuple[Any, Any] | None = None
_group_store: Any = None  # the store of the process group init() made, for shutdown()'s barrier


def _pick_device(launch: LaunchEnv, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if launch.local_world_size > count:
        raise ConfigError(
            f"{launch.local_world_size} processes on this node but only {count} GPU(s) visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): launch "
            f"with --nproc {count} (or --nproc auto), or pass device='cpu' to train on CPU"
        )
    return torch.device("cuda", launch.local_rank)


def _pick_backend(device: torch.device, backend: str | None) -> str:
    if backend is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if "nccl" in backend and not torch.cuda.is_available():
        # The same mistake otherwise ends in "ProcessGroupNCCL is only supported with GPUs, no GPUs
        # found!".
        raise ConfigError(
            f"backend {backend!r} needs CUDA GPUs but none is available on this machine: leave "
            "backend unset (gloo on CPU, nccl on GPU) or pass backend='gloo'"
        )
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            f"backend 'nccl' cannot run collectives on {device}: pass device='cuda' or "
            "backend='gloo'"
        )
    return backend


def _init_method(launch: LaunchEnv) -> str:
    if launch.launcher == "mpi" and (launch.master_addr is None or launch.master_port is None):
        addr, port = mpi.rendezvous_address()
        return f"tcp://{launch.master_addr or addr}:{launch.master_port or port}"
    if launch.launcher in ("slurm", "mpi", "pytorchjob"):
        return f"tcp://{launch.master_addr}:{launch.master_port}"
    return "env://"


def init(
    backend: str | None = None,
    *,
    device: str | torch.device | None = None,
    timeout: timedelta | None = None,
) -> Runtime:
    """Start this process's part of the job and return its :class:`Runtime`.

    Works the same under ``ddpkit run``, torchrun, SLURM ``srun``, :func:`ddpkit.spawn`, and plain
    ``python`` (a world of one with no process group). The device is ``cuda:LOCAL_RANK`` when CUDA
    is there, else the CPU; the backend follows the device (nccl for CUDA, gloo for CPU) unless
    ``backend`` names one. ``timeout`` bounds every collective: a rank left waiting that long raises
    instead of hanging; by default the launcher's ``--collective-timeout``, else ``DEFAULT_TIMEOUT``
    (5 minutes). Calling it again returns the same runtime; asking then for another backend or
    device is an error (the process group cannot change under the objects already built on it).
    """
    global _runtime
    if _runtime is not None:
        _check_same(_runtime, backend, device)
        return _runtime
    launch = read_launch_env()
    # Ray Train's context holds no count of its restarts: each rank keeps its own
    if launch.launcher == "ray":
        launch = dataclasses.replace(
            launch, restart_count=ray_train.count_start(launch.rank, ray.job_id(os.environ))
        )
    if timeout is None:
        timeout = (
            timedelta(seconds=launch.collective_timeout)
            if launch.collective_timeout
            else DEFAULT_TIMEOUT
        )
    dev = _pick_device(launch, device)
    if launch.launcher == "none":
        # no launcher, no group made by hand
        if not (dist.is_available() and dist.is_initialized()):
            kubernetes.check_not_alone_in_torchrun_pod(os.environ)
        if backend is not None:
            _pick_backend(dev, backend)  # still reject nccl without GPUs, as a real launch would
        _runtime = Runtime(0, 0, 1, 1, dev, None, "none")
        return _runtime
    pg_backend = _pick_backend(dev, backend)
    # A scheduler's warning (SLURM --signal=USR1) can come at any time; before fit() listens it must
    # not kill.
    hold_stop_signals()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        global _generation
        try:
            store = _rendezvous_store(launch, timeout)
            # The rendezvous store outlives a destroyed group: a second init in the same processes
            # would read the first group's addresses under torch's key prefix. A prefix per init
            # keeps them apart.
            _generation += 1
            global _group_store
            _group_store = dist.PrefixStore(f"ddpkit/{_generation}", store)
            dist.init_process_group(
                pg_backend,
                store=_group_store,
                rank=launch.rank,
                world_size=launch.world_size,
                timeout=timeout,
                **bound_device(dev, pg_backend),
            )
        except (RuntimeError, dist.DistError) as err:
            raise _explain_init_error(err, launch) from err
        atexit.register(_destroy_at_exit)
        progress.collective_timeout(timeout.total_seconds())  # what the stall watch must beat
    if launch.local_rank == 0 and (uneven := torchrun.uneven_nodes(os.environ)):
        print(uneven, file=sys.stderr, flush=True)
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


def bound_device(dev: torch.device, backend: str) -> dict[str, Any]:
    """``init_process_group``'s ``device_id`` for a rank whose collectives run through NCCL: its
    communicators are made for that GPU, where torch's newer NCCL group would otherwise pick one
    from ``LOCAL_RANK`` or the global rank, another rank's GPU when ranks are mapped to GPUs
    otherwise (``device='cuda:1'`` on local rank 0): two ranks on one GPU, which NCCL refuses
    ("Duplicate GPU detected"). Nothing on the CPU or on gloo."""
    if dev.type != "cuda" or "nccl" not in backend:
        return {}
    return {
        "device_id": torch.device(
            "cuda", dev.index if dev.index is not None else torch.cuda.current_device()
        )
    }


def _rendezvous_store(launch: LaunchEnv, timeout: timedelta) -> Any:
    """The job's rendezvous store, made once per process and kept for every later init().

    Rendezvous again after a shutdown() would have rank 0 start a new store server on the port of
    the old one, which it may not have closed yet: a peer that connects at that moment reaches the
    old server as it goes ("Connection was likely closed"). One store for the process's lifetime, a
    key prefix per group.
    """
    global _store_of
    key = (_init_method(launch), launch.rank, launch.world_size)
    if _store_of is None or _store_of[0] != key:
        store, _, _ = next(dist.rendezvous(key[0], launch.rank, launch.world_size, timeout=timeout))
        _store_of = (key, store)
    return _store_of[1]


def _check_same(rt: Runtime, backend: str | None, device: str | torch.device | None) -> None:
    if backend is not None and backend != (rt.backend or backend):
        raise ConfigError(
            f"ddpkit.init(backend={backend!r}) but this process already runs with backend "
            f"{rt.backend!r}: pass the same backend (or none), or call ddpkit.shutdown() first"
        )
    if rt.backend is None and backend is not None:
        _pick_backend(rt.device, backend)  # a world of one: still reject what could not run
    asked = torch.device(device) if device is not None else rt.device
    if asked.type != rt.device.type or asked.index not in (None, rt.device.index):
        raise ConfigError(
            f"ddpkit.init(device={str(device)!r}) but this process already runs on {rt.device}: "
            "pass the same device (or none), or call ddpkit.shutdown() first"
        )


def _explain_init_error(err: Exception, launch: LaunchEnv) -> Exception:
    text = str(err)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return ConfigError(
            f"port {launch.master_port} on {launch.master_addr} is already in use (another job?): "
            "run with `ddpkit run`, which lets the agent pick a free port, or set MASTER_PORT to "
            "a free port"
        )
    if "timed out" in text.lower() or "timeout" in text.lower():
        return ConfigError(
            f"rank {launch.rank} could not reach the other ranks at "
            f"{launch.master_addr}:{launch.master_port} (world size {launch.world_size}): check "
            "that every rank was started, and that MASTER_ADDR / --rdzv-endpoint names a host all "
            "nodes can reach"
        )
    return err


class NotInitializedError(RuntimeError):
    """A launcher started several processes but this one has not called :func:`ddpkit.init` yet."""


_NOT_A_MEMBER = (
    "global rank {rank} is not a member of the group it was given: pass each rank its own group "
    "(split_world() returns it)"
)


def get_runtime(group: Group = None, member: bool = False) -> Runtime:
    """Who this process is: its :class:`Runtime` in the job, or with ``group``, in that group.

    ``group`` is a group of :func:`~ddpkit.split_world` (returned as it is), a process group made by
    hand (its rank and size, with ``group`` set; -1 for both on a process outside it), or None for
    the whole job. This is the one place ddpkit asks where a process sits; everything that takes a
    ``group`` asks here.

    Before :func:`init`, plain ``python`` (or a launcher that started one process) is a world of one
    on the CPU, and a process group the script made itself with
    ``torch.distributed.init_process_group`` is taken as it is. Under a launcher whose variables say
    there are several ranks, and no process group, it raises
    :class:`~ddpkit.distributed._runtime.NotInitializedError`: a world of one there would train one
    independent copy per rank on the whole data set, every copy writing the same files, and exit 0.
    Refusing, as ``torch.distributed`` does before ``init_process_group``, is chosen over starting
    the process group here: joining a job is a collective that every rank must reach at the same
    point, which a call hidden in a loader or a Trainer cannot promise. ``member``: a process
    outside ``group`` is refused (a Trainer's group).
    """
    if isinstance(group, Runtime):
        if member and group.rank < 0:
            raise ConfigError(_NOT_A_MEMBER.format(rank=get_runtime().rank))
        return group
    rt = _runtime if _runtime is not None else _without_init()
    if group is None or group is dist.GroupMember.WORLD or not rt.distributed:
        return rt
    # A process outside ``group`` gets rank and size -1, as from torch.distributed: it is not the
    # group's main rank, and the collective helpers leave it alone.
    rank = dist.get_rank(group)
    if member and rank < 0:
        raise ConfigError(_NOT_A_MEMBER.format(rank=rt.rank))
    return dataclasses.replace(rt, rank=rank, world_size=dist.get_world_size(group), group=group)


def _without_init() -> Runtime:
    """The runtime of a process that has not called :func:`init` (see :func:`get_runtime`)."""
    launch = read_launch_env()
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        return Runtime(
            dist.get_rank(),
            launch.local_rank,
            dist.get_world_size(),
            launch.local_world_size,
            device,
            backend,
            launch.launcher,
            launch.restart_count,
        )
    if launch.world_size > 1:
        source = LAUNCHER_NAMES.get(launch.launcher, launch.launcher)
        raise NotInitializedError(
            f"this is rank {launch.rank} of {launch.world_size} started by {source}, but "
            "ddpkit.init() was not called (or ddpkit.shutdown() already ran): call ddpkit.init() "
            "at the start of the script, before building loaders, models or a Trainer"
        )
    return Runtime(0, 0, 1, 1, torch.device("cpu"), None, "none")


def forget() -> None:
    """Drop the runtime without touching process groups: for a forked child, whose parent's runtime
    (and store connection) is not its."""
    global _runtime, _store_of, _group_store
    _runtime, _store_of, _group_store = None, None, None


def shutdown(*, wait_for_peers: bool = True) -> None:
    """Destroy the process group (if any) and forget the runtime, so :func:`init` may be called
    again.

    Every rank of the job calls it (as every rank called :func:`init`); it returns once all have.
    ``wait_for_peers=False`` is for a rank that failed: its peers may be stuck in a collective and
    never come, and waiting for them would only hold the failure back (by up to 30 s).
    """
    global _runtime
    if wait_for_peers and dist.is_initialized() and _runtime is not None:
        _store_barrier(_runtime.world_size)
    _destroy()


def _store_barrier(world_size: int) -> None:
    """Wait until every rank has reached shutdown(), through the store rather than the group's
    connections.

    A collective returns on a rank once it has what it needs, possibly before a peer has read the
    last bytes this rank sent it; a rank that then destroyed its group would close that connection
    under the peer, whose collective fails ("Connection closed by peer"). A barrier over the group
    itself has the same race on its own last message; the store's is answered by the store's server,
    independent of the group's connections. Bounded: a peer that never comes (it died; its launcher
    is ending the job) delays the exit, never hangs it.
    """
    store = _group_store
    if store is None or world_size < 2:
        return
    try:
        with progress.collective("shutdown"):  # every rank waits here for the others
            if store.add("shutdown", 1) == world_size:
                store.set("shutdown/all", "1")
            store.wait(["shutdown/all"], SHUTDOWN_BARRIER_TIMEOUT)
    except (RuntimeError, dist.DistError):
        pass  # a peer is gone or the store with it: nothing left to protect


def _destroy() -> None:
    global _runtime, _group_store
    if dist.is_initialized():
        # After a collective returns, a gloo worker thread can still hold the work and its tensors
        # for a moment. If the interpreter is finalising when it lets go, releasing a tensor needs
        # the GIL and the process aborts ("terminate called without an active exception", seen in ~1
        # of 10 exits; pytorch#179291). There is no handle to wait on, so let the workers settle
        # before tearing down.
        time.sleep(0.1)
        dist.destroy_process_group()
    _runtime = None
    _group_store = None


def _destroy_at_exit() -> None:
    # Runs while the interpreter is still whole, for scripts that do not call shutdown() themselves.
    # No barrier:
    # at exit a peer may have failed, and nothing of this process's is left to run after the
    # teardown.
    if dist.is_initialized():
        _destroy()
