"""torch's process groups where ddpkit reaches past their public API: the state a process keeps of
them, reset for a script that runs again in the same process, and NCCL's abort."""

from __future__ import annotations

import contextlib
import inspect

from ddpkit._internals.contract import Internal


def reset_process_groups() -> None:
    """Leave this process's process groups as a fresh process has them: every group destroyed, and
    torch's count of unnamed groups back at 0. An ``init_process_group`` that failed half-way (a
    peer lost while the group was made) counted its group without making it: the next group of
    this process would be named otherwise than its peers' (the same count on every rank names the
    same group), and would wait for them until the collective timeout. Public destroy does this
    only for a default group that exists."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_available():
        return
    if dist.is_initialized():
        dist.destroy_process_group()  # every group, the count with them
        return
    world = c10d._world
    for group in list(world.pg_names):  # groups made beside a default one that failed
        with contextlib.suppress(Exception):
            group.shutdown()
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config):
        table.clear()
    world.group_count = 0


def _check_reset() -> str | None:
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    for name in ("group_count", "pg_map", "pg_names", "pg_group_ranks", "pg_backend_config"):
        if not hasattr(world, name):
            return f"torch.distributed.distributed_c10d._world has no {name}"
    if "_world.group_count" not in inspect.getsource(c10d._process_group_name):
        return "torch no longer names unnamed process groups by _world.group_count"
    return None


def abort_nccl_groups() -> None:
    """Abort this process's NCCL groups (a recovery in place); nothing where they are not NCCL's."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        dist.distributed_c10d._abort_process_group()


def _check_abort() -> str | None:
    import torch.distributed as dist

    found = callable(getattr(dist.distributed_c10d, "_abort_process_group", None))
    return None if found else "torch.distributed has no _abort_process_group"


INTERNALS = [
    Internal(
        "torch.distributed.distributed_c10d._world (group_count, pg_map, pg_names, ...)",
        "torch",
        "--recover in-place after a failure while the process group was made (the rerun's group "
        "named as its peers')",
        _check_reset,
    ),
    Internal(
        "torch.distributed.distributed_c10d._abort_process_group",
        "torch",
        "--recover in-place on NCCL (a rank's collectives ended at once)",
        _check_abort,
    ),
]
