"""One call to start, one frozen object that answers "who am I", and printing from the main rank
only."""

from __future__ import annotations

import atexit
import builtins
import contextlib
import dataclasses
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

from ddpkit._errors import ConfigError, checked_arguments
from ddpkit._internals import ray_train
from ddpkit.distributed import _progress as progress
from ddpkit.distributed._channels import RECOVER, channel
from ddpkit.distributed._environment import read_launch_env
from ddpkit.distributed._signals import hold_stop_signals
from ddpkit.platforms import _kubernetes as kubernetes
from ddpkit.platforms import _mpi as mpi
from ddpkit.platforms import _ray as ray
from ddpkit.platforms import _torchrun as torchrun
from ddpkit.platforms._base import LAUNCHER_NAMES, LaunchEnv

Group: TypeAlias = dist.ProcessGroup | None
"""A process group, or None for the whole job: what every ``group=`` of ddpkit takes."""

# a hung collective surfaces in minutes, not after torch's 30 (gloo) or 10 (nccl)
DEFAULT_TIMEOUT = timedelta(minutes=5)


def is_live(group: Group = None) -> bool:
    """True when collectives on ``group`` run: a process group, of which this is a member."""
    # a rank outside a new_group() holds torch's NON_GROUP_MEMBER sentinel in place of a group
    non_member: object = dist.GroupMember.NON_GROUP_MEMBER
    return dist.is_available() and dist.is_initialized() and (group is None or group != non_member)


@dataclass(frozen=True)
class Runtime:
    """This process's place in the job. Built once by :func:`init`; read everywhere else."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None
    """The process group's backend, or None for a world of one (no process group)."""
    launcher: str = "none"
    restart_count: int = 0
    """How many times the launcher has restarted this job's workers after a failure."""
    group: Group = field(default=None, compare=False)
    """The process group ``rank`` and ``world_size`` count in (None: the whole job)."""
    group_index: int = 0
    """Which group of :func:`ddpkit.split_world` this is (0 for the whole job)."""

    @property
    def is_main(self) -> bool:
        """True on rank 0 of the runtime's group: the rank that prints, logs and writes files."""
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
joined_at = 0.0  # time.time() when this process last made the job's process group
_group_store: Any = None  # the store of the process group init() made, for shutdown()'s barrier
_destroy_at_exit = False


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
        return "mpi://"  # mpi.rendezvous_store()
    if launch.launcher in ("slurm", "mpi", "pytorchjob"):
        return f"tcp://{launch.master_addr}:{launch.master_port}"
    return "env://"


@checked_arguments
def init(
    backend: str | None = None,
    *,
    device: str | torch.device | None = None,
    timeout: timedelta | None = None,
) -> Runtime:
    """Start this process's part of the job and return its :class:`Runtime`.

    The same under ``ddpkit run``, torchrun, SLURM ``srun``, :func:`ddpkit.spawn`, and plain
    ``python`` (a world of one with no process group). The device is ``cuda:LOCAL_RANK`` when CUDA
    is there, else the CPU; the backend follows it (nccl, gloo) unless ``backend`` names one.
    ``timeout`` bounds every collective (default: the launcher's ``--collective-timeout``, else 5
    minutes). Called again, it returns the same runtime; another backend or device is an error.
    """
    global _runtime
    if _runtime is not None:
        _check_same(_runtime, backend, device)
        return _runtime
    launch = read_launch_env()
    if (
        launch.launcher == "ray"
    ):  # Ray's context holds no count of its restarts: each rank keeps one
        count = ray_train.count_start(launch.rank, ray.job_id(os.environ))
        launch = dataclasses.replace(launch, restart_count=count)
    if timeout is None:
        seconds = launch.collective_timeout
        timeout = timedelta(seconds=seconds) if seconds else DEFAULT_TIMEOUT
    dev = _pick_device(launch, device)
    if launch.launcher == "none":  # a world of one, no process group
        if not (dist.is_available() and dist.is_initialized()):  # nor a group made by hand
            kubernetes.check_not_alone_in_torchrun_pod(os.environ)
        if backend is not None:
            _pick_backend(dev, backend)  # nccl without GPUs refused, as a real launch would
        _runtime = Runtime(0, 0, 1, 1, dev, None, "none")
        return _runtime
    pg_backend = _pick_backend(dev, backend)
    hold_stop_signals()  # a scheduler's warning (SLURM --signal=USR1) before fit() listens
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        _join(launch, pg_backend, dev, timeout)
    if launch.local_rank == 0 and (uneven := torchrun.uneven_nodes(os.environ)):
        print(uneven, file=sys.stderr, flush=True)
    _runtime = Runtime(
        launch.rank, launch.local_rank, launch.world_size, launch.local_world_size, dev,
        pg_backend, launch.launcher, launch.restart_count,
    )  # fmt: skip
    return _runtime


def _join(launch: LaunchEnv, backend: str, dev: torch.device, timeout: timedelta) -> None:
    """Make the job's process group on its rendezvous store."""
    global _generation, _group_store
    try:
        store = _rendezvous_store(launch, timeout)
        # The store outlives a destroyed group: a key prefix per init keeps a second group from
        # reading the first one's addresses.
        _generation += 1
        _group_store = dist.PrefixStore(f"ddpkit/{_generation}", store)
        # on NCCL, the rank's own GPU (with its index: torch.cuda.set_device() took it), where
        # torch would pick one from LOCAL_RANK ("Duplicate GPU detected")
        nccl = dev.type == "cuda" and "nccl" in backend
        bound: dict[str, Any] = {"device_id": dev} if nccl else {}
        dist.init_process_group(
            backend,
            store=_group_store,
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=timeout,
            **bound,
        )
    except (RuntimeError, dist.DistError) as err:
        raise _explain_init_error(err, launch) from err
    global joined_at, _destroy_at_exit
    joined_at = time.time()
    # for scripts that do not call shutdown(); no barrier: at exit a peer may have failed. Once
    # per process: a script run again in it (ddpkit run --recover in-place) inits again.
    if not _destroy_at_exit:
        _destroy_at_exit = True
        atexit.register(_destroy)
    progress.collective_timeout(timeout.total_seconds())  # what the stall watch must beat


def _rendezvous_store(launch: LaunchEnv, timeout: timedelta) -> Any:
    """The job's rendezvous store, made once per process and kept for every later init() (a new
    server on the old one's port could be reached by a peer as the old one goes); forgotten for a
    rerun in place (:func:`forget_for_recovery`), whose store is a new one at a new address."""
    global _store_of
    key = (_init_method(launch), launch.rank, launch.world_size)
    if _store_of is None or _store_of[0] != key:
        if key[0] == "mpi://":
            store = mpi.rendezvous_store(launch, timeout)
        else:
            rendezvous = dist.rendezvous(key[0], launch.rank, launch.world_size, timeout=timeout)
            store = next(rendezvous)[0]
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

    ``group``: a group of :func:`~ddpkit.split_world`, a process group made by hand (rank and size
    -1 outside it; refused there with ``member``), or None for the whole job. Before :func:`init`,
    plain ``python`` is a world of one and a process group the script made is taken as it is;
    under a launcher of several ranks it raises :class:`NotInitializedError`.
    """
    if isinstance(group, Runtime):
        if member and group.rank < 0:
            raise ConfigError(_NOT_A_MEMBER.format(rank=get_runtime().rank))
        return group
    rt = _runtime if _runtime is not None else _without_init()
    if group is None or group is dist.GroupMember.WORLD or not rt.distributed:
        return rt
    # outside ``group``: rank and size -1, as torch.distributed says
    rank = dist.get_rank(group)
    if member and rank < 0:
        raise ConfigError(_NOT_A_MEMBER.format(rank=rt.rank))
    return dataclasses.replace(rt, rank=rank, world_size=dist.get_world_size(group), group=group)


def _without_init() -> Runtime:
    """The runtime of a process that has not called :func:`init` (see :func:`get_runtime`)."""
    launch = read_launch_env()
    if dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
        cuda = backend == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        return Runtime(
            dist.get_rank(), launch.local_rank, dist.get_world_size(), launch.local_world_size,
            device, backend, launch.launcher, launch.restart_count,
        )  # fmt: skip
    if launch.world_size > 1:
        source = LAUNCHER_NAMES.get(launch.launcher, launch.launcher)
        raise NotInitializedError(
            f"this is rank {launch.rank} of {launch.world_size} started by {source}, but "
            "ddpkit.init() was not called (or ddpkit.shutdown() already ran): call ddpkit.init() "
            "at the start of the script, before building loaders, models or a Trainer"
        )
    return Runtime(0, 0, 1, 1, torch.device("cpu"), None, "none")


def forget() -> None:
    """Drop the runtime without touching process groups (a forked child's parent's is not its)."""
    global _runtime, _store_of, _group_store
    _runtime, _store_of, _group_store = None, None, None


@checked_arguments
def shutdown(*, wait_for_peers: bool = True) -> None:
    """Destroy the process group (if any) and forget the runtime; every rank calls it, and it
    returns once all have (``wait_for_peers=False``: a failed rank's peers may never come)."""
    # a bounded barrier through the store (docs/runtime.md: one over the group would race with
    # the group's teardown)
    size = _runtime.world_size if _runtime is not None else 1
    if wait_for_peers and dist.is_initialized() and _group_store is not None and size > 1:
        try:
            with progress.collective("shutdown"):  # every rank waits here for the others
                if _group_store.add("shutdown", 1) == size:
                    _group_store.set("shutdown/all", "1")
                _group_store.wait(["shutdown/all"], SHUTDOWN_BARRIER_TIMEOUT)
        except (RuntimeError, dist.DistError):
            pass  # a peer is gone or the store with it: nothing left to protect
    _destroy()


def _destroy(settle: bool = True) -> None:
    global _runtime, _group_store
    if dist.is_initialized():
        # A gloo worker thread may still hold a finished collective's tensors; released while the
        # interpreter finalises, they abort it (pytorch#179291). No handle to wait on: settle.
        if settle:
            time.sleep(0.1)
        dist.destroy_process_group()
    _runtime = None
    _group_store = None


def forget_for_recovery() -> None:
    """Leave this process as before its first :func:`init` (a worker that left a failed step, to run
    its script again): every process group destroyed and torch's count of them reset, the runtime
    and the rendezvous store forgotten, its progress record counted afresh. No barrier: a peer is
    gone."""
    global _runtime, _group_store, _store_of, _generation
    from ddpkit._internals.groups import reset_process_groups

    with contextlib.suppress(Exception):  # a group whose connections were cut
        reset_process_groups()
    _runtime = _group_store = _store_of = None
    _generation = 0
    progress.reset()


# -- Printing and logging from the main rank of a group only (the DDP tutorials' ``if rank == 0:
# print(...)``).


def print0(*args: Any, group: Group = None, **kwargs: Any) -> None:
    """``print`` on rank 0 of ``group`` only."""
    if get_runtime(group).is_main:
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


@checked_arguments
def get_logger(
    name: str = "ddpkit", all_ranks: bool = False, group: Group = None
) -> logging.Logger:
    """A logger kept on rank 0 of ``group`` only, unless ``all_ranks`` (records tagged by rank)."""
    if group is not None and is_live(group):
        name = f"{name}.group{'-'.join(map(str, dist.get_process_group_ranks(group)))}"
    logger = logging.getLogger(name if not all_ranks else f"{name}.all_ranks")
    if not logger.handlers:
        handler = logging.StreamHandler()
        fmt = "[rank %(rank)s] %(message)s" if all_ranks else "%(message)s"
        handler.setFormatter(logging.Formatter(fmt))

        def tag_rank(record: logging.LogRecord) -> bool:
            rank = get_runtime(group).rank
            record.__dict__["rank"] = rank  # read by the format as %(rank)s
            return all_ranks or rank == 0

        handler.addFilter(tag_rank)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


# -- One run of a script in this process: what the run holds through ddpkit that would outlive
# its objects (signal handlers, folder locks, a store's files and threads), let go of before the
# script runs again in the same process (ddpkit run --recover in-place: release_all()); and what a
# launcher adds to the records of a resume (resumed()). A holder registers how it lets go (hold())
# and unregisters when it let go itself. The launcher that reruns a script is the only caller of
# release_all(), and registers the listeners of resumed(): the library never imports it.


def recovers_in_place() -> bool:
    """Whether this process's launcher runs the script again after a failure (``ddpkit run
    --recover in-place``: the job folder's ``recover/``)."""
    folder = channel(RECOVER)
    return folder is not None and folder.is_dir()


_held: dict[int, tuple[str, Callable[[], Callable[[], None] | None]]] = {}
_count = 0


def hold(what: str, release: Callable[[], None]) -> Callable[[], None]:
    """Have :func:`release_all` call ``release`` (``what``: the holder, as a line names it); return
    the function that unregisters it, for the holder that lets go itself. A bound method is held
    weakly: a holder that is gone has nothing left to let go."""
    global _count
    _count += 1
    key = _count
    if hasattr(release, "__self__") and hasattr(release, "__func__"):
        method = weakref.WeakMethod(release)
        _held[key] = (what, method)
    else:
        _held[key] = (what, lambda: release)

    def let_go() -> None:
        _held.pop(key, None)

    return let_go


def release_all() -> list[str]:
    """Let go of everything held, newest first; what could not be let go, a line each."""
    failed = []
    while _held:
        key = max(_held)
        what, get = _held.pop(key)
        release = get()
        if release is None:
            continue
        try:
            release()
        except Exception as err:  # noqa: BLE001  (the others are let go all the same)
            failed.append(f"{what}: {type(err).__name__}: {err}")
    return failed


@dataclass(frozen=True)
class Resume:
    """A resume, as the records' listeners see it: the step it goes on from, where its state came
    from (``"none"``: nowhere, it starts afresh), and when its load began and ended
    (``time.time()``)."""

    step: int
    source: str
    started: float
    restored: float


_listeners: list[Callable[[Resume], dict[str, Any] | None]] = []


def on_resume(listener: Callable[[Resume], dict[str, Any] | None]) -> None:
    """Have every resume (a Trainer's, a hand loop's :class:`~ddpkit.Snapshots`) record the event
    ``listener`` returns for it (None: none)."""
    if listener not in _listeners:
        _listeners.append(listener)


def resumed(resume: Resume) -> list[dict[str, Any]]:
    """The events the listeners record for ``resume``."""
    events = []
    for listener in _listeners:
        with contextlib.suppress(Exception):  # a record lost is not worth a failed resume
            if (event := listener(resume)) is not None:
                events.append(event)
    return events
