"""torch's process groups where ddpkit reaches past their public API: the state a process keeps of
them, reset for a script that runs again in the same process, and NCCL's abort."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

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
        with contextlib.suppress(Exception):  # a group broken by the failure: cleared below
            dist.destroy_process_group()  # every group, the count with them
    world = c10d._world
    for group in list(world.pg_names):  # groups made beside a default one that failed
        with contextlib.suppress(Exception):
            group.shutdown()
    for comm in getattr(world, "comms", []):
        with contextlib.suppress(Exception):
            comm.finalize()
    for table in _TABLES:  # those this torch has
        if (found := getattr(world, table, None)) is not None:
            found.clear()
    # a torch without one of these keeps no state of its kind
    for name, args in (("_update_default_pg", (None,)), ("_unregister_all_process_groups", ())):
        with contextlib.suppress(Exception):
            getattr(c10d, name)(*args)
    world.group_count = 0


def align_group_count() -> None:
    """Every rank's count of torch's unnamed process groups made the largest of them (collective
    over the default group; nothing outside a job of several ranks). From torch 2.14 on, a group
    that some ranks make alone (``use_local_synchronization=True``: a writer group of a snapshot, a
    search candidate's group) advances the count on those ranks only, and the next group that every
    rank makes is named by the count: named otherwise on the others, it waits for them until its
    timeout. Call before a group every rank makes, where ranks may have made groups alone."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    counts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, c10d._world.group_count)
    c10d._world.group_count = max(counts)


_TABLES = (
    "pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
    "pg_coalesce_state", "comms",
)  # fmt: skip
"""The tables of ``c10d._world`` that public ``destroy_process_group`` clears."""


def _check_reset() -> str | None:
    from torch.distributed import distributed_c10d as c10d

    world = getattr(c10d, "_world", None)
    for name in ("group_count", *_TABLES[:4]):  # the rest: cleared where this torch has them
        if not hasattr(world, name):
            return f"torch.distributed.distributed_c10d._world has no {name}"
    if "_world.group_count" not in inspect.getsource(c10d._process_group_name):
        return "torch no longer names unnamed process groups by _world.group_count"
    return None


def wrap_group_makers(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Have every process group this process makes from now on be made through ``wrap(make)``:
    torch's one maker of groups (``_new_process_group_helper``, behind ``init_process_group``,
    ``new_group`` and ``new_subgroups``) and ``split_group``, under each name that binds it
    (``torch.distributed``, its ``device_mesh``). Once per process: a maker already wrapped (its
    ``__wrapped_by_ddpkit__``) is left as it is."""
    import sys

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    for name in ("_new_process_group_helper", "split_group"):
        make = getattr(c10d, name, None)  # split_group: not in older torch
        if make is None or getattr(make, "__wrapped_by_ddpkit__", False):
            continue
        wrapped = wrap(make)
        wrapped.__wrapped_by_ddpkit__ = True  # type: ignore[attr-defined]
        # a module that imported the maker by name calls its own binding: each one is replaced
        for module in (c10d, dist, sys.modules.get("torch.distributed.device_mesh")):
            if module is not None and getattr(module, name, None) is make:
                setattr(module, name, wrapped)


def _check_wrap() -> str | None:
    from torch.distributed import distributed_c10d as c10d

    if not callable(getattr(c10d, "_new_process_group_helper", None)):
        return "torch.distributed.distributed_c10d has no _new_process_group_helper"
    for name in ("init_process_group", "_new_group_with_tag"):  # the latter: new_group's maker
        caller = getattr(c10d, name, None)
        if caller is None or "_new_process_group_helper(" not in inspect.getsource(caller):
            return f"torch's {name} does not make its group by _new_process_group_helper"
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
        "torch.distributed.distributed_c10d._new_process_group_helper (and split_group)",
        "torch",
        "--recover in-place (the connections of a group being made, cut when a peer is lost)",
        _check_wrap,
    ),
    Internal(
        "torch.distributed.distributed_c10d._abort_process_group",
        "torch",
        "--recover in-place on NCCL (a rank's collectives ended at once)",
        _check_abort,
    ),
]
