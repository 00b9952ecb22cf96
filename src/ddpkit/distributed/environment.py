"""Reading the launcher's environment: torchrun (and ``ddpkit run``), SLURM ``srun``, ``mpiexec``, a Kubeflow
PyTorchJob's pod (:mod:`ddpkit.distributed.kubernetes`), or nothing.

This is the only module that reads rank variables from ``os.environ``. It is pure logic (no process group, no
torch), so every branch is tested with a mocked environment.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ddpkit.distributed import kubernetes
from ddpkit.errors import ConfigError

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "none"
    """``"torchrun"`` (also ``ddpkit run`` and ``ddpkit.spawn``), ``"slurm"``, ``"mpi"`` (Open MPI or MPICH
    ``mpiexec``), ``"pytorchjob"`` (a Kubeflow PyTorchJob pod run without torchrun,
    :mod:`ddpkit.distributed.kubernetes`), ``"ray"`` (a Ray Train worker), or ``"none"`` (plain python)."""
    master_addr: str | None = None
    master_port: int | None = None
    collective_timeout: float | None = None
    """Seconds a collective may wait before it raises, as ``ddpkit run --collective-timeout`` set it
    (``DDPKIT_COLLECTIVE_TIMEOUT``); None for ``init()``'s default."""
    restart_count: int = 0
    """How many times the job has been restarted: by torchrun's agent (``TORCHELASTIC_RESTART_COUNT``) or by
    a SLURM requeue (``SLURM_RESTART_COUNT``); both add up under ``srun ddpkit run``. Under Ray Train, counted
    by :func:`ddpkit.distributed.runtime.init` (:mod:`ddpkit.internals.ray_train`)."""


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer; fix or unset {name}") from None


LAUNCHER_NAMES = {
    "torchrun": "torchrun/ddpkit run",
    "slurm": "SLURM srun",
    "mpi": "mpiexec",
    "pytorchjob": "a PyTorchJob",
    "ray": "Ray Train",
}
"""Each launcher as messages name it."""


def _check(info: LaunchEnv) -> LaunchEnv:
    source = LAUNCHER_NAMES.get(info.launcher, info.launcher)
    if info.world_size < 1:
        raise ConfigError(f"world size {info.world_size} from {source} must be >= 1")
    if not 0 <= info.rank < info.world_size:
        raise ConfigError(
            f"rank {info.rank} is outside the world of {info.world_size} processes set by {source}; "
            "each rank must be in [0, world size)"
        )
    if not 1 <= info.local_world_size <= info.world_size:
        raise ConfigError(
            f"{info.local_world_size} processes on this node but {info.world_size} in the whole job "
            f"({source}); the local world size must be between 1 and the world size"
        )
    if not 0 <= info.local_rank < info.local_world_size:
        raise ConfigError(
            f"local rank {info.local_rank} is outside the {info.local_world_size} processes of this node "
            f"set by {source}"
        )
    return info


def uneven_nodes(env: Mapping[str, str] | None = None) -> str | None:
    """A warning when torchrun's nodes run different numbers of processes, else None.

    torchrun accepts a different ``--nproc-per-node`` on each node and numbers the ranks node after node, so
    such a job runs; but it is usually a typo on one node, and it leaves GPUs idle or oversubscribes a node.
    Told from this process's variables alone (``GROUP_WORLD_SIZE`` nodes x ``LOCAL_WORLD_SIZE`` here against
    ``WORLD_SIZE``), with no collective.
    """
    env = os.environ if env is None else env
    try:
        nodes, world, here = (int(env[name]) for name in ("GROUP_WORLD_SIZE", "WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    except (KeyError, ValueError):
        return None
    if nodes < 2 or nodes * here == world:
        return None
    return (
        f"ddpkit: {world} processes on {nodes} nodes, {here} of them on this node: the nodes run different "
        "numbers of processes. Pass the same --nproc (torchrun: --nproc-per-node) on every node unless this is "
        "meant (ranks are numbered node after node; per-node settings such as threads and GPUs then differ "
        "between nodes)."
    )


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM node list such as ``gpu[01-03,07],login1`` or ``rack[1-2]-n[01-02]`` into host names.

    Written here because the alternative, ``scontrol show hostnames``, needs SLURM's binaries inside the job.
    """
    items, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    return [host for item in items if item for host in _expand_one(item)]


def _expand_one(name: str) -> list[str]:
    m = re.match(r"([^\[]*)\[([^\]]+)\](.*)$", name)
    if not m:
        return [name]
    prefix, ranges, rest = m.groups()
    tails = _expand_one(rest)
    hosts = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        for n in range(int(lo), int(hi or lo) + 1):
            hosts += [f"{prefix}{n:0{len(lo)}d}{tail}" for tail in tails]
    return hosts


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    # SLURM writes e.g. "2(x3),1": two tasks on each of three nodes, then one.
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m:
            raise ConfigError(f"cannot read SLURM_TASKS_PER_NODE={tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[min(node_id, len(counts) - 1)]


def _slurm_env(env: Mapping[str, str]) -> LaunchEnv:
    world_size = _int(env, "SLURM_NTASKS") if "SLURM_STEP_NUM_TASKS" not in env else _int(env, "SLURM_STEP_NUM_TASKS")
    node_id = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world_size)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError("SLURM_PROCID is set but no SLURM node list is: launch the job with srun")
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else slurm_port(env)
    return _check(
        LaunchEnv(
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            world_size=world_size,
            local_world_size=_tasks_on_node(per_node, node_id),
            launcher="slurm",
            master_addr=env.get("MASTER_ADDR") or expand_hostlist(nodelist)[0],
            master_port=port,
            restart_count=_slurm_restarts(env),
        )
    )


# Ports derived for SLURM steps lie below Linux's ephemeral range (32768-60999 by default), from which the
# kernel hands out the source ports of outgoing connections: a derived port there can be taken by any client
# socket on the node a moment before rank 0 binds it.
SLURM_PORT_BASE, SLURM_PORT_JOBS, SLURM_PORT_STEPS = 20000, 750, 16


def slurm_port(env: Mapping[str, str]) -> int:
    """The rendezvous port every task of a SLURM step derives alone: a function of the job id and step id.

    Concurrent steps of one job (``srun ... &`` twice in a batch script) differ in their step id and so get
    different ports; jobs whose ids differ by less than 750 never share a port. ``MASTER_PORT`` overrides it.
    """
    job = _int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0
    step = env.get("SLURM_STEP_ID", "0")
    step_id = int(step) if step.isascii() and step.isdigit() else 0  # "²".isdigit(), and int() refuses it
    return SLURM_PORT_BASE + (job % SLURM_PORT_JOBS) * SLURM_PORT_STEPS + step_id % SLURM_PORT_STEPS


def _slurm_restarts(env: Mapping[str, str]) -> int:
    return _int(env, "SLURM_RESTART_COUNT") if env.get("SLURM_RESTART_COUNT") else 0


def _is_slurm_task(env: Mapping[str, str]) -> bool:
    # Inside an allocation, a batch script or a salloc shell also carries SLURM_PROCID and SLURM_NTASKS; only a
    # task that srun started for a step has SLURM_STEP_ID. Nothing else may turn SLURM off: a job's name says
    # nothing (`srun -n2 bash -c "python train.py"` is named bash, and its two tasks are one job), and the
    # terminal variable of `srun --pty bash` (SLURM_PTY_PORT) is inherited by every step srun starts from that
    # shell. The shell's own step has one task unless asked otherwise, so a program run in it is a world of one.
    return "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env


MAX_TIMEOUT = 30 * 24 * 3600.0
"""The longest --join-timeout / --collective-timeout, in seconds (30 days): torch keeps timeouts in
milliseconds, and a value beyond its range would overflow instead of meaning "never"."""
MIN_TIMEOUT = 1.0
"""The shortest: below a second, setting up the process group itself times out, and the job fails as if the
ranks could not reach each other."""

_SECONDS = f"use a number of seconds from {MIN_TIMEOUT:.0f} to {MAX_TIMEOUT:.0f} (30 days)"


def check_seconds(option: str, value: float) -> float:
    """``value`` when it is a usable number of seconds for ``option``; else a :class:`ConfigError`."""
    if not (math.isfinite(value) and MIN_TIMEOUT <= value <= MAX_TIMEOUT):
        raise ConfigError(f"{option} {value}: {_SECONDS}")
    return value


def parse_seconds(option: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{option} {text[:40]!r}: {_SECONDS}") from None
    return check_seconds(option, value)


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read rank, world size and rendezvous address from the launcher's environment variables."""
    env = os.environ if env is None else env
    info = _read_ranks(env)
    if "DDPKIT_COLLECTIVE_TIMEOUT" in env and info.launcher != "none":
        seconds = parse_seconds("DDPKIT_COLLECTIVE_TIMEOUT", env["DDPKIT_COLLECTIVE_TIMEOUT"])
        info = replace(info, collective_timeout=seconds)
    return info


def _read_ranks(env: Mapping[str, str]) -> LaunchEnv:
    present = [name for name in _TORCHRUN_VARS if name in env]
    if present and kubernetes.pod_variables(env):
        return _pytorchjob_env(env)
    if present:
        missing = [name for name in _TORCHRUN_VARS if name not in env]
        if missing:
            raise ConfigError(
                f"{', '.join(present)} set but {', '.join(missing)} not: launch with `ddpkit run` or torchrun, "
                f"or unset {', '.join(present)} to run as a single process"
            )
        world_size = _int(env, "WORLD_SIZE")
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if name not in env:
                raise ConfigError(
                    f"RANK and WORLD_SIZE are set but {name} is not: launch with `ddpkit run` or torchrun, "
                    f"which set it, or export {name}"
                )
        return _check(
            LaunchEnv(
                rank=_int(env, "RANK"),
                local_rank=_int(env, "LOCAL_RANK"),
                world_size=world_size,
                local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world_size,
                # Ray Train's workers carry torchrun's variables (and the raylet's pid): Ray started them.
                launcher="ray" if "RAY_RAYLET_PID" in env and "TORCHELASTIC_RUN_ID" not in env else "torchrun",
                master_addr=env["MASTER_ADDR"],
                master_port=_int(env, "MASTER_PORT"),
                restart_count=(_int(env, "TORCHELASTIC_RESTART_COUNT") if "TORCHELASTIC_RESTART_COUNT" in env else 0)
                + _slurm_restarts(env),
            )
        )
    # MPI before SLURM: under `mpiexec` in a SLURM job, MPICH's and Open MPI's launchers start one srun task per
    # node and the ranks inside it, so SLURM_PROCID counts nodes there while the MPI variables count ranks.
    mpi_vars = _mpi_vars(env)
    if mpi_vars:
        return _mpi_env(env, mpi_vars)
    if _is_slurm_task(env):
        return _slurm_env(env)
    return LaunchEnv()


def _pytorchjob_env(env: Mapping[str, str]) -> LaunchEnv:
    """A PyTorchJob pod run without torchrun: one process per pod, so local rank 0 of 1."""
    kubernetes.check_one_process_per_pod(env)
    return _check(
        LaunchEnv(
            rank=_int(env, "RANK"),
            local_rank=0,
            world_size=_int(env, "WORLD_SIZE"),
            local_world_size=1,
            launcher="pytorchjob",
            master_addr=env["MASTER_ADDR"],
            master_port=_int(env, "MASTER_PORT"),
        )
    )


# (rank, world size, local rank, local world size) as Open MPI and MPICH's Hydra export them to each process.
_MPI_VARIANTS = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def _mpi_vars(env: Mapping[str, str]) -> tuple[str, str, str, str] | None:
    return next((names for names in _MPI_VARIANTS if names[0] in env and names[1] in env), None)


def _mpi_env(env: Mapping[str, str], mpi_vars: tuple[str, str, str, str]) -> LaunchEnv:
    rank_var, size_var, local_var, local_size_var = mpi_vars
    world_size = _int(env, size_var)
    return _check(
        LaunchEnv(
            rank=_int(env, rank_var),
            local_rank=_int(env, local_var) if local_var in env else 0,
            world_size=world_size,
            local_world_size=_int(env, local_size_var) if local_size_var in env else 1,
            launcher="mpi",
            # mpiexec names no rendezvous address: MASTER_ADDR/MASTER_PORT if exported (mpiexec -x / -genv),
            # else rank 0's host and a free port there, broadcast over MPI by mpi_rendezvous_address().
            master_addr=env.get("MASTER_ADDR"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
            restart_count=_slurm_restarts(env),
        )
    )


def mpi_rendezvous_address() -> tuple[str, int]:
    """Rank 0's host name and a port free there, agreed by every rank of an MPI job through ``mpi4py``."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise ConfigError(
            "started by mpiexec without MASTER_ADDR and MASTER_PORT: install mpi4py (pip install 'ddpkit[mpi]') "
            "so the ranks can agree on rank 0's address, or export both (mpiexec -x MASTER_ADDR -x MASTER_PORT)"
        ) from None
    import socket

    address = None
    if MPI.COMM_WORLD.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            address = (socket.gethostname(), s.getsockname()[1])
    return MPI.COMM_WORLD.bcast(address, root=0)


def cpu_count(env: Mapping[str, str] | None = None) -> int:
    """Cores this process may use: the scheduler's grant (SGE ``NSLOTS``, ``SLURM_CPUS_ON_NODE``), else its
    affinity within its cgroup's CPU quota (a container's CPU limit, rounded up)."""
    env = os.environ if env is None else env
    for name in ("NSLOTS", "SLURM_CPUS_ON_NODE"):
        if env.get(name, "").isascii() and env.get(name, "").isdigit() and int(env[name]) > 0:
            return int(env[name])
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return count if quota is None else max(1, min(count, math.ceil(quota)))


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> float | None:
    """The CPUs this process's cgroup v2 quota allows (``cpu.max`` of its cgroup and of every parent, the
    tightest), or None without one.

    A Kubernetes pod's CPU limit is such a quota, while affinity still shows every core of the node: without
    it, ``--nproc auto`` in a pod limited to 2 CPUs of a 64-core node would start 8 processes of 8 threads
    each. Python's ``os.process_cpu_count`` and torch read affinity only, so this small read is ddpkit's own.
    cgroup v1 hierarchies are not read (Kubernetes has kept them in maintenance only since 1.31)."""
    try:
        with open(membership) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    path = next((line[3:] for line in lines if line.startswith("0::")), None)
    if path is None:
        return None
    top = os.path.abspath(root)
    node, limits = os.path.abspath(os.path.join(top, path.lstrip("/"))), []
    while node.startswith(top):
        try:
            with open(os.path.join(node, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
            if quota != "max":
                limits.append(int(quota) / int(period))
        except (OSError, ValueError, ZeroDivisionError):
            pass
        if node == top:
            break
        node = os.path.dirname(node)
    return min(limits) if limits else None


def scheduler(env: Mapping[str, str] | None = None) -> str | None:
    """The batch scheduler this process runs under, if any."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" in env:
        return "slurm"
    if "SGE_TASK_ID" in env or "NSLOTS" in env or "JOB_ID" in env and "SGE_ROOT" in env:
        return "sge"
    return None
