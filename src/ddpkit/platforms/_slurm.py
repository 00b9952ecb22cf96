"""SLURM: a step's task, its node list, its rendezvous port, requeues and granted CPUs."""

from __future__ import annotations

import re
from collections.abc import Mapping

from ddpkit._errors import ConfigError
from ddpkit.platforms._base import LaunchEnv, checked, read_int

NAME = "slurm"


def detect(env: Mapping[str, str]) -> bool:
    # a batch script or salloc shell has SLURM_PROCID too; only an srun step's task has STEP_ID
    return "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_STEP_ID" in env


def world(env: Mapping[str, str]) -> LaunchEnv:
    tasks = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    world_size = read_int(env, tasks)
    node_id = read_int(env, "SLURM_NODEID", 0)
    per_node = (
        env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world_size)
    )
    nodelist = (
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    )
    if not nodelist:
        raise ConfigError("SLURM_PROCID is set but no SLURM node list is: launch the job with srun")
    port = read_int(env, "MASTER_PORT") if "MASTER_PORT" in env else port_of_step(env)
    return checked(
        LaunchEnv(
            rank=read_int(env, "SLURM_PROCID"),
            local_rank=read_int(env, "SLURM_LOCALID", 0),
            world_size=world_size,
            local_world_size=_tasks_on_node(per_node, node_id),
            launcher=NAME,
            master_addr=env.get("MASTER_ADDR") or expand_hostlist(nodelist)[0],
            master_port=port,
            restart_count=restarts(env),
        )
    )


def job_id(env: Mapping[str, str]) -> str | None:
    """The job's id (``SLURM_JOB_ID``), the same on every node of the job; None outside SLURM."""
    return env.get("SLURM_JOB_ID")


def restarts(env: Mapping[str, str]) -> int:
    """How many times SLURM requeued the job (``SLURM_RESTART_COUNT``), 0 outside SLURM."""
    return read_int(env, "SLURM_RESTART_COUNT") if env.get("SLURM_RESTART_COUNT") else 0


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a SLURM node list such as ``gpu[01-03,07],login1`` or ``rack[1-2]-n[01-02]`` into host
    names (``scontrol show hostnames`` without SLURM's binaries)."""
    items = re.findall(r"(?:[^,\[]|\[[^\]]*\]?)+", hostlist)  # split at commas outside brackets
    return [host for item in items for host in _expand_one(item)]


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


# below Linux's ephemeral range (32768-60999), whose ports a client socket may take first
PORT_BASE, PORT_JOBS, PORT_STEPS = 20000, 750, 16


def port_of_step(env: Mapping[str, str]) -> int:
    """The rendezvous port each task of a step derives from the job and step ids alone."""
    job = read_int(env, "SLURM_JOB_ID", 0)
    step = env.get("SLURM_STEP_ID", "0")
    # "²".isdigit(), and int() refuses it
    step_id = int(step) if step.isascii() and step.isdigit() else 0
    return PORT_BASE + (job % PORT_JOBS) * PORT_STEPS + step_id % PORT_STEPS
