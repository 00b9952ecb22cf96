"""Where every rank resumes from the snapshots in memory, and a lost rank's state from a peer.

On every rank together (collective): each rank says which whole states it holds, the newest position every
rank can resume from is taken (a rank killed during a copy holds the step before its peers' newest: the step
before is taken), and it is used when it is newer than the newest disk snapshot; else the disk's. A rank with
no slot at that position (its node is new) gets it from a rank whose slot holds every rank's own part (peers,
:mod:`ddpkit.training.memory_snapshots`): the donor sends its slot's bytes over the job's process group.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed.collectives import broadcast_object
from ddpkit.snapshot import memory as store_lib
from ddpkit.snapshot import memory_values as values_lib
from ddpkit.snapshot.layout import leaves
from ddpkit.snapshot.manager import Found, SnapshotManager
from ddpkit.training.memory_snapshots import MemorySnapshots, local


@dataclass(frozen=True)
class Choice:
    """Where every rank resumes: a position (epoch, step, cursor), the rank that sends it to the ranks that do
    not hold it (``needy``; None: every rank holds it)."""

    position: tuple[int, ...]
    donor: int | None
    needy: tuple[int, ...]

    @property
    def step(self) -> int:
        return self.position[1]


def choose(offers: list[dict[str, list]], disk_step: int) -> Choice | None:
    """The newest position every rank can resume from, newer than ``disk_step``, or None.

    ``offers[r]``: rank r's ``own`` positions (whole states of its own) and ``peers`` positions (whole states
    that carry every rank's own part). A rank lacking a position is served if some rank holds it with peers.
    Pure: every rank computes the same answer from the same gathered offers.
    """
    own = [{tuple(p) for p in o["own"]} for o in offers]
    peers = [{tuple(p) for p in o["peers"]} for o in offers]
    for position in sorted(set().union(*own, *peers), reverse=True):
        if position[1] <= disk_step:
            return None
        needy = tuple(r for r, held in enumerate(own) if position not in held)
        donors = [r for r, held in enumerate(peers) if position in held]
        if not needy:
            return Choice(position, None, ())
        if donors:
            return Choice(position, donors[0], needy)
    return None


def agree(memory: MemorySnapshots, disk_step: int) -> Choice | None:
    """Where every rank resumes from memory, if anywhere newer than ``disk_step`` (collective)."""
    found = memory.store.found()
    offer = {
        "own": sorted({f.position for f in found if f.rank == memory.rank}),
        "peers": sorted({f.position for f in found if f.peers}),
    }
    offers: list[Any] = [offer]
    if memory.group is not None:
        offers = [None] * memory.world_size
        dist.all_gather_object(offers, offer, group=memory.group)
    return choose(offers, disk_step)


def _broadcast_slot(memory: MemorySnapshots, path: Path | None, donor: int) -> bytes:
    """The donor's slot file, on every rank (over the gloo group)."""
    data = path.read_bytes() if path is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    src = dist.get_global_rank(memory.group, donor)
    dist.broadcast(size, src=src, group=memory.group)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=memory.group)
    return buf.numpy().tobytes()


def load(memory: MemorySnapshots, choice: Choice) -> dict[str, Any]:
    """The state at ``choice`` in the Trainer's ``load_state_dict`` form, with ``param_groups`` besides, from
    this rank's slot or from the donor's (collective when there is a donor)."""
    found = {(f.rank, f.position): f for f in memory.store.found()}
    mine = found.get((memory.rank, choice.position))
    data = None
    if choice.donor is not None:
        donor_slot = None
        if memory.rank == choice.donor:
            held = sorted((r, f) for (r, p), f in found.items() if p == choice.position and f.peers)
            donor_slot = held[0][1].path if held else None
        data = _broadcast_slot(memory, donor_slot, choice.donor)
    if mine is not None:
        got = store_lib.read_slot(mine.path, data=True)
    else:
        got = store_lib.parse_slot(data) if data is not None else None
    if got is None:
        raise RuntimeError(f"ddpkit: the state in memory at step {choice.step} changed while it was read")
    return _rebuild(memory, *got, from_peer=mine is None)


def _rebuild(
    memory: MemorySnapshots, record: store_lib.Record, manifest: dict, values: dict, data: bytes, *, from_peer: bool
) -> dict[str, Any]:
    snapshots = memory.trainer.snapshots
    if values["run"] != memory.store.run or values["world_size"] != memory.world_size:
        raise RuntimeError("ddpkit: a memory snapshot of another run was offered; refusing it")
    # Refused before any tensor is loaded, as a disk snapshot of another config or model is.
    snapshots.record.check(values_lib.unflatten(manifest["check"], []), "the snapshot in memory")
    tensors = store_lib.tensors_of(data, record, manifest)
    n_plan = manifest["n_plan"]
    saved = {tuple(p): t for p, t in zip(manifest["paths"], tensors[:n_plan])}
    dynamic = values_lib.unflatten(values["values"], tensors[n_plan:])
    own = dynamic["own"]
    if from_peer:  # this rank's own part, from the donor's gathered rows
        row = tensors[-1][memory.rank]
        length = int(row[:8].clone().view(torch.int64))
        part = values_lib.decode_blob(row[8 : 8 + length].numpy().tobytes())
        own = part["own"]
        for key, tensor in part["strategy_own"].items():
            saved[tuple(json.loads(key))] = tensor
    state = snapshots.strategy.state_dict()
    for path, value in leaves(state):
        if isinstance(value, torch.Tensor):
            if path not in saved:
                raise RuntimeError(f"ddpkit: the snapshot in memory holds no {'.'.join(map(str, path))}")
            with torch.no_grad():
                local(value).copy_(saved[path])
    for path, value in dynamic["strategy_values"]:
        node = state
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    ranks: list[Any] = [None] * memory.world_size
    ranks[memory.rank] = own  # RankStreams reads only this rank's entry at the same world size
    return {
        "strategy": state,
        "states": {**dynamic["states"], "rng": {"world_size": memory.world_size, "ranks": ranks}},
        "global_micro_batch": dynamic["global_micro_batch"],
        "param_groups": dynamic["param_groups"],
    }


def _after_resume(memory: MemorySnapshots, choice: Choice | None) -> None:
    """Only the state resumed from may be found again (none after a resume from disk or a fresh start), so that
    a later restart never picks a slot of an abandoned course."""
    keep = None
    if choice is not None:
        keep = next(
            (f.path for f in memory.store.found() if f.rank == memory.rank and f.position == choice.position), None
        )
    memory.store.discard_except(keep)


def _restore_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    """Put the saved hyper-parameters (the scheduler's learning rate among them) back into the groups."""
    if len(saved) != len(optimizer.param_groups):
        raise RuntimeError("ddpkit: the snapshot in memory has another number of parameter groups")
    for group, values in zip(optimizer.param_groups, saved):
        group.update(values)


def resume_from_memory(
    memory: MemorySnapshots, manager: SnapshotManager, warn: Callable[[str], None], load_state: Callable
) -> tuple[str | None, Found | None]:
    """Resume every rank from memory when the newest state all of them can take is newer than the disk's newest
    whole snapshot (collective). Returns what was resumed from (None: not from memory) and, when it was read, the
    disk's newest whole snapshot (to resume from instead)."""
    choice = agree(memory, -1)
    found = None
    if choice is not None:
        candidates = manager.candidates() if memory.trainer.runtime.is_main else []
        newest = broadcast_object(candidates[0].step if candidates else -1, group=memory.trainer.group)
        # Newer than any marked snapshot on disk, verified or not: the disk's checksums need not be read.
        if choice.step <= newest:
            found = manager.latest(warn=warn)  # the newest may be damaged: memory may be newer than the next
            if found is not None and choice.step <= found.step:
                choice = None
    else:
        found = manager.latest(warn=warn)
    if choice is None:
        _after_resume(memory, None)
        return None, found
    state = load(memory, choice)
    param_groups = state.pop("param_groups")
    load_state(state)
    _restore_param_groups(memory.trainer.optimizer, param_groups)
    _after_resume(memory, choice)
    if choice.donor is None:
        return "memory", None
    return f"memory (ranks {list(choice.needy)} from rank {choice.donor})", None
