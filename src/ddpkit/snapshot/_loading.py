"""A snapshot folder read back into a state, on every rank of a group (:meth:`SnapshotManager.load
<ddpkit.snapshot._manager.SnapshotManager.load>`).

``values.pt`` first (decoded by :mod:`ddpkit.snapshot._codec`, nothing unpickled), then the index
from JSON, then DCP reads the tensors this rank needs into the current state's tensors, in place.
Each rank reads on its own (DCP's ``no_dist``, torch 2.7 and newer; a collective load before): a
failure on one rank is made every rank's before anyone goes on (see :func:`load`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._errors import ConfigError
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import first_failure
from ddpkit.snapshot import _folders as folders
from ddpkit.snapshot._folders import Found
from ddpkit.snapshot._layout import leaves, nest, set_at, stored_path


@functools.cache
def quiet_single_process_warning() -> None:
    """In a world of one (no process group) DCP saves and loads in one process, and warns at every
    save and load that "torch.distributed is disabled, unavailable or uninitialized, assuming the
    intent is to save in a single process": that is the intent. Filtered by that text, from the
    first such save or load of ddpkit's (the process is then a world of one); catch_warnings() would
    not do, as the save runs in the snapshot writer's thread and the filters are the process's."""
    warnings.filterwarnings(
        "ignore",
        message="torch.distributed is disabled, unavailable or uninitialized, assuming the intent "
        "is to",
    )


def load(
    found: Found,
    template: Callable[[], dict[str, Any]],
    *,
    group: Group = None,
    distributed: bool | None = None,
    map_location: Any = None,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(state, extra)`` of a snapshot. ``template()`` gives the current state, whose tensors DCP
    fills in place with this world size's parts (its :data:`~ddpkit.strategies._base.PER_RANK` part
    with this rank's own copy at the same world size, rank 0's at another) and whose other values
    are replaced by the saved ones. ``check(extra)`` runs before any tensor is read, and may refuse
    the snapshot by raising. A folder holding anything but what the codec writes is refused
    (:class:`~ddpkit._errors.ConfigError`); nothing of it is unpickled. Every rank of ``group``
    calls it; ``distributed`` (default: whether a process group is up) says whether there are ranks
    to agree with."""
    import torch.distributed.checkpoint as dcp  # lazily, as in ddpkit.snapshot._manager
    from torch.distributed.checkpoint.api import CheckpointException

    from ddpkit.snapshot import _storage as dcp_files

    if distributed is None:
        distributed = dist.is_available() and dist.is_initialized()
    rank, size = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    saved = folders.read_values(found.path, map_location)
    if check is not None:
        check(saved["extra"])
    index = dcp_files.read_marked_index(found.path)
    state = template()
    same = saved["world_size"] == size
    source = rank if same else 0  # whose copy of the per-rank part
    # Other values: this rank's own at the same world size; else rank 0's, and where rank 0 had none
    # (zero: the hyper-parameters of parameters another rank owned), the first rank's that had one.
    values = (
        [saved["differences"][source], saved["values"]]
        if same
        else [saved["values"], *saved["differences"]]
    )
    tensors = []
    for path, value in leaves(state):
        where = stored_path(path, source)
        if isinstance(value, torch.Tensor):
            tensors.append((where, value))
            continue
        held = [v[where] for v in values if where in v]
        if not held:
            raise ConfigError(
                f"{found.path} holds no value for {'.'.join(map(str, path))}: it was written "
                "for another model or optimizer"
            )
        set_at(state, path, held[0])
    if not distributed:
        quiet_single_process_warning()
    # Each rank reads what it needs with no collective: a read needs no other rank's plan, and DCP's
    # collective load has the first rank gather and check every rank's read plan (ranks x tensors,
    # where every rank reads the whole replicated model). Where the torch has no no_dist (before
    # 2.7) the load is collective. Either way one rank's failure must reach every rank, or the
    # others would go on into the next collective and wait there for ever: one all-reduce of the
    # outcome after the read says it.
    local = distributed and "no_dist" in inspect.signature(dcp.load).parameters
    failure: str | None = None
    error: BaseException | None = None
    try:
        # torch's warning that no_dist loads "in a single process": it does
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled, unavailable or"
            )
            dcp.load(
                nest(tensors),
                storage_reader=dcp_files.Reader(found.path, index),
                planner=dcp_files.TensorsOnlyPlanner(),
                process_group=group,
                **({"no_dist": True} if local else {}),
            )
    except CheckpointException as err:  # a BaseException, whose text is every rank's traceback
        # DCP's collective load (before torch 2.7) raises on every rank with every rank's failure.
        collective = distributed and not local
        failure, error = dcp_files.first_rank_failure(err, rank if collective else None), err
    except Exception as err:
        if not local:
            raise
        failure, error = f"{type(err).__name__}: {err}", err
    if local:
        failure = first_failure(failure, group=group)
    if failure is not None:
        raise RuntimeError(f"ddpkit: loading snapshot {found.path} failed: {failure}") from error
    return state, saved["extra"]
