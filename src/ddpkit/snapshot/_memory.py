"""The memory store: after optimizer steps, each rank's state goes into its slots in shared memory
(:mod:`ddpkit.snapshot._slots`), with no collective; across nodes, a copy of it also goes to ranks
of other nodes beside training (:mod:`ddpkit.snapshot._replicas`). A restarted job resumes from the
newest step every rank holds there, a rank whose node was lost from a copy on another
(docs/snapshots.md, "Snapshots in memory").
"""

from __future__ import annotations

import contextlib
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
from ddpkit.snapshot import _replicas as replicas_lib
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
from ddpkit.strategies._base import PER_RANK, UNSTEPPED, Strategy
from ddpkit.strategies._prepare import unwrap

STALL_BUDGET = 0.05
"""The share of a step the copy to memory may hold the training loop when the interval is chosen."""
TRANSFER_BUDGET = 0.02
"""The share of a step the copies to other nodes may take when the interval is chosen: the waits
for their transfers and their thread's CPU time (on a node with no core to spare, taken from the
step's)."""
TUNE_AFTER = 8
"""Saves (one per step) measured before the interval is chosen."""
KEPT_TIMES = 4096
"""Saves whose times a store keeps, at least (:attr:`MemoryStore.stalls`)."""


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor of a strategy's state."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _warn(message: str) -> None:
    print(f"ddpkit: {message}", file=sys.stderr, flush=True)


def open_memory(
    run_dir: Path,
    runtime: Runtime,
    strategy: Strategy,
    every_steps: int | None,
    replicas: int | None = None,
) -> MemoryStore | None:
    """The memory store of the run in ``run_dir`` when the agent of ``ddpkit run`` made the job a
    memory folder on every node, else None, with one line saying why; collective. ``every_steps``:
    a copy every N steps; None: chosen (:meth:`MemoryStore._choose_interval`). ``replicas``: as
    :attr:`~ddpkit.SnapshotConfig.replicas`."""
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
    group = _gloo_group(rt.group) if rt.distributed else None
    placement, note = None, ""
    if rt.distributed:
        # a node is the global rank of its first local rank (torchrun numbers a node's ranks on)
        nodes = all_gather_object(dist.get_rank() - rt.local_rank, group=group)
        placement, note = replicas_lib.place(nodes, replicas)
    if note and rt.is_main:
        _warn(note)
    if rt.local_rank == 0:
        model = strategy.model
        copies = placement.copies if placement is not None and not strategy.replicated else 1
        need = 2 * copies * rt.local_world_size * sum(local(p).nbytes for p in model.parameters())
        if warning := slots_lib.room_warning(slots.folder, need):
            _warn(warning)
    return MemoryStore(
        slots, every_steps=every_steps, group=group, strategy=strategy, placement=placement
    )


def _gloo_group(group: Group) -> Any:
    """A gloo group over the ranks of ``group``, bounded by the job's collective timeout."""
    seconds = read_launch_env().collective_timeout
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    timeout = timedelta(seconds=seconds) if seconds else DEFAULT_TIMEOUT
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True, timeout=timeout)


@dataclass(frozen=True)
class Interval:
    """The interval of the copies, once chosen: every ``every_steps`` steps, for a copy's median
    stall and a step's median time (ms); with copies on other nodes, their number (``replicas``,
    the rank's own included), the bytes a rank sends each time (``copy_bytes``), a transfer's
    median time beside training (``transfer_ms``) and the CPU time its thread takes
    (``transfer_cpu_ms``), the largest over the ranks."""

    every_steps: int
    stall_ms: float
    step_ms: float
    replicas: int = 1
    copy_bytes: int = 0
    transfer_ms: float = 0.0
    transfer_cpu_ms: float = 0.0


@dataclass(frozen=True)
class Choice:
    """Where every rank resumes: a position (epoch, step, cursor), and for each rank that does not
    hold it, the rank that holds a copy of its state there and sends it (``sources``: pairs of
    needy rank and holder; none: every rank holds it)."""

    position: tuple[int, ...]
    sources: tuple[tuple[int, int], ...] = ()

    @property
    def step(self) -> int:
        return self.position[1]


def choose(
    offers: list[dict[str, Any]], disk_step: int = -1, *, over_own: bool = False
) -> Choice | None:
    """The newest position every rank can resume from, newer than ``disk_step``, or None (the same
    on every rank). ``offers[r]``: rank r's ``own`` positions, and the positions of the copies it
    holds of other ranks' states (``replicas``: {rank: positions}). A rank that does not hold a
    position takes it from the first rank holding a copy of its state there; ``over_own``: a copy
    holds a rank's own part alone (``ddp``), read over its holder's own slot there."""
    own = [{tuple(p) for p in o["own"]} for o in offers]
    held = [
        {int(r): {tuple(p) for p in ps} for r, ps in o.get("replicas", {}).items()} for o in offers
    ]
    everywhere = set().union(*own, *(ps for h in held for ps in h.values()))
    for position in sorted(everywhere, reverse=True):
        if position[1] <= disk_step:
            return None
        sources: list[tuple[int, int]] = []
        for rank, mine in enumerate(own):
            if position in mine:
                continue
            holders = [
                h
                for h, copies in enumerate(held)
                if position in copies.get(rank, ()) and (not over_own or position in own[h])
            ]
            if not holders:
                break
            sources.append((rank, holders[0]))
        else:
            return Choice(position, tuple(sources))
    return None


class MemoryStore:
    """The snapshots in memory of one run (:func:`open_memory`). ``placement``: where copies of
    each rank's state go on other nodes (None: none leaves the node); ``strategy``: whose optimizer
    steps wait for the copies of the step before to be whole (at most one step is lost)."""

    def __init__(
        self,
        slots: slots_lib.Slots,
        *,
        every_steps: int | None,
        group: Group,
        strategy: Strategy | None = None,
        placement: replicas_lib.Placement | None = None,
    ) -> None:
        self.slots, self.group = slots, group
        self._fixed = every_steps  # None: chosen after the first saves; recorded either way
        self._tuned = False
        self._starts: list[float] = []  # perf_counter at each save, until the interval is chosen
        self._calls = 0
        self.rank, self.world_size = slots.rank, slots.world_size
        self.enabled = True
        self._plan: _Plan | None = None
        self._layout: tuple[Any, ...] | None = None
        self._manifest: dict[str, Any] | None = None
        self._check: Any = None
        self._skipped: set[tuple[int, ...]] = set()
        self.stalls: list[float] = []
        """Seconds each save held the training loop: its copy, and the wait for its transfer (the
        newest :data:`KEPT_TIMES` to twice as many)."""
        self.waits: list[float] = []
        """Of each save's stall, the seconds it waited for the transfer of the copy before."""
        self.rounds: list[replicas_lib.Round] = []
        """The transfers of the copies to other nodes, settled (the newest 64)."""
        # ddp: every rank holds the model and optimizer; a copy is a rank's own part alone
        self.own_part = strategy is None or bool(strategy.replicated)
        self.placement = placement
        self.replicas = placement.copies if placement is not None else 1
        self.copies: replicas_lib.ReplicaFiles | None = None
        self.courier: replicas_lib.Courier | None = None
        self._strategy = strategy
        self._hooks: list[Any] = []
        self._stream: Any = None  # the side stream of copies from a GPU
        if placement is not None:
            self.copies = replicas_lib.ReplicaFiles(
                slots.folder, job=slots.job, run=slots.run, world_size=self.world_size,
                sources=placement.sources(self.rank),
            )  # fmt: skip
            self.courier = replicas_lib.Courier(
                placement, self.rank, self.world_size, _gloo_group(group), self.copies
            )
            self._watch_updates()

    def _watch_updates(self) -> None:
        """Every optimizer step waits for the copy of the step before (:meth:`_before_update`)."""
        strategy = self._strategy
        if strategy is not None and not self._hooks:
            optimizers = getattr(strategy, "optimizers", None) or [strategy.optimizer]
            self._hooks = [o.register_step_pre_hook(self._before_update) for o in optimizers]

    def save_step(self, parts: Callable[[], Parts]) -> Interval | None:
        """Copy the step's ``parts()`` into the older slot (read only while the copies go on, and
        timed with the copy), and hand it to the transfer to other nodes; every rank calls it after
        the same steps (collective where the interval is chosen). Memory full: one warning, and the
        copies stop on this rank (with copies on other nodes, on every rank). A value the codec
        cannot hold raises before the slot is touched. Returns the interval once it is chosen
        (after :data:`TUNE_AFTER` copies)."""
        self._calls += 1
        if self.enabled or self.courier is not None:
            self._save_timed(parts)
        if not self._tuned and self._calls == TUNE_AFTER:
            return self._choose_interval()
        return None

    def _save_timed(self, parts: Callable[[], Parts]) -> None:
        t0 = time.perf_counter()
        if not self._tuned:
            self._starts.append(t0)
        waited = self._settle()  # the copy before whole everywhere (mostly settled by the step)
        step, payload, commit = -1, None, None
        if self.enabled:
            try:
                step, payload, commit = self._save(parts)
            except slots_lib.MemoryUnavailable as err:
                self.enabled = False
                _warn(f"snapshots in memory stop on rank {self.rank} ({err}); disk snapshots go on")
        if self.courier is not None:
            if self.enabled and self.copies is not None and self.copies.full is not None:
                self.enabled = False
                _warn(
                    f"snapshots in memory stop on rank {self.rank}: it cannot hold the copies of "
                    f"other ranks ({self.copies.full}); disk snapshots go on"
                )
            # a rank that stopped says so in the transfer: every rank stops once it is settled
            self.courier.submit(step, payload if self.enabled else None, commit)
        self.stalls.append(time.perf_counter() - t0)
        self.waits.append(waited)
        if len(self.stalls) >= 2 * KEPT_TIMES:  # a long run's: bounded
            del self.stalls[:KEPT_TIMES], self.waits[:KEPT_TIMES]

    def _before_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Before an optimizer step: the copies of the step before whole on the other nodes, so that
        a lost node costs at most one step (their transfer ran beside this step's forward and
        backward passes); the wait counted in the stall of the save before."""
        waited = self._settle()
        if self.stalls:
            self.stalls[-1] += waited
            self.waits[-1] += waited

    def _settle(self) -> float:
        """The transfer in flight, once it ended (the seconds waited for it): a copy that arrived
        damaged named, every rank's copies stopped where a rank stopped; a rank lost meanwhile
        raises here (the step cannot go on without it)."""
        courier = self.courier
        if courier is None or courier.in_flight is None:
            return 0.0
        t0 = time.perf_counter()
        result = courier.settle()
        waited = time.perf_counter() - t0
        assert result is not None
        self.rounds = [*self.rounds[-63:], result]
        if result.error is not None:
            err = result.error
            raise RuntimeError(
                f"ddpkit: the copy in memory of step {result.step} did not reach the ranks of "
                f"other nodes ({type(err).__name__}: {err})"
            ) from err
        for text in result.damaged:
            _warn(f"a copy in memory arrived damaged and is not kept: {text}")
        if result.stopped:
            self.enabled = False
            self._stop_copies()
            if self.rank == 0:
                _warn(
                    f"snapshots in memory stop on every rank: rank(s) {result.stopped} cannot "
                    "keep theirs; disk snapshots go on"
                )
        return waited

    def _stop_copies(self) -> None:
        """No more transfers: the thread ends, the optimizers no longer wait."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.courier is not None:
            self.courier.close()
            self.courier = None

    def _choose_interval(self) -> Interval:
        """Every ``N`` steps, the smallest ``N`` whose copy's own stall stays within
        :data:`STALL_BUDGET` of a step and whose copies to other nodes (the waits for them, their
        thread's CPU) within :data:`TRANSFER_BUDGET` (the first two saves, which map the slots, left
        out), or the one given; the largest over the ranks, with the transfers' figures."""
        self._tuned = True
        median = lambda xs: sorted(xs)[len(xs) // 2] if xs else 0.0  # noqa: E731
        stall = median(self.stalls[2:])
        # a step: the time between two saves one step apart, less the save itself
        gaps = [b - a - s for a, b, s in zip(self._starts[2:], self._starts[3:], self.stalls[2:])]
        step = max(median(gaps), 1e-9) if gaps else 1.0
        rounds = [r for r in self.rounds if not r.stopped]
        cpu = median([r.cpu for r in rounds])
        wanted = max(1, math.ceil(stall / (STALL_BUDGET * step)))
        if self.placement is not None:  # the copy's own stall, and its copies to other nodes
            own = median([s - w for s, w in zip(self.stalls[2:], self.waits[2:])])
            copies = median(self.waits[2:]) + cpu
            wanted = max(
                1,
                math.ceil(own / (STALL_BUDGET * step)),
                math.ceil(copies / (TRANSFER_BUDGET * step)),
            )
        mine = {
            "wanted": float(self._fixed or wanted),
            "transfer": median([r.seconds for r in rounds]),
            "cpu": cpu,
            "bytes": float(max((r.sent for r in rounds), default=0)),
        }
        most = all_reduce(mine, op="max", group=self.group)
        return Interval(
            int(most["wanted"]), round(1e3 * stall, 3), round(1e3 * step, 3), self.replicas,
            int(most["bytes"]), round(1e3 * most["transfer"], 3), round(1e3 * most["cpu"], 3),
        )  # fmt: skip

    def _save(self, parts: Callable[[], Parts]) -> tuple[int, Any, Any]:
        """The step's copy into the older slot: its step, what goes to the other nodes (None where
        nothing does; else the courier makes it) and the commit left to the courier (copies from a
        GPU; None where the slot is whole already)."""
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
        key = (plan.ident, tuple((t.dtype, t.shape) for t in extra))
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
        slot = {"step": position[1], "position": list(position)}
        values = slot | {"values": skeleton}
        commit = None
        if any(t.is_cuda for t in plan.tensors):
            if self._stream is None:
                self._stream = torch.cuda.Stream(plan.tensors[0].device)
            commit = self.slots.save_from_device(values, tensors, self._manifest, key, self._stream)
            if self.courier is None:  # the commit goes on beside the next step
                self.courier = replicas_lib.Courier(None, self.rank, self.world_size, None, None)
                self._watch_updates()
        else:
            self.slots.save(values, tensors, self._manifest, key)
        if self.placement is None:
            return position[1], None, commit
        if not self.own_part:  # zero, fsdp: the slot itself, as it was committed
            return position[1], self.slots.committed, commit
        # ddp: this rank's own part, read back from the slot once it is committed
        own_at = [i for i, own in enumerate(plan.own) if own]
        names = [json.dumps(list(plan.paths[i])) for i in own_at]
        ids = {"job": self.slots.job, "run": self.slots.run, "rank": self.rank}
        ids |= {"world_size": self.world_size, "part": "own"} | slot

        def own_part() -> torch.Tensor:
            last = self.slots.last
            assert last is not None, "the slot is committed first"
            strategy_own = {name: last.dests[i] for name, i in zip(names, own_at)}
            blob = codec.encode_blob({"own": dynamic["own"], "strategy_own": strategy_own})
            packed = slots_lib.pack(ids, [torch.frombuffer(bytearray(blob), dtype=torch.uint8)])
            return torch.frombuffer(bytearray(packed), dtype=torch.uint8)

        return position[1], own_part, commit

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
        # the parameter groups' values (optim.param_groups.<name>.<key>, zero's param_groups): the
        # saved parameter groups restore them, read fresh at each save
        kept = [(p, v) for p, v in values if not _of_param_groups(p)]
        # which optimizers have not stepped changes only with their state, and so the signature
        fixed = all(p == (UNSTEPPED,) for p, _ in kept)
        ident = plan.ident + 1 if plan else 0
        signature = watch.signature()
        self._plan = _Plan(paths, tensors, own, kept, aliases and fixed, watch, signature, ident)
        return self._plan

    def wait(self) -> None:
        """Until the copy last saved is whole in memory here and on the other nodes."""
        self._settle()

    def close(self, remove: bool) -> None:
        """Unmap the slots and the copies held; ``remove``: delete them too (the run finished, its
        last copy sent). A transfer in flight ends first, or with its peers' connections."""
        if remove and self.courier is not None:
            with contextlib.suppress(RuntimeError):
                self._settle()
        self._stop_copies()
        if self.copies is not None:
            self.copies.close(remove=remove)
        if remove:
            self.slots.remove()
        else:
            self.slots.close()

    def latest(self, warn: Callable[[str], None] | None = None) -> Choice | None:
        """Where every rank can resume from memory, the newest position not passed over
        (collective); whole slots that do not check are left out, named through ``warn`` once."""
        skipped = self._skipped
        found = [f for f in self.slots.found() if f.position not in skipped]
        held = self.copies.found() if self.copies is not None else {}
        damaged = self.slots.damaged + (self.copies.damaged if self.copies is not None else [])
        offer = {
            "own": sorted({f.position for f in found if f.rank == self.rank}),
            "replicas": {
                str(r): sorted(p for p in ps if p not in skipped) for r, ps in held.items()
            },
            "damaged": damaged if not skipped else [],
        }
        offers: list[Any] = all_gather_object(offer, group=self.group)
        damaged = sorted({text for o in offers for text in o["damaged"]})
        if damaged and warn is not None:
            warn(f"ddpkit: skipping damaged snapshots in memory: {'; '.join(damaged)}")
        choice = choose(offers, over_own=self.own_part)
        if choice is None and self.placement is not None and warn is not None:
            if (why := _uncovered(offers, self.replicas)) is not None:
                warn(f"ddpkit: {why}; resuming from disk")
        return choice

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
        source = "memory"
        if choice.sources:
            needy = [r for r, _ in choice.sources]
            holders = sorted({h for _, h in choice.sources})
            source += f" (ranks {needy} from rank{'s' * (len(holders) > 1)} "
            source += f"{', '.join(map(str, holders))})"
        loaded = {
            "strategy": state,
            "states": dynamic["states"] | streams,
            "global_micro_batch": dynamic["global_micro_batch"],
        }
        return Resumed(loaded, source, source, disk=False)

    def forget(self, keep: Choice | None = None) -> None:
        """Only the state resumed from (none after a resume from disk) may be found again, here and
        in the copies held: a later restart never picks a slot of an abandoned course."""
        path = None
        if keep is not None:
            path = self._own_path(keep.position)
        self.slots.discard_except(path)
        if self.copies is not None:
            self.copies.discard_except(keep.position if keep is not None else None)

    def _own_path(self, position: tuple[int, ...]) -> Path | None:
        """This rank's whole slot at ``position``, if any."""
        found = self.slots.found()
        return next((f.path for f in found if f.rank == self.rank and f.position == position), None)

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
        """The state at ``choice``, from this rank's slot or from a copy another rank holds
        (collective where some rank takes a copy: point to point), checked before anything is put
        into the run; ``BadSlot`` naming the slot if not."""
        received = self._fetch(choice)
        part = None
        if received is None:  # this rank holds its own slot at the position
            path = self._own_path(choice.position)
            got = slots_lib.read_slot(path, data=True) if path is not None else None
            name = str(path) if path is not None else f"rank {self.rank}'s slot"
        else:
            holder = dict(choice.sources)[self.rank]
            name = f"rank {holder}'s copy of rank {self.rank}'s state (sent to it)"
            copy, under = (received + [None])[:2]
            got = _parsed(copy, name, self.rank, choice.position)
            if self.own_part:  # the copy is this rank's own part, over the holder's slot
                part, name = got, f"rank {holder}'s slot (sent to rank {self.rank})"
                got = _parsed(under, name, holder, choice.position)
        if got is None:
            raise slots_lib.BadSlot(
                f"the state in memory at step {choice.step} changed while it was read ({name})"
            )
        try:
            return self._checked(strategy, check, *got, part=part)
        except slots_lib.BadSlot as err:
            raise slots_lib.BadSlot(f"{name}: {err}") from None
        except ConfigError:  # another config or model: refused as a disk snapshot is, not skipped
            raise
        except codec.MALFORMED as err:  # values that lie, their CRC-32 rewritten to match
            raise slots_lib.BadSlot(
                f"{name}: its values are not what a save writes ({type(err).__name__}: {err})"
            ) from None

    def _fetch(self, choice: Choice) -> list[bytes | None] | None:
        """The copy of this rank's state at ``choice`` (and under ``ddp`` its holder's slot) from
        the rank that holds it, where this rank is needy; None where it is not. Every rank calls it:
        each holder sends what its needy ranks take."""
        if not choice.sources:
            return None
        parts: dict[int, list[bytes | None]] = {}
        for needy, holder in choice.sources:
            if holder == self.rank:
                held = self.copies.bytes_at(needy, choice.position) if self.copies else None
                parts[needy] = [held]
                if self.own_part:
                    path = self._own_path(choice.position)
                    parts[needy].append(slots_lib.slot_bytes(path) if path else None)
        return replicas_lib.exchange(dict(choice.sources), parts, self.rank, self.group)

    def _checked(
        self,
        strategy: Strategy,
        check: Check,
        record: slots_lib.Record,
        manifest: dict,
        values: dict,
        data: bytes,
        *,
        part: tuple[slots_lib.Record, dict, dict, bytes] | None = None,
    ) -> tuple[dict[KeyPath, torch.Tensor], dict[str, Any], Any]:
        """The slot's tensors by path, its values and this rank's own part (from ``part``, a copy
        of it, where given), checked against the run (``check``) and the strategy's state (every
        tensor, its shape and dtype)."""
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
        own = dynamic["own"] if part is None else _own_part(part, saved)
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


def _uncovered(offers: list[dict[str, Any]], copies: int) -> str | None:
    """Why no position in memory holds every rank's state, where some rank holds one (more nodes
    lost at once than the copies cover); None where memory holds nothing."""
    newest = max((tuple(p) for o in offers for p in o["own"]), default=None)
    if newest is None:
        return None
    missing = [
        r
        for r, o in enumerate(offers)
        if list(newest) not in o["own"]
        and not any(list(newest) in h["replicas"].get(str(r), []) for h in offers)
    ]
    if not missing:
        return None
    return (
        f"no step in memory holds every rank's state: at step {newest[1]}, neither rank(s) "
        f"{missing} nor a living rank holds theirs (more nodes lost at once than replicas="
        f"{copies} covers)"
    )


def _parsed(
    data: bytes | None, name: str, rank: int, position: tuple[int, ...]
) -> tuple[slots_lib.Record, dict, dict, bytes] | None:
    """A slot that arrived from another rank, checked (``BadSlot``), its values those of ``rank``'s
    state at ``position``; None where it did not arrive whole."""
    got = slots_lib.parse_slot(data, name) if data is not None else None
    if got is None:
        return None
    values = got[2]
    if values.get("rank") != rank or values.get("position") != list(position):
        raise slots_lib.BadSlot(
            f"{name}: it holds rank {values.get('rank')}'s state at {values.get('position')}, "
            f"not rank {rank}'s at {list(position)}"
        )
    return got


def _own_part(part: tuple[slots_lib.Record, dict, dict, bytes], saved: dict[KeyPath, Any]) -> Any:
    """A rank's own values, from a copy of its own part (:meth:`MemoryStore._save` under ``ddp``),
    its own tensors of the strategy's state put into ``saved``."""
    record, manifest, values, data = part
    tensors = slots_lib.tensors_of(data, record, manifest)
    if values.get("part") != "own" or len(tensors) != 1 or tensors[0].dtype != torch.uint8:
        raise slots_lib.BadSlot("it is not a copy of a rank's own part")
    blob = codec.decode_blob(tensor_bytes(tensors[0]))
    for key, tensor in blob["strategy_own"].items():
        saved[tuple(json.loads(key))] = tensor
    return blob["own"]


def _of_param_groups(path: KeyPath) -> bool:
    """Whether a value of a strategy's state is one of its parameter groups' (its learning rate, its
    betas), which a slot saves apart and a load puts back before it reads the state."""
    under_optim = len(path) == 2 and path[0] == "optim" and str(path[1]).startswith("param_groups.")
    return under_optim or path == ("param_groups",)


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
    values: list[tuple[KeyPath, Any]]  # non-tensor values, but the parameter groups' ones
    reusable: bool
    watch: _Watch
    signature: tuple[Any, ...]
    ident: int
