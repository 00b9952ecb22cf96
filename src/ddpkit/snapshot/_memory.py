"""The memory store: after optimizer steps, each rank's state goes into its slots in shared memory
(:mod:`ddpkit.snapshot._slots`), with no collective; across nodes, a copy of it also goes to ranks
of other nodes beside training (:mod:`ddpkit.snapshot._replicas`). A restarted job resumes from the
newest step every rank holds there, a rank whose node was lost from a copy on another
(docs/snapshots.md, "Snapshots in memory").
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
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
)
from ddpkit.distributed._environment import read_launch_env
from ddpkit.distributed._runtime import DEFAULT_TIMEOUT, Runtime
from ddpkit.snapshot import _codec as codec
from ddpkit.snapshot import _replicas as replicas_lib
from ddpkit.snapshot import _slots as slots_lib
from ddpkit.snapshot._choice import (
    Choice,
    choose,
    choose_resharded,
    choose_resized,
    newest_elsewhere,
    uncovered,
)
from ddpkit.snapshot._interval import TUNE_AFTER, Interval, interval_of, median
from ddpkit.snapshot._resized import Box, OldWorld, box_of, checked_boxes, local
from ddpkit.snapshot._state import (
    STREAMS_PART,
    Check,
    Damaged,
    KeyPath,
    Parts,
    Resumed,
    agreed,
    leaves,
    of_param_groups,
    set_at,
)
from ddpkit.strategies._base import PER_RANK, UNSTEPPED, Strategy
from ddpkit.strategies._prepare import unwrap

KEPT_TIMES = 4096
"""Saves whose times a store keeps, at least (:attr:`MemoryStore.stalls`)."""


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
    placement, note, node = None, "", [rt.rank]
    if rt.distributed:
        # a node is the global rank of its first local rank (torchrun numbers a node's ranks on)
        nodes = all_gather_object(dist.get_rank() - rt.local_rank, group=group)
        placement, note = replicas_lib.place(nodes, replicas)
        node = [r for r, n in enumerate(nodes) if n == nodes[rt.rank]]
    if note and rt.is_main:
        _warn(note)
    if rt.local_rank == 0:
        model = strategy.model
        copies = placement.copies if placement is not None and not strategy.replicated else 1
        need = 2 * copies * rt.local_world_size * sum(local(p).nbytes for p in model.parameters())
        if warning := slots_lib.room_warning(slots.folder, need):
            _warn(warning)
    return MemoryStore(
        slots, every_steps=every_steps, group=group, strategy=strategy, placement=placement,
        node=node,
    )  # fmt: skip


def _gloo_group(group: Group) -> Any:
    """A gloo group over the ranks of ``group``, bounded by the job's collective timeout."""
    seconds = read_launch_env().collective_timeout
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    timeout = timedelta(seconds=seconds) if seconds else DEFAULT_TIMEOUT
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True, timeout=timeout)


class MemoryStore:
    """The snapshots in memory of one run (:func:`open_memory`). ``placement``: where copies of
    each rank's state go on other nodes (None: none leaves the node); ``strategy``: whose optimizer
    steps wait for the copies of the step before to be whole (at most one step is lost); ``node``:
    the ranks of this rank's node."""

    def __init__(
        self,
        slots: slots_lib.Slots,
        *,
        every_steps: int | None,
        group: Group,
        strategy: Strategy | None = None,
        placement: replicas_lib.Placement | None = None,
        node: list[int] | None = None,
    ) -> None:
        self.slots, self.group = slots, group
        self.node = node or [slots.rank]  # the ranks of this node
        self._fixed = every_steps  # None: chosen after the first saves; recorded either way
        self._tuned = False
        self._starts: list[float] = []  # perf_counter at each save, until the interval is chosen
        self._sent: list[bool] = []  # whether each of those saves went to the other nodes
        self._swept = False  # the files of this run at another world size, once removed
        self._carried = False  # whether a copy has reached the other nodes whole
        self._calls = 0
        self.rank, self.world_size = slots.rank, slots.world_size
        self.enabled = True
        self._plan: _Plan | None = None
        self._layout: tuple[Any, ...] | None = None
        self._manifest: dict[str, Any] | None = None
        self._check: Any = None
        self.skipped: set[tuple[int, ...]] = set()
        """The positions some rank found damaged: never offered again."""
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
        self.old_world = OldWorld(self)
        self._room = threading.Lock()  # the old world's files removed by one thread at a time
        self._hooks: list[Any] = []
        self._stream: Any = None  # the side stream of copies from a GPU
        if placement is not None:
            self.copies = replicas_lib.ReplicaFiles(
                slots.folder, job=slots.job, run=slots.run, world_size=self.world_size,
                sources=placement.sources(self.rank),
            )  # fmt: skip
            self.copies.make_room = self._make_room
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
        if not self._tuned and self._calls == TUNE_AFTER * (2 if self._paired else 1):
            return self._choose_interval()
        return None

    @property
    def _paired(self) -> bool:
        """Whether the interval is chosen on saves sent to other nodes paired with saves not sent
        (the cost of a transfer, measured whole: its thread, gloo's and the turns of the core it
        takes from the step)."""
        return self.placement is not None and self._fixed is None

    def _save_timed(self, parts: Callable[[], Parts]) -> None:
        t0 = time.perf_counter()
        # while the interval is chosen, every other save stays on this node (every rank alike)
        send = self._tuned or not self._paired or self._calls % 2 == 1
        if not self._tuned:
            self._starts.append(t0)
            self._sent.append(send and self.courier is not None)
        waited = self._settle()  # the copy before whole everywhere (mostly settled by the step)
        if not self._swept and (self._carried if self.placement is not None else self._calls > 1):
            with self._room:
                self._swept = True  # this world holds a whole copy of its own
                self.old_world.sweep()
        step, payload, commit = -1, None, None
        if self.enabled:
            try:
                try:
                    step, payload, commit = self._save(parts, keep=send)
                except slots_lib.MemoryFull as full:
                    if not self._make_room(full.needed):
                        raise
                    step, payload, commit = self._save(parts, keep=send)
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
            self.courier.submit(step, payload if self.enabled else None, commit, send=send)
        self.stalls.append(time.perf_counter() - t0)
        self.waits.append(waited)
        if len(self.stalls) >= 2 * KEPT_TIMES:  # a long run's: bounded
            del self.stalls[:KEPT_TIMES], self.waits[:KEPT_TIMES]

    def _make_room(self, needed: int) -> bool:
        """Memory full for a file of ``needed`` bytes: where removing the files of this run at
        another world size on this node (kept until this world holds a whole copy of its own, for
        a failure before then) makes room for it, remove them, saying so. True where the write is
        worth one more try: room made here, or meanwhile (by another rank of the node, or by the
        other of the training and the transfer's thread). Each node decides for itself."""
        with self._room:
            try:
                free = slots_lib.free_bytes(self.slots.folder)
                if free >= needed:
                    return True
                old = self.old_world.removable()
                if not old or free + sum(_size(p) for p in old) < needed:
                    return False  # nothing to remove, or not enough: kept for a failure
                self.old_world.sweep(old)
            except OSError:
                return False
        _warn(
            f"rank {self.rank}: memory full: the copies in memory of this run at another world "
            f"size removed from this node ({len(old)} files) to make room for this world's (until "
            "this world holds a whole copy of its own, a failure may resume from the disk)"
        )
        return True

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
        self._carried |= result.carried and not result.damaged and not result.stopped
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
        """The interval of :func:`interval_of` for this rank's first saves, or the one given; the
        largest over the ranks, with the transfers' figures."""
        self._tuned = True
        rounds = [r for r in self.rounds if r.carried and not r.stopped]
        wanted, stall, step, cpu, cost = interval_of(
            self._starts, self._sent, self.stalls, self.waits, [r.cpu for r in rounds],
            copies=self.placement is not None, paired=self._paired,
        )  # fmt: skip
        mine = {
            "wanted": float(self._fixed or wanted),
            "transfer": median([r.seconds for r in rounds]),
            "cpu": cpu,
            "cost": cost,
            "bytes": float(max((r.sent for r in rounds), default=0)),
        }
        most = all_reduce(mine, op="max", group=self.group)
        return Interval(
            int(most["wanted"]), round(1e3 * stall, 3), round(1e3 * step, 3), self.replicas,
            int(most["bytes"]), round(1e3 * most["transfer"], 3), round(1e3 * most["cpu"], 3),
            round(1e3 * most["cost"], 3),
        )  # fmt: skip

    def _save(self, parts: Callable[[], Parts], keep: bool = True) -> tuple[int, Any, Any]:
        """The step's copy into the older slot: its step, what goes to the other nodes (None where
        nothing does; else the courier makes it) and the commit left to the courier (copies from a
        GPU; None where the slot is whole already). ``keep=False`` (a copy not sent to the other
        nodes): the slot of the last one sent is not overwritten, so that one stays whole on this
        node as on theirs."""
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
                    "boxes": [[list(part) for part in box] for box in plan.boxes],
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
            commit = self.slots.save_from_device(
                values, tensors, self._manifest, key, self._stream, keep
            )
            if self.courier is None:  # the commit goes on beside the next step
                self.courier = replicas_lib.Courier(None, self.rank, self.world_size, None, None)
                self._watch_updates()
        else:
            self.slots.save(values, tensors, self._manifest, key, keep)
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
        paths, tensors, own, values, boxes = [], [], [], [], []
        for path, value in leaves(state):
            if isinstance(value, torch.Tensor):
                paths.append(path)
                tensors.append(local(value))
                boxes.append(box_of(value))
                own.append(path[0] == PER_RANK)
            else:
                values.append((path, value))
        # reusable only when every tensor is a live one: a copy made by state_dict() goes stale
        aliases = all(t.untyped_storage().data_ptr() in storages for t in tensors)
        # the parameter groups' values (optim.param_groups.<name>.<key>, zero's param_groups): the
        # saved parameter groups restore them, read fresh at each save
        kept = [(p, v) for p, v in values if not of_param_groups(p)]
        # which optimizers have not stepped changes only with their state, and so the signature
        fixed = all(p == (UNSTEPPED,) for p, _ in kept)
        ident = plan.ident + 1 if plan else 0
        signature = watch.signature()
        reusable = aliases and fixed
        self._plan = _Plan(paths, tensors, own, kept, boxes, reusable, watch, signature, ident)
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
        skipped = self.skipped
        found = [f for f in self.slots.found() if f.position not in skipped]
        held = self.copies.found() if self.copies is not None else {}
        damaged = self.slots.damaged + (self.copies.damaged if self.copies is not None else [])
        offer = {
            "own": sorted({f.position for f in found if f.rank == self.rank}),
            "replicas": {
                str(r): sorted(p for p in ps if p not in skipped) for r, ps in held.items()
            },
            "damaged": damaged if not skipped else [],
            "sizes": self.old_world.offer(),
        }
        offers: list[Any] = all_gather_object(offer, group=self.group)
        damaged = sorted({text for o in offers for text in o["damaged"]})
        if damaged and warn is not None:
            warn(f"ddpkit: skipping damaged snapshots in memory: {'; '.join(damaged)}")
        # a course at another world size newer than this world's slots abandoned them (a job
        # that shrank and grew back): none of them is taken
        choice = choose(offers, newest_elsewhere(offers) - 1, over_own=self.own_part)
        if choice is None:
            resized = choose_resized if self.own_part else choose_resharded
            choice = resized(offers, self.world_size)
        if choice is None and warn is not None:
            sizes = sorted({int(w) for o in offers for w in o["sizes"]})
            if sizes and not self.own_part:
                name = getattr(self._strategy, "name", "a sharding strategy")
                warn(
                    f"ddpkit: the copies in memory were taken on {' and '.join(map(str, sizes))} "
                    f"ranks, this run has {self.world_size}: under {name!r} no step of them newer "
                    "than this world's own copies has every old rank's shards whole (its slot, or "
                    "a copy of it on another node: replicas=2 or more) on a node left; resuming "
                    "from disk"
                )
            elif sizes and max(sizes) > self.world_size:
                warn(
                    f"ddpkit: the copies in memory were taken on {max(sizes)} ranks, and no step "
                    "of them holds every rank's own part (a copy of it on another node: "
                    "replicas=2 or more) with a slot on the node of every rank of this world; "
                    "resuming from disk"
                )
            elif self.placement is not None and (why := uncovered(offers, self.replicas)):
                warn(f"ddpkit: {why}; resuming from disk")
        return choice

    def load_step(self, choice: Choice, strategy: Strategy, check: Check) -> Resumed:
        """The state at ``choice``, its tensors copied into ``strategy``'s, on every rank or none:
        :class:`~ddpkit.snapshot._state.Damaged` (every rank) when a rank found its copy damaged; a
        refusal of ``check`` on every rank."""
        if choice.world_size is not None:
            got, problems = self.old_world.read(choice, strategy, check)
        else:
            got, problems = self._read_everywhere(choice, strategy, check)
        if got is None or problems:
            self.skipped.add(choice.position)
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
        if choice.world_size is None:
            ranks: list[Any] = [None] * self.world_size
            ranks[self.rank] = own  # the streams read only this rank's entry at the same size
            streams = {STREAMS_PART: {"world_size": self.world_size, "ranks": ranks}}
        else:  # every old rank's, reseeded as from a disk snapshot of another world size
            streams = {STREAMS_PART: {"world_size": choice.world_size, "ranks": own}}
        self.forget(keep=choice)
        source = "memory"
        if choice.world_size is not None:
            source += f" (taken on {choice.world_size} ranks)"
        elif choice.sources:
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
            path = self._own_path(keep.position, keep.world_size)
        self.slots.discard_except(path)
        if self.copies is not None:
            self.copies.discard_except(keep.position if keep is not None else None)

    def _own_path(self, position: tuple[int, ...], size: int | None = None) -> Path | None:
        """This rank's whole slot at ``position`` (taken at world size ``size``: this one where
        None), if any."""
        size = size or self.world_size
        found = self.slots.found(any_size=size != self.world_size)
        return next(
            (
                f.path
                for f in found
                if f.rank == self.rank and f.position == position and f.world_size == size
            ),
            None,
        )

    def _read_everywhere(
        self, choice: Choice, strategy: Strategy, check: Check
    ) -> tuple[tuple[Any, Any, Any] | None, list[str]]:
        """This rank's read of ``choice`` and what every rank found wrong with its own (collective:
        all take the state or none does). A refusal (another run) is raised on every rank."""
        got, problem = self.attempt(lambda: self._read(choice, strategy, check))
        return got, agreed(all_gather_object(problem, group=self.group))

    def attempt(self, read: Callable[[], Any], malformed: bool = False) -> tuple[Any, Any]:
        """``read()``, or None and what was wrong with it, as every rank is told (:func:`_agreed`):
        a damaged slot, a refused config, another run's state (``malformed``: values no save
        writes are damage too)."""
        kinds = codec.MALFORMED if malformed else ()
        try:
            return read(), None
        except slots_lib.BadSlot as err:
            return None, ("damaged", f"rank {self.rank}: {err}")
        except ConfigError as err:
            return None, ("config", str(err))
        except RuntimeError as err:
            return None, ("refused", str(err))
        except kinds as err:
            return None, ("damaged", f"rank {self.rank}: its values are not a save's ({err})")

    def read_slot(
        self,
        path: Path,
        strategy: Strategy,
        check: Check,
        size: int,
        sharded: bool = False,
        whose: tuple[int, tuple[int, ...]] | None = None,
    ) -> tuple[dict[KeyPath, torch.Tensor], dict[str, Any], Any]:
        """A slot or whole copy on this node taken at world size ``size``, read and checked
        (:meth:`_checked`), of old rank ``whose[0]``'s state at ``whose[1]`` where given."""
        got = slots_lib.read_slot(path, data=True)
        if got is None:
            raise slots_lib.BadSlot(f"{path} changed while it was read")
        if whose is not None and (got[2].get("rank"), got[2].get("position")) != (
            whose[0], list(whose[1])
        ):  # fmt: skip
            raise slots_lib.BadSlot(f"{path} holds another rank's or step's state than it said")
        try:
            return self._checked(strategy, check, *got, world_size=size, sharded=sharded)
        except slots_lib.BadSlot as err:
            raise slots_lib.BadSlot(f"{path}: {err}") from None

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
            got = replicas_lib.parsed_copy(copy, name, self.rank, choice.position)
            if self.own_part:  # the copy is this rank's own part, over the holder's slot
                part, name = got, f"rank {holder}'s slot (sent to rank {self.rank})"
                got = replicas_lib.parsed_copy(under, name, holder, choice.position)
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
        world_size: int | None = None,
        sharded: bool = False,
    ) -> tuple[dict[KeyPath, torch.Tensor], dict[str, Any], Any]:
        """The slot's tensors by path, its values and this rank's own part (from ``part``, a copy
        of it, where given), checked against the run (``check``; a slot of ``world_size``, this
        world's where None) and the strategy's state (every tensor, its shape and dtype; where
        ``sharded``, the place of each tensor in its global tensor instead, as
        ``dynamic["boxes"]``: the plan of the pieces checks them against the state)."""
        size = world_size or self.world_size
        if values.get("run") != self.slots.run or values.get("world_size") != size:
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
        own = dynamic["own"] if part is None else replicas_lib.own_part_of(part, saved)
        if sharded:
            try:
                shapes = [tuple(t.shape) for t in saved.values()]
                boxes = checked_boxes(manifest.get("boxes"), shapes)
            except ValueError as err:
                raise slots_lib.BadSlot(f"its manifest's places of its tensors: {err}") from None
            return saved, dynamic | {"boxes": dict(zip(saved, boxes))}, own
        _check_against(strategy.state_dict(), saved, dynamic)
        return saved, dynamic, own


def _check_against(state: dict[str, Any], saved: dict[KeyPath, Any], dynamic: Any) -> None:
    """A slot's tensors (``saved``) and values hold the strategy's ``state``: every tensor of it,
    its shape and dtype, and no value it does not have (``BadSlot`` naming what differs)."""
    plain = set()
    for path, value in leaves(state):
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
    boxes: list[Box]  # where each tensor lies in its global one (a resume at another size)
    reusable: bool
    watch: _Watch
    signature: tuple[Any, ...]
    ident: int


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
