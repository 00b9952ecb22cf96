"""torchrun, ``ddpkit run``, :func:`ddpkit.spawn`, or any launcher that exports PyTorch's
``env://`` variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``),
and what torchrun's agent adds (``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE``, ``TORCHELASTIC_*``)."""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit._errors import ConfigError
from ddpkit.platforms import _slurm as slurm
from ddpkit.platforms._base import LaunchEnv, checked, read_int

NAME = "torchrun"

VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
"""Any of these set means a launcher meant this process to be a rank; all three must then be set."""

OPTION_PREFIX = "PET_"  # torchrun's parser reads PET_<OPTION> as each option's default


def detect(env: Mapping[str, str]) -> bool:
    return any(name in env for name in VARS)


def world(env: Mapping[str, str], launcher: str = NAME) -> LaunchEnv:
    """The ranks as ``env://`` names them; ``launcher``: who set them (``"ray"``)."""
    present = [name for name in VARS if name in env]
    missing = [name for name in VARS if name not in env]
    if missing:
        raise ConfigError(
            f"{', '.join(present)} set but {', '.join(missing)} not: launch with `ddpkit run` or "
            f"torchrun, or unset {', '.join(present)} to run as a single process"
        )
    world_size = read_int(env, "WORLD_SIZE")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in env:
            raise ConfigError(
                f"RANK and WORLD_SIZE are set but {name} is not: launch with `ddpkit run` or "
                f"torchrun, which set it, or export {name}"
            )
    return checked(
        LaunchEnv(
            rank=read_int(env, "RANK"),
            local_rank=read_int(env, "LOCAL_RANK"),
            world_size=world_size,
            local_world_size=read_int(env, "LOCAL_WORLD_SIZE", world_size),
            launcher=launcher,
            master_addr=env["MASTER_ADDR"],
            master_port=read_int(env, "MASTER_PORT"),
            restart_count=read_int(env, "TORCHELASTIC_RESTART_COUNT", 0) + slurm.restarts(env),
        )
    )


def started_by_agent(env: Mapping[str, str]) -> bool:
    """Started by torchrun's agent, not by another launcher that exports its variables."""
    return "TORCHELASTIC_RUN_ID" in env


def run_id(env: Mapping[str, str]) -> str:
    """The agent's run id (``TORCHELASTIC_RUN_ID``, the rendezvous id), ``""`` outside an agent."""
    return env.get("TORCHELASTIC_RUN_ID", "")


def error_file(env: Mapping[str, str]) -> str | None:
    """Where the agent reads a failed worker's exception (``TORCHELASTIC_ERROR_FILE``), or None."""
    return env.get("TORCHELASTIC_ERROR_FILE") or None


def master_address(env: Mapping[str, str]) -> tuple[str, str] | None:
    """(``MASTER_ADDR``, ``MASTER_PORT``) where both are set and the port is digits."""
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT", "")
    return (addr, port) if addr and port.isdigit() else None


def attempt_env(restart_count: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables that change for an attempt started in place: its count and the store's
    address."""
    return {
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def restart_count(env: Mapping[str, str]) -> int:
    """``TORCHELASTIC_RESTART_COUNT`` (0 where unset or not a number)."""
    text = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(text) if text.isdigit() else 0


def rank_text(env: Mapping[str, str]) -> str:
    """``RANK`` as set (``"0"`` where unset), for a file name."""
    return env.get("RANK", "0")


def option_variables(env: Mapping[str, str]) -> list[str]:
    """The ``PET_*`` variables set, each the default of a torchrun option."""
    return [name for name in env if name.startswith(OPTION_PREFIX)]


def uneven_nodes(env: Mapping[str, str]) -> str | None:
    """A warning when torchrun's nodes run different numbers of processes (a typo?); else None."""
    try:
        nodes, world, here = (
            int(env[name]) for name in ("GROUP_WORLD_SIZE", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
        )
    except (KeyError, ValueError):
        return None
    if nodes < 2 or nodes * here == world:
        return None
    return (
        f"ddpkit: {world} processes on {nodes} nodes, {here} of them on this node: the nodes run "
        "different numbers of processes. Pass the same --nproc (torchrun: --nproc-per-node) on "
        "every node unless this is meant (ranks are numbered node after node; per-node settings "
        "such as threads and GPUs then differ between nodes)."
    )
