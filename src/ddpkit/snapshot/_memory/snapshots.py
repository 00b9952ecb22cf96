"""The Trainer's snapshots in memory: after steps, each rank's state goes into its slots in the
job's folder in shared memory (:mod:`ddpkit.snapshot._memory.store`), which outlives the worker; a
restart resumes from there (:mod:`ddpkit.snapshot._memory.resume`).

A save, after an optimizer step, copies what a disk snapshot holds: the strategy's state (model,
optimizer, the rank's own buffers), the other stateful parts (counters, early stopping, scheduler,
scaler), and the rank's own random streams (python, numpy, torch, the loader's generator) with the
parts each rank keeps its own of (:class:`~ddpkit.snapshot._state.RankStreams`): no collective,
unlike a disk snapshot, which gathers them. The strategy's ``state_dict()`` costs ~1 ms (torch's
``get_state_dict`` walks the model): it is called once, and later saves copy from the same tensors,
which are the live parameters and optimizer state themselves (checked each save: the state is
rebuilt when one of those objects is replaced, or when a tensor of the state is not a live one). The
optimizer's hyper-parameters (the scheduler's learning rate) are read from its parameter groups at
each save.

Interval: every step by default, unless the first :data:`TUNE_AFTER` saves show that the copy holds
the loop longer than :data:`STALL_BUDGET` of a step; then every N steps, the smallest N that keeps
it within (the same N on every rank: the largest any rank needs), and a failure loses up to N steps.

Peers (``ddp`` across nodes): every save also gathers every rank's own part (its random streams and
own buffers: a few KiB, one all-gather) into every rank's slot, so that the rank of a replacement
node can get its state from a surviving rank. Under ``zero`` and ``fsdp`` each rank holds the only
copy of its shard in memory: a lost node resumes those runs from disk.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._internals.modules import buffer_slots
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import all_reduce
from ddpkit.distributed._environment import read_launch_env
from ddpkit.distributed._runtime import DEFAULT_TIMEOUT, Runtime
from ddpkit.snapshot import _codec as codec
from ddpkit.snapshot import _region as region
from ddpkit.snapshot._layout import PER_RANK, KeyPath, leaves
from ddpkit.snapshot._memory import folder as memory_folder
from ddpkit.snapshot._memory import store as store_lib
from ddpkit.strategies._base import Strategy
from ddpkit.strategies._prepare import unwrap

STALL_BUDGET = 0.05
"""The share of a step the copy to memory may hold the training loop when the interval is chosen."""
TUNE_AFTER = 8
"""Saves (one per step) measured before the interval is chosen."""


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor of a strategy's state."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _hyperparams_only(path: KeyPath) -> bool:
    """The non-tensor values of a strategy's state that the saved parameter groups restore: the
    flattened optimizer's ``param_groups.<name>.<key>``; any other (an optimizer keeping python
    numbers in its state) makes every save read the whole state afresh."""
    return len(path) == 2 and path[0] == "optim" and str(path[1]).startswith("param_groups.")


@dataclass(frozen=True)
class TrainerParts:
    """What the snapshots in memory read of a Trainer, handed over by it. The Trainer's own classes
    are not imported here (its package imports this one): each field says what it is."""

    runtime: Runtime
    """The ranks that train the model together (its group)."""
    run_dir: Path
    strategy: Strategy
    """The wrapped model and optimizer, whose state is copied from their live tensors."""
    schedule: Any
    """The run's :class:`~ddpkit.snapshot._schedule.SnapshotSchedule`: when a copy is due; holds the
    interval."""
    states: Mapping[str, Any]
    """The disk snapshots' stateful parts by name, ``"rng"``
    (:class:`~ddpkit.snapshot._state.RankStreams`) among them: what each rank keeps its own of."""
    record: Any
    """The run's :class:`~ddpkit.snapshot._run_record.RunRecord`: a resume compares it before it
    loads."""
    global_micro_batch: int
    position: Callable[[], tuple[int, int, int]]
    """``(epoch, step, cursor)`` now."""
    log: Callable[[str, int, dict[str, Any]], None]
    """The run's record of events."""


def _optimizers(optimizer: Any) -> list[Any]:
    # ZeroRedundancyOptimizer keeps the state of this rank's parameters in its local optimizer,
    # ``.optim``.
    found = [optimizer, getattr(optimizer, "optim", None)]
    return list({id(o): o for o in found if o is not None}.values())


class _Watch:
    """A cheap test that the live objects a plan copies from are still those: the parameters'
    storage (a script may set ``p.data``), each buffer object (a module may assign a new one), and
    the optimizer's state tensors (created at the first step, replaced by ``load_state_dict``). ~10
    us for the DDP tutorials' CNN, against ~30 us for walking the modules again."""

    def __init__(self, strategy: Strategy) -> None:
        module = unwrap(strategy.model)
        self.params = list(module.parameters())
        self.buffers = buffer_slots(module)
        self.optimizers = _optimizers(strategy.optimizer)

    def live(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = list(self.params)
        found += [b for owner, name in self.buffers if (b := owner[name]) is not None]
        for opt in self.optimizers:
            found += [
                v
                for state in opt.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            ]
        return found

    def signature(self) -> tuple[Any, ...]:
        return (
            tuple(p.data_ptr() for p in self.params),
            tuple(id(owner[name]) for owner, name in self.buffers),
            tuple(
                id(v)
                for opt in self.optimizers
                for state in opt.state.values()
                for v in state.values()
            ),
        )


@dataclass
class _Plan:
    """The strategy's state as this rank saves it: its tensors (the live ones), their names, which
    are the rank's own, and whether the next save may copy from them again."""

    paths: list[KeyPath]
    tensors: list[torch.Tensor]
    own: list[bool]
    values: list[tuple[KeyPath, Any]]  # non-tensor values, when they are not hyper-parameters alone
    reusable: bool
    watch: _Watch
    signature: tuple[Any, ...]
    ident: int


class PeerStopped(RuntimeError):
    """Another rank stopped keeping its snapshots in memory: with peers, every rank stops."""


def _warn(message: str) -> None:
    print(f"ddpkit: {message}", file=sys.stderr, flush=True)


def _gloo_group(group: Group) -> Any:
    """A gloo group over the ranks of ``group`` (the peers' gather, the agreement, a donor's send),
    with the job's bound on a collective rather than gloo's default of 30 minutes for a new
    group."""
    seconds = read_launch_env().collective_timeout
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    timeout = timedelta(seconds=seconds) if seconds else DEFAULT_TIMEOUT
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True, timeout=timeout)


def open_memory_snapshots(parts: TrainerParts, every_steps: int | None) -> MemorySnapshots | None:
    """Memory snapshots of a Trainer's ``parts`` when the agent of ``ddpkit run`` made the job a
    memory folder on every node, else None (with one line saying why). Collective (one all-reduce):
    the ranks decide together, as a save with peers and a resume are collectives. ``every_steps``:
    see :class:`MemorySnapshots`."""
    rt = parts.runtime
    folder, job = os.environ.get(memory_folder.DIR_ENV), memory_folder.job_key()
    why = (
        os.environ.get(memory_folder.UNAVAILABLE_ENV)
        or "no memory folder for the job (run under ddpkit run)"
    )
    store = None
    if folder and job is not None:
        try:
            store = store_lib.MemoryStore(
                folder,
                job=job,
                run=store_lib.run_key(parts.run_dir),
                rank=rt.rank,
                world_size=rt.world_size,
            )
        except store_lib.MemoryUnavailable as err:
            why = str(err)
    # A node whose agent made no folder turns them off everywhere.
    everywhere = (
        all_reduce(float(store is not None), op="min", group=rt.group) if rt.distributed else 1.0
    )
    if store is None or not everywhere:
        reason = why if store is None else "another rank has no memory folder"
        if rt.is_main or folder:  # one line for the job, and one from each rank that had a folder
            _warn(f"snapshots in memory are off (rank {rt.rank}: {reason}); disk snapshots only")
        return None
    if rt.local_rank == 0:
        need = (
            2
            * rt.local_world_size
            * sum(local(p).nbytes for p in parts.strategy.model.parameters())
        )
        if warning := memory_folder.room_warning(store.folder, need):
            _warn(warning)
    group = _gloo_group(rt.group) if rt.distributed else None
    peers = parts.strategy.name == "ddp" and rt.world_size > rt.local_world_size
    return MemorySnapshots(parts, store, every_steps=every_steps, peers=peers, group=group)


class MemorySnapshots:
    """The Trainer's side of the snapshots in memory; see the module docstring.

    ``every_steps``: save after every N-th optimizer step; None: chosen (see the module docstring).
    ``peers``: also keep every rank's own part in every rank's slot."""

    def __init__(
        self,
        parts: TrainerParts,
        store: store_lib.MemoryStore,
        *,
        every_steps: int | None,
        peers: bool,
        group: Group,
    ) -> None:
        self.parts, self.store, self.peers, self.group = parts, store, peers, group
        self.schedule = parts.schedule  # says when a copy is due; holds the interval once chosen
        self.every_steps = every_steps or 1
        self._tuned = every_steps is not None
        self._starts: list[float] = []  # perf_counter at each save, until the interval is chosen
        self._calls = 0
        self.rank, self.world_size = store.rank, store.world_size
        self.enabled = True
        # with peers: tell the others at the next save that this rank stopped
        self._leave_next = False
        self._gathered = False
        self._plan: _Plan | None = None
        self._layout: tuple[Any, ...] | None = None
        self._manifest: dict[str, Any] | None = None
        self._peer_capacity = 0
        self._check: Any = None
        self.stalls: list[float] = []
        """Seconds each save held the training loop."""

    @property
    def every_steps(self) -> int:
        return self.schedule.memory_every_steps

    @every_steps.setter
    def every_steps(self, value: int) -> None:
        self.schedule.memory_every_steps = value

    def save(self) -> None:
        """Copy this step's state into the older slot. Every rank calls it after the same steps
        (with peers, and when the interval is chosen, it is collective). Memory full: one warning,
        and memory snapshots stop on this rank; with peers, on every rank (the others learn it in
        the next gather, so none waits for a rank that stopped gathering). A value no snapshot can
        hold (:mod:`ddpkit.snapshot._codec`) raises its
        :class:`~ddpkit.snapshot._codec.UnsupportedValue` before the slot is touched: the disk
        snapshot would refuse it too, and a run that cannot be resumed is better stopped at its
        first step."""
        self._calls += 1
        if self._leave_next:
            self._leave_next = False
            self._gather_peers(None)
        elif self.enabled:
            self._save_timed()
        if not self._tuned and self._calls == TUNE_AFTER:
            self._choose_interval()

    def _save_timed(self) -> None:
        t0 = time.perf_counter()
        if not self._tuned:
            self._starts.append(t0)
        self._gathered = False
        try:
            self._save()
        except (store_lib.MemoryUnavailable, PeerStopped) as err:
            self.enabled = False
            _warn(f"snapshots in memory stop on rank {self.rank} ({err}); disk snapshots go on")
            if self.peers and not isinstance(err, PeerStopped):
                if self._gathered:
                    # the others gathered with this rank this step; they will again
                    self._leave_next = True
                else:
                    self._gather_peers(None)
        self.stalls.append(time.perf_counter() - t0)

    def _choose_interval(self) -> None:
        """Every ``N`` steps, the smallest ``N`` whose stall stays within :data:`STALL_BUDGET` of a
        step, from the saves so far (the first two left out: they reserve and map the slots).
        Collective (one all-reduce): every rank calls it after the same save, and every rank takes
        the largest ``N``."""
        self._tuned = True
        stalls = sorted(self.stalls[2:])
        # A step: the time between two saves (one step apart) less the save itself.
        gaps = sorted(
            b - a - s for a, b, s in zip(self._starts[2:], self._starts[3:], self.stalls[2:])
        )
        stall = stalls[len(stalls) // 2] if stalls else 0.0
        step = max(gaps[len(gaps) // 2], 1e-9) if gaps else 1.0
        wanted = float(max(1, math.ceil(stall / (STALL_BUDGET * step))))
        if self.group is not None:
            box = torch.tensor([wanted])
            dist.all_reduce(box, op=dist.ReduceOp.MAX, group=self.group)
            wanted = float(box)
        self.every_steps = int(wanted)
        record = {"event": "memory_snapshots", "every_steps": self.every_steps}
        record |= {"stall_ms": round(1e3 * stall, 3), "step_ms": round(1e3 * step, 3)}
        self.parts.log("event", self.parts.position()[1], record)

    def _save(self) -> None:
        plan = self._current_plan()
        dynamic = self._dynamic(plan)
        extra: list[torch.Tensor] = []
        skeleton = codec.encode(dynamic, extra)
        tensors = plan.tensors + extra
        if self.peers:
            own = {
                json.dumps(list(p)): t for p, t, o in zip(plan.paths, plan.tensors, plan.own) if o
            }
            tensors.append(
                self._gather_peers(codec.encode_blob({"own": dynamic["own"], "strategy_own": own}))
            )
        key = (plan.ident, tuple((t.dtype, t.shape) for t in tensors[len(plan.tensors) :]))
        if key != self._layout or self._manifest is None:
            self._layout, self._manifest = key, self._make_manifest(plan, tensors)
        position = self.parts.position()
        values = {
            "step": position[1],
            "position": list(position),
            "peers": self.peers,
            "values": skeleton,
        }
        self.store.save(values, tensors, self._manifest, key)

    def _current_plan(self) -> _Plan:
        plan = self._plan
        if plan is not None and plan.reusable and plan.signature == plan.watch.signature():
            return plan
        state = self.parts.strategy.state_dict()
        watch = _Watch(self.parts.strategy)
        storages = {local(t).untyped_storage().data_ptr() for t in watch.live()}
        paths, tensors, own, values = [], [], [], []
        for path, value in leaves(state):
            if isinstance(value, torch.Tensor):
                paths.append(path)
                tensors.append(local(value))
                own.append(path[0] == PER_RANK)
            else:
                values.append((path, value))
        # Reusable only when every tensor is a live one: a copy made by state_dict() would go stale.
        aliases = all(t.untyped_storage().data_ptr() in storages for t in tensors)
        hyper_only = all(_hyperparams_only(p) for p, _ in values)
        ident = plan.ident + 1 if plan else 0
        self._plan = _Plan(
            paths,
            tensors,
            own,
            [] if hyper_only else values,
            aliases and hyper_only,
            watch,
            watch.signature(),
            ident,
        )
        return self._plan

    def _dynamic(self, plan: _Plan) -> dict[str, Any]:
        """What changes from step to step besides the strategy's tensors."""
        parts = self.parts
        groups = parts.strategy.optimizer.param_groups
        return {
            "states": {
                name: part.state_dict() for name, part in parts.states.items() if name != "rng"
            },
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
            "strategy_values": [[list(p), v] for p, v in plan.values],
            "own": parts.states["rng"].mine(),  # streams, and the parts each rank keeps its own of
            "global_micro_batch": parts.global_micro_batch,
        }

    def _make_manifest(self, plan: _Plan, tensors: list[torch.Tensor]) -> dict[str, Any]:
        specs, size = region.layout(tensors)
        # what a resume compares before it loads, as a disk snapshot's record
        if self._check is None:
            self._check = codec.encode(self.parts.record.state_dict(), [])
        return {
            "paths": [list(p) for p in plan.paths],
            "own": plan.own,
            "n_plan": len(plan.tensors),
            "specs": [[s.dtype, list(s.shape), s.offset] for s in specs],
            "data_size": size,
            "check": self._check,
        }

    def _gather_peers(self, mine: bytes | None) -> torch.Tensor:
        """Every rank's own part, gathered into a [world, 8 + capacity] uint8 tensor (each row:
        length, blob).

        One all-gather in the steady state. The blobs' lengths differ a little from step to step; a
        blob longer than the agreed capacity is seen by every rank in the lengths, and the gather is
        repeated once with a larger capacity. ``mine=None`` (length -1): this rank stops saving;
        every other rank raises :class:`PeerStopped` and stops too.
        """
        self._gathered = True
        while True:
            row = torch.zeros(8 + self._peer_capacity, dtype=torch.uint8)
            row[:8] = torch.tensor([-1 if mine is None else len(mine)], dtype=torch.int64).view(
                torch.uint8
            )
            if mine is not None and len(mine) <= self._peer_capacity:
                row[8 : 8 + len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
            if self.group is None:
                gathered = row[None]
            else:
                flat = torch.empty(self.world_size * row.numel(), dtype=torch.uint8)
                dist.all_gather_into_tensor(flat, row, group=self.group)  # gloo wants a flat output
                gathered = flat.view(self.world_size, row.numel())
            lengths = gathered[:, :8].clone().view(torch.int64).flatten().tolist()
            stopped = [r for r, n in enumerate(lengths) if n < 0]
            if stopped:
                if mine is None:
                    return gathered
                raise PeerStopped(f"rank {stopped[0]} stopped keeping its copy")
            longest = int(max(lengths))
            if longest <= self._peer_capacity:
                return gathered
            self._peer_capacity = longest + longest // 4

    def close(self, remove: bool) -> None:
        """Unmap the slots; ``remove``: delete them too (the run finished: its last state is on
        disk)."""
        if remove:
            self.store.remove()
        else:
            self.store.close()
