"""The cores this process may use: a scheduler's grant (SLURM, Grid Engine), else the affinity
within the container's CPU quota (a Kubernetes pod's limit). Grid Engine names no ranks (its jobs
run ``ddpkit run`` or ``mpiexec``), so it is read here only, and is no platform."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping


def cpu_count(env: Mapping[str, str] | None = None) -> int:
    """Cores this process may use: the scheduler's grant (SGE ``NSLOTS``, ``SLURM_CPUS_ON_NODE``),
    else its affinity within its cgroup's CPU quota (a container's CPU limit, rounded up)."""
    env = os.environ if env is None else env
    for granted in (env.get("NSLOTS"), env.get("SLURM_CPUS_ON_NODE")):
        if granted is not None and granted.isascii() and granted.isdigit() and int(granted) > 0:
            return int(granted)
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return count if quota is None else max(1, min(count, math.ceil(quota)))


def cgroup_cpu_quota(
    root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup"
) -> float | None:
    """The CPUs this process's cgroup v2 quota allows (``cpu.max`` of its cgroup and of every
    parent, the tightest), or None without one. Affinity (what torch and Python read) shows every
    core of the node in a pod limited to a few; cgroup v1 is not read."""
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
