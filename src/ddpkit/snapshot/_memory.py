"""The memory store: after optimizer steps, each rank's state goes into its slots in shared memory
(:mod:`ddpkit.snapshot._slots`), with no collective but with peers (``ddp`` across nodes: every
rank's own part gathered into every rank's slot); a restarted job resumes from the newest step
every rank holds there (docs/snapshots.md, "Snapshots in memory").
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._errors import ConfigError
from ddpkit._internals.modules import buffer_slots
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import (
    all_gather_object,
    all_reduce,
    tensor_bytes,
)
from ddpkit.distributed._environment import read_launch_env
from ddpkit.distributed._runtime import DEFAULT_TIMEOUT, Runtime
from ddpkit.snapshot import _codec as codec
from ddpkit.snapshot import _slots as slots_lib
from ddpkit.snapshot._state import (
    STREAMS_PART,
    Check,
    Damaged,
    KeyPath,
    Parts,
    Resumed,
    leaves,
    set_at,
)
from ddpkit.strategies._base import PER_RANK, Strategy
from ddpkit.strategies._prepare import unwrap

STALL_BUDGET = 0.05
"""The share of a step the copy to memory may hold the training loop when the interval is chosen."""
TUNE_AFTER = 8
"""Saves (one per step) measured before the interval is chosen."""


class PeerStopped(RuntimeError):
    """Another rank stopped keeping its snapshots in memory: with peers, every rank stops."""


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor of a strategy's state."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _warn(message: str) -> None:
    print(f"ddpkit: {message}", file=sys.stderr, flush=True)


def open_memory(
    run_dir: Path, runtime: Runtime, strategy: Strategy, every_steps: int | None
) -> MemoryStore | None:
    """The memory store of the run in ``run_dir`` when the agent of ``ddpkit run`` made the job a
    memory folder on every node, else None, with one line saying why; collective (one all-reduce).
    ``every_steps``: a copy every N steps; None: chosen (:meth:`MemoryStore._choose_interval`)."""
    rt = runtime
    folder, job = slots_lib.memory_folder()
    why, slots = job, None
    if folder is not None:
        try:
            run = slots_lib.run_key(run_dir)
            slots = slots_lib.Slots(
                folder, job=job, run=run, rank=rt.rank, world_size=rt.world_size
            )
        except slots_lib.MemoryUnavailable as err:
            why = str(err)
    # a node whose agent made no folder turns them off everywhere
    everywhere = all_reduce(float(slots is not None), op="min", group=rt.group)
    if slots is None or not everywhere:
        reason = why if slots is None else "another rank has no memory folder"
        if rt.is_main or folder:  # one line for the job, and one from each rank that had a folder
            _warn(f"snapshots in memory are off (rank {rt.rank}: {reason}); disk snapshots only")
        return None
    if rt.local_rank == 0:
        model = strategy.model
        need = 2 * rt.local_world_size * sum(local(p).nbytes for p in model.parameters())
        if warning := slots_lib.room_warning(slots.folder, need):
            _warn(warning)
    group = _gloo_group(rt.group) if rt.distributed else None
    peers = strategy.name == "ddp" and rt.world_size > rt.local_world_size
    return MemoryStore(slots, every_steps=every_steps, peers=peers, group=group)


def _gloo_group(group: Group) -> Any:
    """A gloo group over the ranks of ``group``, bounded by the job's collective timeout."""
    seconds = read_launch_env().collective_timeout
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    timeout = timedelta(seconds=seconds) if seconds else DEFAULT_TIMEOUT
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True, timeout=timeout)


@dataclass(frozen=True)
class Interval:
    """The interval of the copies, once chosen: every ``every_steps`` steps, for a copy's median
    stall and a step's median time (ms)."""

    every_steps: int
    stall_ms: float
    step_ms: float


@dataclass(frozen=True)
class Choice:
    """Where every rank resumes: a position (epoch, step, cursor), and the rank that sends it to the
    ranks that do not hold it (``needy``; ``donor`` None: every rank holds it)."""

    position: tuple[int, ...]
    donor: int | None
    needy: tuple[int, ...]

    @property
    def step(self) -> int:
        return self.position[1]


def choose(offers: list[dict[str, list]], disk_step: int = -1) -> Choice | None:
    """The newest position every rank can resume from, newer than ``disk_step``, or None (the same
    on every rank). ``offers[r]``: rank r's ``own`` positions and ``peers`` positions (states that
    carry every rank's own part)."""
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


class MemoryStore:
    """The snapshots in memory of one run (:func:`open_memory`). ``peers``: also keep every rank's
    own part in every rank's slot."""

    def __init__(
        self, slots: slots_lib.Slots, *, every_steps: int | None, peers: bool, group: Group
    ) -> None:
        self.slots, self.peers, self.group = slots, peers, group
        self._tuned = every_steps is not None
        self._starts: list[float] = []  # perf_counter at each save, until the interval is chosen
        self._calls = 0
        self.rank, self.world_size = slots.rank, slots.world_size
        self.enabled = True
        self._leave_next = False  # with peers: tell the others at the next save this one stopped
        self._gathered = False
        self._plan: _Plan | None = None
        self._layout: tuple[Any, ...] | None = None
        self._manifest: dict[str, Any] | None = None
        self._peer_capacity = 0
        self._check: Any = None
        self._skipped: set[tuple[int, ...]] = set()
        self.stalls: list[float] = []
        """Seconds each save held the training loop."""

    def save_step(self, parts: Callable[[], Parts]) -> Interval | None:
        """Copy the step's ``parts()`` into the older slot (read only while the copies go on, and
        timed with the copy); every rank calls it after the same steps (collective with peers, and
        when the interval is chosen). Memory full: one warning, and the copies stop on this rank
        (with peers, on every rank). A value the codec cannot hold raises before the slot is
        touched. Returns the interval once it is chosen (with ``every_steps`` None), after
        :data:`TUNE_AFTER` copies."""
        self._calls += 1
        if self._leave_next:
            self._leave_next = False
            self._gather_peers(None)
        elif self.enabled:
            self._save_timed(parts)
        if not self._tuned and self._calls == TUNE_AFTER:
            return self._choose_interval()
        return None

    def _save_timed(self, parts: Callable[[], Parts]) -> None:
        t0 = time.perf_counter()
        if not self._tuned:
            self._starts.append(t0)
        self._gathered = False
        try:
            self._save(parts)
        except (slots_lib.MemoryUnavailable, PeerStopped) as err:
            self.enabled = False
            _warn(f"snapshots in memory stop on rank {self.rank} ({err}); disk snapshots go on")
            if self.peers and not isinstance(err, PeerStopped):
                if self._gathered:  # the others gathered with this rank this step: tell them next
                    self._leave_next = True
                else:
                    self._gather_peers(None)
        self.stalls.append(time.perf_counter() - t0)

    def _choose_interval(self) -> Interval:
        """Every ``N`` steps, the smallest ``N`` whose stall stays within :data:`STALL_BUDGET` of a
        step (the first two saves, which map the slots, left out); the largest over the ranks."""
        self._tuned = True
        stalls = sorted(self.stalls[2:])
        # a step: the time between two saves one step apart, less the save itself
        gaps = sorted(
            b - a - s for a, b, s in zip(self._starts[2:], self._starts[3:], self.stalls[2:])
        )
        stall = stalls[len(stalls) // 2] if stalls else 0.0
        step = max(gaps[len(gaps) // 2], 1e-9) if gaps else 1.0
        wanted = max(1, math.ceil(stall / (STALL_BUDGET * step)))
        wanted = int(all_reduce(wanted, op="max", group=self.group))
        return Interval(wanted, round(1e3 * stall, 3), round(1e3 * step, 3))

    def _save(self, parts: Callable[[], Parts]) -> None:
        step = parts()
        position, values = step.position, step.values
        plan = self._current_plan(step.strategy)
        groups = step.strategy.optimizer.param_groups
        dynamic = {
            "states": values["states"],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
            "strategy_values": [[list(p), v] for p, v in plan.values],
            "own": step.own,
            "global_micro_batch": values["global_micro_batch"],
        }
        extra: list[torch.Tensor] = []
        skeleton = codec.encode(dynamic, extra)
        tensors = plan.tensors + extra
        if self.peers:
            own = {
                json.dumps(list(p)): t for p, t, o in zip(plan.paths, plan.tensors, plan.own) if o
            }
            blob = codec.encode_blob({"own": dynamic["own"], "strategy_own": own})
            tensors.append(self._gather_peers(blob))
        key = (plan.ident, tuple((t.dtype, t.shape) for t in tensors[len(plan.tensors) :]))
        if key != self._layout or self._manifest is None:
            specs, size = codec.layout(tensors)
            if self._check is None:  # what a resume checks before it loads, as a disk's record
                self._check = codec.encode(values["record"], [])
            self._layout, self._manifest = (
                key,
                {
                    "paths": [list(p) for p in plan.paths],
                    "own": plan.own,
                    "n_plan": len(plan.tensors),
                    "specs": [[s.dtype, list(s.shape), s.offset] for s in specs],
                    "data_size": size,
                    "check": self._check,
                },
            )
        slot = {"step": position[1], "position": list(position), "peers": self.peers}
        self.slots.save(slot | {"values": skeleton}, tensors, self._manifest, key)

    def _current_plan(self, strategy: Strategy) -> _Plan:
        plan = self._plan
        if plan is not None and plan.reusable and plan.signature == plan.watch.signature():
            return plan
        state = strategy.state_dict()
        watch = _Watch(strategy)
        storages = {local(t).untyped_storage().data_ptr() for t in watch.live()}
        paths, tensors, own, values = [], [], [], []
        for path, value in leaves(state):
            if isinstance(value, torch.Tensor):
                paths.append(path)
                tensors.append(local(value))
                own.append(path[0] == PER_RANK)
            else:
                values.append((path, value))
        # reusable only when every tensor is a live one: a copy made by state_dict() goes stale
        aliases = all(t.untyped_storage().data_ptr() in storages for t in tensors)
        # the optimizer's param_groups.<name>.<key>: the saved parameter groups restore them
        hyper_only = all(
            len(p) == 2 and p[0] == "optim" and str(p[1]).startswith("param_groups.")
            for p, _ in values
        )
        ident = plan.ident + 1 if plan else 0
        kept = [] if hyper_only else values
        signature = watch.signature()
        self._plan = _Plan(
            paths, tensors, own, kept, aliases and hyper_only, watch, signature, ident
        )
        return self._plan

    def _gather_peers(self, mine: bytes | None) -> torch.Tensor:
        """Every rank's own part, gathered into a [world, 8 + capacity] uint8 tensor (each row: its
        length, its blob), gathered again with more capacity where a blob is longer. ``mine=None``
        (length -1): this rank stops saving, and every other raises :class:`PeerStopped`."""
        self._gathered = True
        while True:
            row = torch.zeros(8 + self._peer_capacity, dtype=torch.uint8)
            length = torch.tensor([-1 if mine is None else len(mine)], dtype=torch.int64)
            row[:8] = length.view(torch.uint8)
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

    def wait(self) -> None:
        """Nothing is ever in flight: a copy is whole when :meth:`save_step` returns."""

    def close(self, remove: bool) -> None:
        """Unmap the slots; ``remove``: delete them too (the run finished)."""
        if remove:
            self.slots.remove()
        else:
            self.slots.close()

    def latest(self, warn: Callable[[str], None] | None = None) -> Choice | None:
        """Where every rank can resume from memory, the newest position not passed over
        (collective); whole slots that do not check are left out, named through ``warn`` once."""
        skipped = self._skipped
        found = [f for f in self.slots.found() if f.position not in skipped]
        offer = {
            "own": sorted({f.position for f in found if f.rank == self.rank}),
            "peers": sorted({f.position for f in found if f.peers}),
            "damaged": self.slots.damaged if not skipped else [],
        }
        offers: list[Any] = all_gather_object(offer, group=self.group)
        damaged = sorted({text for o in offers for text in o["damaged"]})
        if damaged and warn is not None:
            warn(f"ddpkit: skipping damaged snapshots in memory: {'; '.join(damaged)}")
        return choose(offers)

    def load_step(self, choice: Choice, strategy: Strategy, check: Check) -> Resumed:
        """The state at ``choice``, its tensors copied into ``strategy``'s, on every rank or none:
        :class:`~ddpkit.snapshot._state.Damaged` (every rank) when a rank found its copy damaged; a
        refusal of ``check`` on every rank."""
        got, problems = self._read_everywhere(choice, strategy, check)
        if got is None or problems:
            self._skipped.add(choice.position)
            raise Damaged("; ".join(problems))
        saved, dynamic, own = got
        # The saved hyper-parameters (a scheduler's lr) first: the state read next holds them.
        for group, values in zip(strategy.optimizer.param_groups, dynamic["param_groups"]):
            group.update(values)
        state = strategy.state_dict()
        for path, value in leaves(state):
            if isinstance(value, torch.Tensor):
                with torch.no_grad():
                    local(value).copy_(saved[path])
        for path, value in dynamic["strategy_values"]:
            set_at(state, path, value)
        ranks: list[Any] = [None] * self.world_size
        ranks[self.rank] = own  # the streams read only this rank's entry at the same world size
        streams = {STREAMS_PART: {"world_size": self.world_size, "ranks": ranks}}
        self.forget(keep=choice)
        donor = ""
        if choice.donor is not None:
            donor = f" (ranks {list(choice.needy)} from rank {choice.donor})"
        loaded = {
            "strategy": state,
            "states": dynamic["states"] | streams,
            "global_micro_batch": dynamic["global_micro_batch"],
        }
        return Resumed(loaded, f"memory{donor}", f"memory{donor}", disk=False)

    def forget(self, keep: Choice | None = None) -> None:
        """Only the state resumed from (none after a resume from disk) may be found again: a later
        restart never picks a slot of an abandoned course."""
        path = None
        if keep is not None:
            found = self.slots.found()
            mine = (f.path for f in found if f.rank == self.rank and f.position == keep.position)
            path = next(mine, None)
        self.slots.discard_except(path)

    def _read_everywhere(
        self, choice: Choice, strategy: Strategy, check: Check
    ) -> tuple[tuple[Any, Any, Any] | None, list[str]]:
        """This rank's read of ``choice`` and what every rank found wrong with its own (collective:
        all take the state or none does). A refusal (another run) is raised on every rank."""
        got, problem = None, None
        try:
            got = self._read(choice, strategy, check)
        except slots_lib.BadSlot as err:
            problem = ("damaged", f"rank {self.rank}: {err}")
        except ConfigError as err:
            problem = ("config", str(err))
        except RuntimeError as err:
            problem = ("refused", str(err))
        problems: list[Any] = all_gather_object(problem, group=self.group)
        for kind, text in filter(None, problems):
            if kind == "config":
                raise ConfigError(text)
            if kind == "refused":
                raise RuntimeError(text)
        return got, [text for _, text in filter(None, problems)]

    def _read(self, choice: Choice, strategy: Strategy, check: Check) -> tuple[Any, Any, Any]:
        """The state at ``choice``, from this rank's slot or the donor's (collective when there is a
        donor), checked before anything is put into the run; ``BadSlot`` naming the slot if not."""
        found = {(f.rank, f.position): f for f in self.slots.found()}
        mine = found.get((self.rank, choice.position))
        data = None
        if choice.donor is not None:  # the donor sends a slot that holds every rank's own part
            held = [f for (_, p), f in sorted(found.items()) if p == choice.position and f.peers]
            sent = held[0].path.read_bytes() if held and self.rank == choice.donor else b""
            data = self._broadcast_bytes(sent, choice.donor)
        if mine is not None:
            got = slots_lib.read_slot(mine.path, data=True)
            name = str(mine.path)
        else:
            name = f"rank {choice.donor}'s slot (sent to rank {self.rank})"
            got = slots_lib.parse_slot(data, name) if data is not None else None
        if got is None:
            raise slots_lib.BadSlot(
                f"the state in memory at step {choice.step} changed while it was read ({name})"
            )
        try:
            return self._checked(strategy, check, *got, from_peer=mine is None)
        except slots_lib.BadSlot as err:
            raise slots_lib.BadSlot(f"{name}: {err}") from None
        except ConfigError:  # another config or model: refused as a disk snapshot is, not skipped
            raise
        except codec.MALFORMED as err:  # values that lie, their CRC-32 rewritten to match
            raise slots_lib.BadSlot(
                f"{name}: its values are not what a save writes ({type(err).__name__}: {err})"
            ) from None

    def _broadcast_bytes(self, data: bytes, donor: int) -> bytes:
        """The donor's ``data`` on every rank, sent as it is: ``broadcast_object`` would pickle a
        second copy of the slot (the model and optimizer state) on the donor."""
        assert self.group is not None  # a donor exists only where there are several ranks
        src = dist.get_global_rank(self.group, donor)
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=src, group=self.group)
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
        buf = torch.empty(int(size), dtype=torch.uint8) if buf is None else buf
        dist.broadcast(buf, src=src, group=self.group)
        return tensor_bytes(buf)

    def _checked(
        self,
        strategy: Strategy,
        check: Check,
        record: slots_lib.Record,
        manifest: dict,
        values: dict,
        data: bytes,
        *,
        from_peer: bool,
    ) -> tuple[dict[KeyPath, torch.Tensor], dict[str, Any], Any]:
        """The slot's tensors by path, its values and this rank's own part, checked against the run
        (``check``) and the strategy's state (every tensor, its shape and dtype)."""
        if values.get("run") != self.slots.run or values.get("world_size") != self.world_size:
            raise RuntimeError("ddpkit: a memory snapshot of another run was offered; refusing it")
        tensors = slots_lib.tensors_of(data, record, manifest)
        n_plan, paths = manifest["n_plan"], manifest["paths"]
        if type(n_plan) is not int or not 0 <= n_plan <= len(tensors) or len(paths) != n_plan:
            raise slots_lib.BadSlot(
                "its manifest does not say which tensors are the model's and optimizer's"
            )
        saved = {tuple(p): t for p, t in zip(paths, tensors[:n_plan])}
        dynamic = codec.decode(values["values"], tensors[n_plan:])
        if not isinstance(dynamic["states"], dict):
            raise slots_lib.BadSlot("its values are not the states a save writes")
        record_state = codec.decode(manifest["check"], [])
        check(
            {
                "record": record_state,
                "states": dynamic["states"],
                "global_micro_batch": dynamic["global_micro_batch"],
            },
            "the snapshot in memory",
        )
        _check_values(dynamic, len(strategy.optimizer.param_groups))
        own = dynamic["own"]
        if from_peer:  # this rank's own part, from the donor's gathered rows
            own = self._own_row(tensors[-1], saved)
        plain = set()
        for path, value in leaves(strategy.state_dict()):
            if not isinstance(value, torch.Tensor):
                plain.add(path)
                continue
            held, name = saved.get(path), ".".join(map(str, path))
            if held is None:
                raise slots_lib.BadSlot(f"it holds no {name}")
            if held.shape != local(value).shape or held.dtype != local(value).dtype:
                # copy_ would broadcast a [1] into any shape: a lie must not reach the model
                raise slots_lib.BadSlot(
                    f"its {name} is {held.dtype}{list(held.shape)}, the model's "
                    f"{local(value).dtype}{list(local(value).shape)}"
                )
        if not all(tuple(p) in plain for p, _ in dynamic["strategy_values"]):
            raise slots_lib.BadSlot(
                "its values name a part of the state the model and optimizer do not have"
            )
        return saved, dynamic, own

    def _own_row(self, rows: torch.Tensor, saved: dict[KeyPath, torch.Tensor]) -> Any:
        """This rank's row of the every-rank part a donor's slot holds: its own values, and its own
        tensors of the strategy's state put into ``saved``."""
        if (
            rows.dtype != torch.uint8
            or rows.dim() != 2
            or rows.shape[0] != self.world_size
            or rows.shape[1] < 8
        ):
            raise slots_lib.BadSlot("its every-rank part is not one row per rank")
        row = rows[self.rank]
        length = int(row[:8].clone().view(torch.int64))
        if not 0 <= length <= row.numel() - 8:
            raise slots_lib.BadSlot(
                f"rank {self.rank}'s row says {length} bytes, more than it holds"
            )
        part = codec.decode_blob(tensor_bytes(row[8 : 8 + length]))
        for key, tensor in part["strategy_own"].items():
            saved[tuple(json.loads(key))] = tensor
        return part["own"]


def _check_values(dynamic: dict[str, Any], groups: int) -> None:
    """A slot's values are the parameter groups and strategy values a save writes."""
    param_groups, strategy_values = dynamic["param_groups"], dynamic["strategy_values"]
    if (
        not isinstance(param_groups, list)
        or len(param_groups) != groups
        or not all(isinstance(g, dict) for g in param_groups)
        or not all(
            isinstance(v, list) and len(v) == 2 and isinstance(v[0], list) and v[0]
            for v in strategy_values
        )
    ):
        raise slots_lib.BadSlot(
            "its values are not the counters, parameter groups and states a save writes"
        )


class _Watch:
    """A cheap test that the live objects a plan copies from are still those: the parameters'
    storage (a script may set ``p.data``), each buffer, and the optimizer's state tensors."""

    def __init__(self, strategy: Any) -> None:
        module = unwrap(strategy.model)
        self.params = list(module.parameters())
        self.buffers = buffer_slots(module)
        # ZeroRedundancyOptimizer keeps its rank's parameters' state in its local optimizer, .optim
        found = [strategy.optimizer, getattr(strategy.optimizer, "optim", None)]
        self.optimizers = list({id(o): o for o in found if o is not None}.values())

    def _states(self) -> list[Any]:
        return [
            v for opt in self.optimizers for state in opt.state.values() for v in state.values()
        ]

    def live(self) -> list[torch.Tensor]:
        found: list[torch.Tensor] = list(self.params)
        found += [b for owner, name in self.buffers if (b := owner[name]) is not None]
        return found + [v for v in self._states() if isinstance(v, torch.Tensor)]

    def signature(self) -> tuple[Any, ...]:
        return (
            tuple(p.data_ptr() for p in self.params),
            tuple(id(owner[name]) for owner, name in self.buffers),
            tuple(id(v) for v in self._states()),
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
