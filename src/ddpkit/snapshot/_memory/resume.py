"""Where every rank resumes from the snapshots in memory, and a lost rank's state from a peer.

On every rank together (collective): each rank says which whole states it holds, the newest position
every rank can resume from is taken (a rank killed during a copy holds the step before its peers'
newest: the step before is taken), and it is used when it is newer than the newest disk snapshot;
else the disk's. A rank with no slot at that position (its node is new) gets it from a rank whose
slot holds every rank's own part (peers, :mod:`ddpkit.snapshot._memory.snapshots`): the donor sends
its slot's bytes over the job's process group.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._errors import ConfigError
from ddpkit.distributed._collectives import all_gather_object, broadcast_object, tensor_bytes
from ddpkit.snapshot import _codec as codec
from ddpkit.snapshot._layout import leaves
from ddpkit.snapshot._manager import Found, SnapshotManager
from ddpkit.snapshot._memory import slot as slot_lib
from ddpkit.snapshot._memory.snapshots import MemorySnapshots, local


@dataclass(frozen=True)
class Choice:
    """Where every rank resumes: a position (epoch, step, cursor), the rank that sends it to the
    ranks that do not hold it (``needy``; None: every rank holds it)."""

    position: tuple[int, ...]
    donor: int | None
    needy: tuple[int, ...]

    @property
    def step(self) -> int:
        return self.position[1]


def choose(offers: list[dict[str, list]], disk_step: int) -> Choice | None:
    """The newest position every rank can resume from, newer than ``disk_step``, or None.

    ``offers[r]``: rank r's ``own`` positions (whole states of its own) and ``peers`` positions
    (whole states that carry every rank's own part). A rank lacking a position is served if some
    rank holds it with peers. Pure: every rank computes the same answer from the same gathered
    offers.
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


def agree(
    memory: MemorySnapshots,
    disk_step: int,
    skipped: Collection[tuple[int, ...]] = (),
    warn: Callable[[str], None] | None = None,
) -> Choice | None:
    """Where every rank resumes from memory, if anywhere newer than ``disk_step`` and not
    ``skipped`` (collective). Whole slots that do not check are left out, and ``warn`` says which
    and why (on each rank that calls it with a ``warn``: the Trainer's prints on rank 0, for every
    rank)."""
    found = [f for f in memory.store.found() if f.position not in skipped]
    offer = {
        "own": sorted({f.position for f in found if f.rank == memory.rank}),
        "peers": sorted({f.position for f in found if f.peers}),
        "damaged": memory.store.damaged if not skipped else [],  # said once, at the first agreement
    }
    offers: list[Any] = (
        all_gather_object(offer, group=memory.group) if memory.group is not None else [offer]
    )
    damaged = sorted({text for o in offers for text in o["damaged"]})
    if damaged and warn is not None:
        warn(f"ddpkit: skipping damaged snapshots in memory: {'; '.join(damaged)}")
    return choose(offers, disk_step)


def _broadcast_slot(memory: MemorySnapshots, path: Path | None, donor: int) -> bytes:
    """The donor's slot file, on every rank (over the gloo group)."""
    data = path.read_bytes() if path is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    assert memory.group is not None  # a donor exists only where there are several ranks
    src = dist.get_global_rank(memory.group, donor)
    dist.broadcast(size, src=src, group=memory.group)
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(int(size), dtype=torch.uint8)
    )
    dist.broadcast(buf, src=src, group=memory.group)
    return tensor_bytes(buf)


@dataclass
class SlotRead:
    """A state read from a slot and checked, not yet put into the Trainer's objects."""

    saved: dict[tuple[Any, ...], torch.Tensor]
    dynamic: dict[str, Any]
    own: Any


_MALFORMED = (ValueError, KeyError, IndexError, TypeError, AttributeError, RecursionError)
"""What reading a slot's skeleton raises when its values lie (their CRC-32 rewritten to match)."""


def read(memory: MemorySnapshots, choice: Choice) -> SlotRead:
    """The state at ``choice``, from this rank's slot or from the donor's (collective when there is
    a donor), checked against the Trainer's state (every tensor there, of its shape and dtype)
    before anything is put into it. Raises :class:`~ddpkit.snapshot._memory.slot.BadSlot` naming the
    slot and what is wrong."""
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
        got = slot_lib.read_slot(mine.path, data=True)
        name = str(mine.path)
    else:
        name = f"rank {choice.donor}'s slot (sent to rank {memory.rank})"
        got = slot_lib.parse_slot(data, name) if data is not None else None
    if got is None:
        raise slot_lib.BadSlot(
            f"the state in memory at step {choice.step} changed while it was read ({name})"
        )
    try:
        return _checked_state(memory, *got, from_peer=mine is None)
    except slot_lib.BadSlot as err:
        raise slot_lib.BadSlot(f"{name}: {err}") from None
    except ConfigError:  # another config or model: refused as a disk snapshot is, not skipped
        raise
    except _MALFORMED as err:
        raise slot_lib.BadSlot(
            f"{name}: its values are not what a save writes ({type(err).__name__}: {err})"
        ) from None


def _checked_state(
    memory: MemorySnapshots,
    record: slot_lib.Record,
    manifest: dict,
    values: dict,
    data: bytes,
    *,
    from_peer: bool,
) -> SlotRead:
    parts = memory.parts
    if values.get("run") != memory.store.run or values.get("world_size") != memory.world_size:
        raise RuntimeError("ddpkit: a memory snapshot of another run was offered; refusing it")
    # Refused before any tensor is loaded, as a disk snapshot of another config or model is.
    parts.record.check(codec.decode(manifest["check"], []), "the snapshot in memory")
    tensors = slot_lib.tensors_of(data, record, manifest)
    n_plan, paths = manifest["n_plan"], manifest["paths"]
    if type(n_plan) is not int or not 0 <= n_plan <= len(tensors) or len(paths) != n_plan:
        raise slot_lib.BadSlot(
            "its manifest does not say which tensors are the model's and optimizer's"
        )
    saved = {tuple(p): t for p, t in zip(paths, tensors[:n_plan])}
    dynamic = codec.decode(values["values"], tensors[n_plan:])
    groups, strategy_values = dynamic["param_groups"], dynamic["strategy_values"]
    if (
        not isinstance(dynamic["states"], dict)
        or not isinstance(groups, list)
        or len(groups) != len(memory.parts.strategy.optimizer.param_groups)
        or not all(isinstance(g, dict) for g in groups)
        or not all(
            isinstance(v, list) and len(v) == 2 and isinstance(v[0], list) and v[0]
            for v in strategy_values
        )
    ):
        raise slot_lib.BadSlot(
            "its values are not the counters, parameter groups and states a save writes"
        )
    own = dynamic["own"]
    if from_peer:  # this rank's own part, from the donor's gathered rows
        rows = tensors[-1]
        if (
            rows.dtype != torch.uint8
            or rows.dim() != 2
            or rows.shape[0] != memory.world_size
            or rows.shape[1] < 8
        ):
            raise slot_lib.BadSlot("its every-rank part is not one row per rank")
        row = rows[memory.rank]
        length = int(row[:8].clone().view(torch.int64))
        if not 0 <= length <= row.numel() - 8:
            raise slot_lib.BadSlot(
                f"rank {memory.rank}'s row says {length} bytes, more than it holds"
            )
        part = codec.decode_blob(tensor_bytes(row[8 : 8 + length]))
        own = part["own"]
        for key, tensor in part["strategy_own"].items():
            saved[tuple(json.loads(key))] = tensor
    plain = set()
    for path, value in leaves(parts.strategy.state_dict()):
        if not isinstance(value, torch.Tensor):
            plain.add(path)
        else:
            held = saved.get(path)
            name = ".".join(map(str, path))
            if held is None:
                raise slot_lib.BadSlot(f"it holds no {name}")
            if held.shape != local(value).shape or held.dtype != local(value).dtype:
                # copy_ would broadcast a [1] into any shape: a manifest's lie must not reach the
                # model.
                raise slot_lib.BadSlot(
                    f"its {name} is {held.dtype}{list(held.shape)}, the model's "
                    f"{local(value).dtype}{list(local(value).shape)}"
                )
    if not all(tuple(p) in plain for p, _ in strategy_values):
        raise slot_lib.BadSlot(
            "its values name a part of the state the model and optimizer do not have"
        )
    return SlotRead(saved, dynamic, own)


def _state_of(memory: MemorySnapshots, got: SlotRead) -> dict[str, Any]:
    """``got`` put into the strategy's state; the rest in the Trainer's ``load_state_dict`` form,
    with ``param_groups`` besides."""
    state = memory.parts.strategy.state_dict()
    for path, value in leaves(state):
        if isinstance(value, torch.Tensor):
            with torch.no_grad():
                local(value).copy_(got.saved[path])
    dynamic = got.dynamic
    for path, value in dynamic["strategy_values"]:
        node = state
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    ranks: list[Any] = [None] * memory.world_size
    ranks[memory.rank] = got.own  # RankStreams reads only this rank's entry at the same world size
    return {
        "strategy": state,
        "states": {**dynamic["states"], "rng": {"world_size": memory.world_size, "ranks": ranks}},
        "global_micro_batch": dynamic["global_micro_batch"],
        "param_groups": dynamic["param_groups"],
    }


def _read_everywhere(memory: MemorySnapshots, choice: Choice) -> tuple[SlotRead | None, list[str]]:
    """This rank's read of ``choice`` and what every rank found wrong with its own (collective:
    every rank learns whether every rank can take the state, so that all take it or none does). A
    refusal (another config or model) is raised on every rank."""
    got, problem = None, None
    try:
        got = read(memory, choice)
    except slot_lib.BadSlot as err:
        problem = ("damaged", f"rank {memory.rank}: {err}")
    except ConfigError as err:
        problem = ("config", str(err))
    except RuntimeError as err:
        problem = ("refused", str(err))
    problems: list[Any] = (
        all_gather_object(problem, group=memory.group) if memory.group is not None else [problem]
    )
    for kind, text in filter(None, problems):
        if kind == "config":
            raise ConfigError(text)
        if kind == "refused":
            raise RuntimeError(text)
    return got, [text for _, text in filter(None, problems)]


def _after_resume(memory: MemorySnapshots, choice: Choice | None) -> None:
    """Only the state resumed from may be found again (none after a resume from disk or a fresh
    start), so that a later restart never picks a slot of an abandoned course."""
    keep = None
    if choice is not None:
        keep = next(
            (
                f.path
                for f in memory.store.found()
                if f.rank == memory.rank and f.position == choice.position
            ),
            None,
        )
    memory.store.discard_except(keep)


def _restore_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    """Put the saved hyper-parameters (the scheduler's learning rate among them) back into the
    groups."""
    if len(saved) != len(optimizer.param_groups):
        raise RuntimeError("ddpkit: the snapshot in memory has another number of parameter groups")
    for group, values in zip(optimizer.param_groups, saved):
        group.update(values)


def resume_from_memory(
    memory: MemorySnapshots,
    manager: SnapshotManager,
    warn: Callable[[str], None],
    load_state: Callable,
) -> tuple[str | None, Found | None]:
    """Resume every rank from memory when the newest state all of them can take is newer than the
    disk's newest whole snapshot (collective). Returns what was resumed from (None: not from memory)
    and, when it was read, the disk's newest whole snapshot (to resume from instead).

    A state that a rank finds damaged (:class:`~ddpkit.snapshot._memory.slot.BadSlot`) is skipped by
    every rank, saying which and why, and the next newest is tried: the slot before it, then the
    disk. Every rank takes the same: each agreement and each read's outcome are gathered."""
    skipped: set[tuple[int, ...]] = set()
    newest: int | None = None  # the disk's newest marked snapshot, once asked
    found: Found | None = None
    disk_checked = False
    while True:
        choice = agree(memory, -1, skipped, warn)
        if choice is not None and newest is None:
            candidates = manager.candidates() if memory.parts.runtime.is_main else []
            newest = broadcast_object(
                candidates[0].step if candidates else -1, group=memory.parts.runtime.group
            )
        # Newer than any marked snapshot on disk, verified or not: the disk's checksums need not be
        # read.
        if choice is not None and newest is not None and choice.step <= newest and not disk_checked:
            # the newest may be damaged: memory may be newer
            found, disk_checked = manager.latest(warn=warn), True
        if choice is not None and found is not None and choice.step <= found.step:
            choice = None
        if choice is None:
            if not disk_checked:
                found = manager.latest(warn=warn)
            _after_resume(memory, None)
            return None, found
        got, problems = _read_everywhere(memory, choice)
        if not problems:
            break
        skipped.add(choice.position)
        warn(
            f"ddpkit: skipping the snapshot in memory at step {choice.step}: "
            f"{'; '.join(problems)}; trying the one before it, in memory or on disk"
        )
    assert got is not None  # no rank found a problem
    state = _state_of(memory, got)
    param_groups = state.pop("param_groups")
    load_state(state)
    _restore_param_groups(memory.parts.strategy.optimizer, param_groups)
    _after_resume(memory, choice)
    if choice.donor is None:
        return "memory", None
    return f"memory (ranks {list(choice.needy)} from rank {choice.donor})", None
