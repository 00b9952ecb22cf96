"""The one front door of snapshots: :class:`Snapshots` saves and resumes a hand-written loop
(docs/snapshots.md), and the Trainer, which builds one (:meth:`Snapshots.of_trainer`). Two stores
keep the snapshots behind one interface (:class:`Store`): the disk (:mod:`ddpkit.snapshot._disk`)
and, with ``memory=True`` under ``ddpkit run``, shared memory (:mod:`ddpkit.snapshot._memory`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ddpkit._errors import ConfigError, Preempted, checked_arguments
from ddpkit.data._fingerprint import refusal
from ddpkit.data._loader import EpochLoader
from ddpkit.distributed import _signals as signals
from ddpkit.distributed._collectives import all_reduce
from ddpkit.distributed._runtime import (
    Resume,
    Runtime,
    get_runtime,
    hold,
    print0,
    recovers_in_place,
    resumed,
)
from ddpkit.snapshot._disk import DiskStore
from ddpkit.snapshot._folders import folder_name
from ddpkit.snapshot._run_dir import RunRecord, claim
from ddpkit.snapshot._state import (
    STREAMS_PART,
    Check,
    Damaged,
    NewRankState,
    Parts,
    RankStreams,
    Resumed,
    SnapshotConfig,
    SnapshotSchedule,
    TrainState,
)
from ddpkit.strategies._base import Strategy
from ddpkit.strategies._prepare import LoopModel, unwrap

if TYPE_CHECKING:  # the memory store is imported when a run asks for it
    from ddpkit.snapshot._memory import MemoryStore

Load = Callable[[dict[str, Any]], None]
OPTIONAL = frozenset({"records"})
ABANDON_WAIT = 5.0  # seconds a failed run's snapshot write in flight is waited for
"""Parts a snapshot of an earlier version may lack: the run goes on without restoring them."""


class Store(Protocol):
    """What the front door asks of a store of snapshots (the disk's, the memory's): it hands a
    store the state to keep (:class:`~ddpkit.snapshot._state.Parts`) and, to read one back, the
    strategy to read it into and the check it must pass. Every rank calls every method after the
    same steps."""

    def save_step(self, parts: Callable[[], Parts]) -> Any:
        """Keep the step's state, which ``parts()`` gives when the store copies it."""

    def latest(self, warn: Callable[[str], None]) -> Any:
        """The newest whole state every rank can take, the same on every rank, or None; damaged ones
        are named through ``warn`` and passed over."""

    def load_step(self, found: Any, strategy: Strategy, check: Check) -> Resumed:
        """The state ``found``, read once ``check`` has accepted it (before any tensor is read),
        its tensors into ``strategy``'s state; :class:`~ddpkit.snapshot._state.Damaged` on every
        rank, with nothing read into the strategy, when a rank finds it damaged."""

    def wait(self) -> None:
        """Until the state last saved is whole in the store."""


class Snapshots:
    """Saves and resumes a hand-written loop (docs/snapshots.md); every rank builds it and
    calls every method after the same steps (saving and resuming are collectives).

    ``model``: a :func:`~ddpkit.prepare_model` result (or the bare module), several by name
    (``{"G": netG, "D": netD}``), or a strategy of :func:`~ddpkit.strategies.build_strategy` (its
    optimizer comes with it). ``optimizer``, ``scheduler``: one or a list. ``loader``: a
    :func:`~ddpkit.build_loader` loader, whose position a resume continues from. ``extra``: objects
    with ``state_dict()``/``load_state_dict()`` that are the same on every rank (rank 0's is saved);
    ``own``: such objects each rank keeps its own of (at another world size, a rank beyond the old
    world gets what ``new_rank_state`` says, as ``TrainerConfig.new_rank_state``). ``every_steps``:
    a snapshot every this many :meth:`step` calls (None: only :meth:`save` and stop signals);
    ``keep``, ``async_write``, ``memory``, ``memory_every_steps``, ``replicas``: as
    :class:`~ddpkit.SnapshotConfig`'s. ``signals_every_steps``: how often the ranks agree on a stop
    signal (one all-reduce of one number). ``seed``: what the streams are reseeded from at another
    world size (default: the loader's seed, else 0).
    """

    @checked_arguments
    def __init__(
        self,
        run_dir: str | Path,
        *,
        model: nn.Module | Mapping[str, nn.Module] | Any,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        loader: EpochLoader | None = None,
        extra: Mapping[str, Any] | None = None,
        own: Mapping[str, Any] | None = None,
        new_rank_state: NewRankState = "refuse",
        every_steps: int | None = None,
        keep: int = 2,
        async_write: bool = True,
        memory: bool = False,
        memory_every_steps: int | None = None,
        replicas: int | None = None,
        signals_every_steps: int = 20,
        seed: int | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        # checks every_steps, keep and the rest, naming a wrong one (a string from argparse too)
        config = SnapshotConfig(
            every_steps=every_steps, every_epochs=0, keep=keep, async_write=async_write,
            memory=memory, memory_every_steps=memory_every_steps, replicas=replicas,
        )  # fmt: skip
        if signals_every_steps < 1:
            raise ConfigError(f"Snapshots(signals_every_steps={signals_every_steps}): give >= 1")
        if loader is not None and not isinstance(loader, EpochLoader):
            raise ConfigError(
                "Snapshots(loader=...) takes a ddpkit.build_loader loader, not "
                f"{type(loader).__name__}: its position (epoch and global sample cursor) is what a "
                "resume continues from"
            )
        rt = runtime or get_runtime()
        strategy = _strategy(model, _listed(optimizer, "optimizer"))
        train = TrainState()
        states: dict[str, Any] = {"train": train}  # first: the streams' reseed reads the step
        if loader is not None:
            states["loader"] = loader
        states |= _named(_listed(scheduler, "scheduler"), "scheduler")
        states |= {f"extra.{k}": v for k, v in _listed_map(extra, "extra").items()}
        generator = getattr(loader, "generator", None) or torch.Generator()
        if seed is None:
            seed = getattr(loader.batch_sampler, "seed", 0) if loader is not None else 0
        states[STREAMS_PART] = RankStreams(
            rt, generator, seed, train, own=_listed_map(own, "own"),
            new_rank_state=new_rank_state, warn=lambda line: print0(line, group=rt.group),
        )  # fmt: skip
        bare = strategy.bare if isinstance(strategy, LoopModel) else unwrap(strategy.model)
        record = RunRecord.of_loop([n for n in states if n != STREAMS_PART], list(own or {}), bare)
        # One job at a time on a run directory, whichever front door writes it (the Trainer's
        # fit() takes the same lock): a second would resume from and prune this one's snapshots.
        self._lock = claim(run_dir, is_main=rt.is_main, fresh=False, group=rt.group)
        self._open(Path(run_dir), config, rt, strategy, states, record, None)
        self.loader, self.signals_every_steps = loader, signals_every_steps
        self._signals.enter_context(signals.stop_signals(self._on_signal))

    @classmethod
    def of_trainer(
        cls,
        run_dir: Path,
        config: SnapshotConfig,
        *,
        runtime: Runtime,
        strategy: Any,
        states: Mapping[str, Any],
        own: Mapping[str, Any],
        generator: torch.Generator,
        seed: int,
        new_rank_state: NewRankState,
        record: RunRecord,
        global_micro_batch: int,
        log: Callable[[str, int, dict[str, Any]], None],
    ) -> Snapshots:
        """The Trainer's: ``states``, its parts by name (``"train"`` first, None where it has
        none), and the streams' part (``"rng"``, last) with ``own``, the parts each rank keeps its
        own of, as :class:`Snapshots`' ``own`` (``generator``: the loader's; ``seed``: what the
        streams are reseeded from at another world size); ``log(kind, step, record)`` writes a
        record."""
        self = cls.__new__(cls)
        self.loader, self._lock = None, None  # fit() holds the run directory
        parts = {k: v for k, v in states.items() if v is not None}
        parts[STREAMS_PART] = RankStreams(
            runtime, generator, seed, parts["train"], own=own, new_rank_state=new_rank_state,
            warn=lambda line: print0(line, group=runtime.group),
        )  # fmt: skip
        self._open(run_dir, config, runtime, strategy, parts, record, global_micro_batch, log)
        return self

    def _open(
        self,
        run_dir: Path,
        config: SnapshotConfig,
        runtime: Runtime,
        strategy: Any,
        states: dict[str, Any],
        record: RunRecord,
        global_micro_batch: int | None,
        log: Callable[[str, int, dict[str, Any]], None] | None = None,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.run_dir, self.runtime, self.strategy, self.record = run_dir, runtime, strategy, record
        self.states = states
        """The parts besides the strategy, by name: ``"train"`` first, ``"rng"`` (the streams)."""
        self.train: TrainState = states["train"]
        self.streams: RankStreams = states[STREAMS_PART]
        self.global_micro_batch = global_micro_batch
        self.log = log or (lambda kind, step, record: None)
        self._warn = warn or (lambda line: print0(line, group=runtime.group))
        self.disk = DiskStore(
            run_dir / "snapshots", group=runtime.group, keep_last=config.keep,
            async_write=config.async_write,
        )  # fmt: skip
        self.schedule = SnapshotSchedule.of(config)
        """When a snapshot is due, on disk or in memory; holds the memory's interval."""
        self.resumed_from: int | None = None
        """The step of the snapshot :meth:`resume` restored, if any."""
        self._fresh: frozenset[str] = frozenset()  # parts a resume starts afresh (a new scaler)
        self._precision: tuple[str, str] | None = None
        self._signal, self._stopping, self._deferred = 0, False, False
        self._signals = contextlib.ExitStack()
        self.memory: MemoryStore | None = None
        """The copies in shared memory (``memory=True``; None where the job has no folder)."""
        self._let_go = hold(f"ddpkit.Snapshots({run_dir})", self._abandon)
        if config.memory:  # a restart resumes from them even under resume=False: see Trainer.fit
            from ddpkit.snapshot._memory import open_memory

            self.memory = open_memory(
                run_dir, runtime, strategy, config.memory_every_steps, config.replicas
            )
        elif recovers_in_place():
            raise ConfigError(
                "ddpkit run --recover in-place resumes every rank from the copies in memory, and "
                "this run keeps none: pass memory=True (SnapshotConfig(memory=True) for the "
                "Trainer, Snapshots(..., memory=True) for a loop), or run without --recover "
                "in-place"
            )

    @property
    def steps(self) -> int:
        """Optimizer steps taken, those before the snapshot resumed from included."""
        return self.train.step

    def position(self) -> tuple[int, int, int]:
        """(epoch, step, cursor) now; a hand loop's from its loader."""
        if self.loader is not None:
            self.train.epoch, self.train.cursor = self.loader.position()
        return self.train.position

    def step(self) -> bool:
        """Count one optimizer step of a hand loop and save when one is due: every ``every_steps``,
        or when any rank got a stop signal (then raise :class:`~ddpkit.Preempted` once the snapshot
        is whole); a save due at an epoch's last batch waits for the next step. True if it saved."""
        self.train.step += 1
        step = self.train.step
        if step % self.signals_every_steps == 0 and not self._stopping:
            # one rank's signal reaches every rank here, after the same step
            flag = float(self._signal > 0)
            self._stopping = bool(all_reduce(flag, op="max", group=self.runtime.group))
        finishing = self.loader is not None and self.loader.finishing_epoch
        if self.in_memory_due(step, True) and not finishing:
            self.save_in_memory()
        every = self.schedule.every_steps
        if not (self._deferred or self._stopping or (every is not None and step % every == 0)):
            return False
        if finishing:
            self._deferred = True
            return False
        self._deferred = False
        self.save(wait=self._stopping)
        if self._stopping:
            self.close()
            preempted = Preempted.by(self._signal, step)
            self._warn(f"ddpkit: {preempted}; raising ddpkit.Preempted")
            raise preempted
        return True

    def save(self, wait: bool = False) -> None:
        """Snapshot this step to disk (every rank writes its part): returns once the state is copied
        to host memory (``async_write``), or written; ``wait``, or a pre-emption notice: once it is
        whole. A position already on disk is not written again."""
        position, wait = self.position(), wait or self.schedule.notice is not None
        fresh = self.schedule.new_position(position)
        self.schedule.written(position)
        if fresh:
            # logged before the state is taken: the records' end it holds is past this record
            step = self.train.step
            event = {"event": "snapshot", "file": folder_name(step), "async": self.disk.async_write}
            self.log("event", step, event)
            self.disk.save_step(self.parts)
        if wait:
            self.disk.wait()

    def in_memory_due(self, step: int, taken: bool) -> bool:
        """A copy in memory is due after optimizer step ``step`` (the same on every rank)."""
        return self.memory is not None and self.schedule.in_memory(step, taken)

    def save_in_memory(self) -> None:
        """The copy in memory (every rank), when :meth:`in_memory_due` says so; the copies' interval
        once the store has chosen it."""
        assert self.memory is not None
        chosen = self.memory.save_step(self.parts)
        if chosen is not None:
            self.schedule.memory_every_steps = chosen.every_steps
            self.log("event", self.train.step, {"event": "memory_snapshots", **asdict(chosen)})

    def wait(self) -> None:
        """Block until the snapshot being written in the background (if any) is whole on disk."""
        self.disk.wait()

    def close(self, *, finished: bool = False) -> None:
        """Take a save that waited for an epoch's end, wait for the last write, and put back the
        signal handlers; a signal that came after the ranks' last agreement is passed on.
        ``finished``: the run's last state is on disk, and the copies in memory go; otherwise they
        stay until the job ends, for a restart."""
        if self._deferred:
            self._deferred = False
            self.save()
        self.disk.wait()
        if self.memory is not None:
            self.memory.close(remove=finished)
            self.memory = None
        self._signals.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        self._let_go()
        if not self._stopping and self._signal:
            sig, self._signal = self._signal, 0
            signals.pass_on(sig)

    def _abandon(self) -> None:
        """A failed run's snapshots let go, nothing saved: the signal handlers put back, the run
        directory unlocked, the copies in memory closed (kept for the next run), a write in flight
        waited for a few seconds (its error dropped)."""
        self._deferred = False
        self._signals.close()
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self.memory is not None:
            self.memory.close(remove=False)
            self.memory = None
        if not self.disk.abandon(wait=ABANDON_WAIT):
            raise RuntimeError(
                f"a snapshot write still runs {ABANDON_WAIT:g} s on: it ends beside the next run"
            )

    def __enter__(self) -> Snapshots:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is not None:  # the epoch's end may have failed half-way: no position to resume at
            self._deferred = False
        self.close()

    def _on_signal(self, signum: int) -> None:
        self._signal = signum  # only a flag: the next agreement spreads it

    def state_dict(self) -> dict[str, Any]:
        """Everything the next step needs; collective, as every rank's streams are gathered."""
        return {
            "strategy": self.strategy.state_dict(),
            "states": {n: p.state_dict() for n, p in self.states.items()},
            "record": self.record.state_dict(),
            "global_micro_batch": self.global_micro_batch,
        }

    def parts(self) -> Parts:
        """This step's state as a store keeps it (no collective): each rank's own streams apart,
        the streams' part holding the world size alone."""
        position = self.position()
        states = {n: p.state_dict() for n, p in self.states.items() if n != STREAMS_PART}
        states[STREAMS_PART] = {"world_size": self.runtime.world_size}
        values = {
            "states": states,
            "record": self.record.state_dict(),
            "global_micro_batch": self.global_micro_batch,
        }
        return Parts(position, self.strategy, values, self.streams.mine())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, its ``strategy`` part already loaded for this world
        size; the parts in their order (``"train"`` first)."""
        self.strategy.load_state_dict(state["strategy"])
        for name, part in self.states.items():
            if name in state["states"]:
                part.load_state_dict(state["states"][name])
            elif name not in self._fresh and name not in OPTIONAL:
                raise ConfigError(
                    f"the snapshot holds no {name!r} state: it was written by a run without one "
                    "(a scheduler or fp16's GradScaler added since?); resume with the same parts"
                )

    def check(self, saved: Mapping[str, Any], where: str) -> None:
        """The one check of a resume, from disk or memory, before any tensor is read: refuse a
        snapshot (``saved``: its record, states and global micro-batch) of another run, naming each
        difference, or of other data; note a change of precision, which a resume may make."""
        self.record.check(saved["record"], where)
        if (
            self.global_micro_batch is not None
            and saved["global_micro_batch"] != self.global_micro_batch
        ):
            raise ConfigError(
                f"the snapshot was taken with {saved['global_micro_batch']} samples per global "
                f"micro-batch, this run has {self.global_micro_batch}: keep global_batch_size (or "
                "batch_size x world size) and grad_accum_steps as they were to resume"
            )
        for name, part in self.states.items():
            state = saved["states"].get(name)
            if isinstance(part, EpochLoader) and state and part.on_data_change != "restart_epoch":
                if changes := part.changes_since(state):
                    raise refusal(changes, int(state["epoch"]), int(state["cursor"]))
        self._precision = self.record.precision_change(saved["record"])
        # to fp16 from another precision: a fresh GradScaler, which the snapshot has no state of
        to_fp16 = self._precision is not None and self._precision[1] == "fp16"
        self._fresh = frozenset({"scaler"}) if to_fp16 else frozenset()

    def resume(self, load: Load | None = None) -> int:
        """Restore every part from the newest whole snapshot, if any (every rank), through ``load``
        (default :meth:`load_state_dict`); return the step to go on from (0 when there is none).
        Refused by name before any tensor is read when the snapshot is another run's."""
        started = time.time()
        got = self._restore(load or self.load_state_dict)
        restored = time.time()
        if got is None:
            self._resumed(Resume(0, "none", started, restored))
            return 0
        if got.disk:
            self.schedule.written(self.position())  # already on disk
        if self._precision is not None:
            self._warn_precision_change(*self._precision)
        rt, t = self.runtime, self.train
        self.resumed_from = t.step
        if (size := self.streams.reseeded_from) is not None:
            self._warn(
                f"ddpkit: resuming a {size}-rank snapshot on {rt.world_size} ranks: same samples "
                "in the same steps; random streams (dropout, augmentation) are reseeded"
            )
        batch = f", batch {self.loader.batch_in_epoch}" if self.loader is not None else ""
        self._warn(
            f"ddpkit: resumed from {got.source} (epoch {t.epoch}{batch}, step {t.step}, restart "
            f"{rt.restart_count})"
        )
        self.log("event", t.step, {
            "event": "resume", "file": got.file, "epoch": t.epoch, "cursor": t.cursor,
            "restart_count": rt.restart_count, "world_size": rt.world_size,
            # records written after the snapshot, moved to metrics.rewound.jsonl
            "rewound_records": getattr(self.states.get("records"), "rewound", 0),
        })  # fmt: skip
        self._resumed(Resume(t.step, got.source, started, restored))
        return t.step

    def _resumed(self, resume: Resume) -> None:
        """Record what the process's launcher adds to a resume (in-place recovery's ``recover``)."""
        for event in resumed(resume):
            self.log("event", resume.step, event)

    def _restore(self, load: Load) -> Resumed | None:
        """The one place a resume chooses its store (collective): the newest state in memory when it
        is newer than the disk's newest whole snapshot, else that snapshot."""
        disk, memory, warn = self.disk, self.memory, self._warn
        found, verified, marked, got = None, False, None, None
        while memory is not None:
            held = memory.latest(warn)
            if held is None:
                break
            marked = disk.newest_marked() if marked is None else marked
            if not verified and held.step <= marked:  # a snapshot on disk may be as new: verify
                found, verified = disk.latest(warn), True
            if found is not None and held.step <= found.step:
                break
            try:
                got = memory.load_step(held, self.strategy, self.check)
                break
            except Damaged as err:
                warn(
                    f"ddpkit: skipping the snapshot in memory at step {held.step}: {err}; trying "
                    "the one before it, in memory or on disk"
                )
        if got is None:
            if memory is not None:
                memory.forget()
            if not verified:
                found = disk.latest(warn)
            if found is None:
                return None
            got = disk.load_step(found, self.strategy, self.check)
        load(got.state)
        return got

    def _warn_precision_change(self, old: str, new: str) -> None:
        scaler = "fresh" if new == "fp16" else "dropped" if old == "fp16" else None
        note = {
            "fresh": "; fp16's GradScaler starts afresh at its initial scale",
            "dropped": "; the snapshot's fp16 GradScaler state is dropped",
            None: "",
        }[scaler]
        self._warn(
            f"ddpkit: WARNING: precision changed from {old} (the snapshot's) to {new} on "
            f"resume{note}. This run's steps are not those the snapshot's run would have taken: "
            "the bitwise-resume guarantee does not hold for this run"
        )
        change = {"event": "precision_change", "from": old, "to": new, "scaler": scaler}
        self.log("event", self.train.step, change | {"bitwise_resume": False})


def resumes(resume: bool, restart_count: int) -> bool:
    """Whether ``fit()`` resumes from the run's snapshots: when the config asks, and always on a
    restart (``resume=False`` means "this job starts afresh", which its first attempt did)."""
    return resume or restart_count > 0


def _strategy(model: Any, optimizers: list[Any]) -> Any:
    """What a hand loop's model is saved through: a strategy as it is, else a :class:`LoopModel`."""
    if isinstance(model, (nn.Module, Mapping)):
        models = {"": model} if isinstance(model, nn.Module) else dict(model)
        return LoopModel(models, optimizers)
    if callable(getattr(model, "state_dict", None)) and hasattr(model, "replicated"):
        if optimizers:
            raise ConfigError(
                "Snapshots(model=strategy): the strategy's optimizer is saved with it; drop "
                "optimizer="
            )
        return model
    raise ConfigError(
        f"Snapshots(model={type(model).__name__}): give a module, a dict of them, or a strategy"
    )


def _listed(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for item in items:
        if not (
            callable(getattr(item, "state_dict", None))
            and callable(getattr(item, "load_state_dict", None))
        ):
            raise ConfigError(
                f"{what}={item!r} has no state_dict()/load_state_dict(): pass the object itself"
            )
    return items


def _listed_map(value: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    items = dict(value or {})
    for name, item in items.items():
        _listed(item, f"{what}[{name!r}]")
    return items


def _named(items: list[Any], name: str) -> dict[str, Any]:
    return {name: items[0]} if len(items) == 1 else {f"{name}.{i}": x for i, x in enumerate(items)}


__all__ = ["Snapshots"]
