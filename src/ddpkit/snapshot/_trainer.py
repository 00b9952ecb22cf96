"""What a snapshot of a Trainer holds, and how a run resumes from one.

The Trainer hands over its stateful parts, each with ``state_dict()`` / ``load_state_dict()``: the
strategy (model and optimizer, each rank's own part: shards under zero and fsdp, each rank's own
buffers under its own name), and the rest by name: the counters
(:class:`~ddpkit.snapshot._state.TrainState`), every rank's random streams with the state each rank
keeps its own of (its losses not yet agreed on, the callbacks' and the script's ``extra_state``),
the epoch's agreed losses, early stopping, the LR scheduler and the GradScaler. When a snapshot is
due: :class:`~ddpkit.snapshot._schedule.SnapshotSchedule`. A snapshot is
``run_dir/snapshots/step-N/`` (:mod:`ddpkit.snapshot._manager`): the strategy's part through
:mod:`torch.distributed.checkpoint`, so it reshards on load; the others, with the run's record
(:class:`~ddpkit.snapshot._run_record.RunRecord`), in ``values.pt``.

A resume is refused, naming each difference, before any tensor is read when the config, the
optimizer's hyper-parameters, the model's shapes or the classes of its modules differ from the
snapshot's, or when the global micro-batch does. The precision may change
(:meth:`~ddpkit.snapshot._run_record.RunRecord.precision_change`), with a warning that the resume is
not bitwise, in the output and as a ``precision_change`` event. At the same world size every rank
gets its own buffers and random streams back and the run continues bit for bit; at another, every
rank takes rank 0's buffers and the random streams are reseeded from (seed, step, rank).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ddpkit._errors import ConfigError
from ddpkit.distributed._runtime import Runtime
from ddpkit.snapshot._manager import SnapshotManager, folder_name
from ddpkit.snapshot._run_record import RunRecord
from ddpkit.snapshot._schedule import SnapshotConfig, SnapshotSchedule
from ddpkit.strategies import Strategy

# the memory backend is imported when a run asks for it (SnapshotConfig(memory=True))
if TYPE_CHECKING:
    from ddpkit.snapshot._memory.snapshots import MemorySnapshots

STREAMS = "rng"
"""The part of ``TrainerSnapshots.states`` that holds each rank's random streams (a RankStreams)."""
OPTIONAL = frozenset({"records"})
"""Parts a snapshot of an earlier version may lack: the run goes on without restoring them (the
records' ends: nothing is rewound)."""


class Stateful(Protocol):
    """What a stateful part of the Trainer has: its state as a dict, and a way back from it."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Counters(Stateful, Protocol):
    """Where training stands (the Trainer's :class:`~ddpkit.snapshot._state.TrainState`)."""

    epoch: int
    step: int
    cursor: int

    @property
    def position(self) -> tuple[int, int, int]: ...


class TrainerSnapshots:
    """Saves the Trainer's stateful parts to ``run_dir/snapshots`` and restores them; every rank
    calls every method (saving and finding a snapshot are collectives)."""

    def __init__(
        self,
        run_dir: Path,
        config: SnapshotConfig,
        *,
        runtime: Runtime,
        strategy: Strategy,
        train: Counters,
        states: Mapping[str, Stateful | None],
        record: RunRecord,
        global_micro_batch: int,
        log: Callable[..., None],
        print0: Callable[[str], None],
    ) -> None:
        """``states``: the parts besides the strategy, by name (None where the run has none, e.g. no
        scheduler); ``train`` is loaded first, as the others may read it.
        ``log(kind, step, record)`` writes a record."""
        self.runtime, self.strategy, self.train, self.record = runtime, strategy, train, record
        self.states = {"train": train, **{k: v for k, v in states.items() if v is not None}}
        self.global_micro_batch = global_micro_batch
        self.log, self.print0, self.run_dir = log, print0, run_dir
        self.manager = SnapshotManager(
            run_dir / "snapshots",
            group=runtime.group,
            keep_last=config.keep,
            async_write=config.async_write,
        )
        self.schedule = SnapshotSchedule.of(config)
        """When a snapshot is due (the Trainer and the snapshots in memory ask it), and what is
        written."""
        self.resumed_from: int | None = None
        # parts this run starts afresh though the snapshot lacks them
        self._fresh: frozenset[str] = frozenset()
        self.memory: MemorySnapshots | None = None
        """The snapshots in memory (:meth:`open_memory`): a resume takes them when newer."""
        if config.memory:  # (a restart resumes from them even under resume=False: see Trainer.fit)
            self.open_memory(config.memory_every_steps)

    def open_memory(self, every_steps: int | None) -> MemorySnapshots | None:
        """Copies of the state in shared memory after steps, beside the disk's (collective; None
        where the job has no memory folder, with a line saying why)."""
        from ddpkit.snapshot._memory.snapshots import TrainerParts, open_memory_snapshots

        train = self.train
        parts = TrainerParts(
            runtime=self.runtime, run_dir=self.run_dir, strategy=self.strategy,
            schedule=self.schedule, states=self.states, record=self.record,
            global_micro_batch=self.global_micro_batch, position=lambda: train.position,
            log=self.log,
        )  # fmt: skip
        self.memory = open_memory_snapshots(parts, every_steps)
        return self.memory

    def in_memory_due(self, step: int, taken: bool) -> bool:
        """A copy in memory is due after optimizer step ``step`` (the same on every rank)."""
        return self.memory is not None and self.schedule.in_memory(step, taken)

    def save_in_memory(self) -> None:
        """The copy in memory (every rank), when :meth:`in_memory_due` says so. The disk's snapshot
        of a step is :meth:`save`, placed by the Trainer after the step's agreement and
        validation."""
        assert self.memory is not None
        self.memory.save()

    def close(self) -> None:
        """At the end of ``fit()`` (not on a failure, whose restart resumes from memory): the copies
        in memory go."""
        if self.memory is not None:
            self.memory.close(remove=True)

    def state_dict(self, streams: bool = True) -> dict[str, Any]:
        """Everything the next step needs. Collective: every rank calls it (the random streams are
        gathered). ``streams=False``: each rank's random streams left out (``"rng"`` holds the world
        size alone), with no collective; a disk snapshot has each rank write its own."""
        states = {
            name: part.state_dict()
            for name, part in self.states.items()
            if streams or name != STREAMS
        }
        if not streams and STREAMS in self.states:
            states[STREAMS] = {"world_size": self.runtime.world_size}
        return {
            "strategy": self.strategy.state_dict(),
            "states": states,
            "record": self.record.state_dict(),
            "global_micro_batch": self.global_micro_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, its ``strategy`` part already loaded for this world
        size."""
        if state["global_micro_batch"] != self.global_micro_batch:
            raise ConfigError(
                f"the snapshot was taken with {state['global_micro_batch']} samples per global "
                f"micro-batch, this run has {self.global_micro_batch}: keep global_batch_size (or "
                "batch_size x world size) and grad_accum_steps as they were to resume"
            )
        self.strategy.load_state_dict(state["strategy"])
        # "train" first: the random streams' reseed reads the step
        for name, part in self.states.items():
            if name not in state["states"]:
                if name in self._fresh or name in OPTIONAL:
                    continue
                raise ConfigError(
                    f"the snapshot holds no {name!r} state: it was written by a run without one "
                    "(a scheduler or fp16's GradScaler added since?); resume with the same parts"
                )
            part.load_state_dict(state["states"][name])

    def disk_parts(self) -> tuple[dict[str, Any], dict[str, Any], Any]:
        """What a disk snapshot of this step writes (no collective): the strategy's state (DCP's
        part), the rest (rank 0's, in ``values.pt``), and this rank's own random streams, in a file
        of its own. Gathered into rank 0's ``values.pt``, every rank would read every rank's streams
        (~20 kB each) on a load: a cost growing with the world, on every rank."""
        state = self.state_dict(streams=False)
        own = None
        if STREAMS in self.states:
            own = self.states[STREAMS].mine()  # type: ignore[attr-defined]
        return state.pop("strategy"), state, own

    def save(self, wait: bool = False) -> None:
        """Snapshot this step into ``run_dir/snapshots/step-N/`` (every rank writes its part). It
        returns once the state is copied to host memory (asynchronous writes), or written; ``wait``:
        once it is whole on disk."""
        # A pre-emption notice is answered by this position on disk, whole before training goes on.
        position, wait = self.train.position, wait or self.schedule.notice is not None
        fresh = self.schedule.new_position(position)
        self.schedule.written(position)
        if not fresh:
            return
        # Recorded before the state is taken: the records' end it holds (a resume rewinds the
        # records to it) is past this snapshot's own record.
        step = self.train.step
        event = {"event": "snapshot", "file": folder_name(step), "async": self.manager.async_write}
        self.log("event", step, event)
        sharded, extra, own = self.disk_parts()
        self.manager.save(step, sharded, extra, replicated=self.strategy.replicated, own=own)
        if wait:
            self.manager.wait()

    def _warn_precision_change(self, old: str, new: str) -> None:
        scaler = "fresh" if new == "fp16" else "dropped" if old == "fp16" else None
        note = {
            "fresh": "; fp16's GradScaler starts afresh at its initial scale",
            "dropped": "; the snapshot's fp16 GradScaler state is dropped",
            None: "",
        }[scaler]
        self.print0(
            f"ddpkit: WARNING: precision changed from {old} (the snapshot's) to {new} on "
            f"resume{note}. This run's steps are not those the snapshot's run would have taken: "
            "the bitwise-resume guarantee does not hold for this run"
        )
        self.log(
            "event",
            self.train.step,
            {
                "event": "precision_change",
                "from": old,
                "to": new,
                "scaler": scaler,
                "bitwise_resume": False,
            },
        )

    def wait(self) -> None:
        """Block until the snapshot being written in the background (if any) is whole on disk."""
        self.manager.wait()

    def resume(self, load: Callable[[dict[str, Any]], None]) -> bool:
        """Load the newest whole snapshot of the run, if any, through ``load`` (the Trainer's
        ``load_state_dict``); True if training resumes from one."""
        change: tuple[str, str] | None = None

        def precision(state: dict[str, Any]) -> None:
            nonlocal change
            change = self.record.precision_change(state["record"])
            # To fp16 from another precision: the snapshot has no GradScaler state; a fresh scaler
            # starts.
            self._fresh = (
                frozenset({"scaler"}) if change is not None and change[1] == "fp16" else frozenset()
            )

        got = restore(
            self.manager, self.memory, self.runtime, strategy_state=self.strategy.state_dict,
            check=lambda saved, folder: self.record.check(saved["record"], folder), load=load,
            warn=self.print0, prepare=precision,
        )  # fmt: skip
        if got is None:
            return False
        if got.disk:
            self.schedule.written(self.train.position)  # already on disk
        if change is not None:
            self._warn_precision_change(*change)
        return self._resumed(got.source, got.file)

    def _resumed(self, source: str, file: str) -> bool:
        rt = self.runtime
        self.resumed_from = self.train.step
        reseeded_from = getattr(self.states.get("rng"), "reseeded_from", None)
        if reseeded_from is not None:
            self.print0(
                f"ddpkit: resuming a {reseeded_from}-rank snapshot on {rt.world_size} ranks: same "
                "samples in the same steps; random streams (dropout, augmentation) are reseeded"
            )
        t = self.train
        self.print0(
            f"ddpkit: resumed from {source} (epoch {t.epoch}, step {t.step}, restart "
            f"{rt.restart_count})"
        )
        self.log(
            "event",
            t.step,
            {
                "event": "resume",
                "file": file,
                "epoch": t.epoch,
                "cursor": t.cursor,
                "restart_count": rt.restart_count,
                "world_size": rt.world_size,
                # records written after the snapshot, moved to metrics.rewound.jsonl
                "rewound_records": getattr(self.states.get("records"), "rewound", 0),
            },
        )
        return True


@dataclass(frozen=True)
class Resumed:
    """Where :func:`restore` resumed a run from."""

    source: str
    """The folder, or the copy in memory, as said to the user."""
    file: str
    """Its name, as recorded (the ``resume`` event's ``file``)."""
    disk: bool
    """Read from disk (the position is then on disk already), or from memory."""


def restore(
    manager: SnapshotManager,
    memory: MemorySnapshots | None,
    runtime: Runtime,
    *,
    strategy_state: Callable[[], dict[str, Any]],
    check: Callable[[dict[str, Any], str], None],
    load: Callable[[dict[str, Any]], None],
    warn: Callable[[str], None],
    prepare: Callable[[dict[str, Any]], None] | None = None,
) -> Resumed | None:
    """The one load of a run's snapshots, for the Trainer and for a hand-written loop
    (:class:`ddpkit.Snapshots`): the newest whole state every rank can take, the copy in memory when
    it is newer than the disk's newest whole snapshot, else that snapshot; None when there is none.
    Collective: every rank calls it.

    ``strategy_state()``: the model and optimizer's state of this run, the template DCP reshards the
    snapshot's into; ``check(saved, folder)`` refuses a snapshot of another run before any tensor is
    read; ``prepare(state)`` sees a disk snapshot's state before ``load(state)`` puts it into the
    run's parts. Each rank gets its own random streams back at the same world size, and every old
    rank's at another (:class:`RankStreams` reseeds).
    """
    if memory is not None:  # the copies in memory first, when newer than the disk's newest
        from ddpkit.snapshot._memory.resume import resume_from_memory

        source, found = resume_from_memory(memory, manager, warn, load)
        if source is not None:
            return Resumed(source, source, disk=False)
    else:
        found = manager.latest(warn=warn)
    if found is None:
        return None
    folder = str(found.path)
    sharded, extra = manager.load(
        found, strategy_state, map_location="cpu", check=lambda saved: check(saved, folder)
    )
    streams = extra["states"].get(STREAMS)
    if streams is not None:  # this rank's own file at the same world size; every rank's at another
        size, rank = streams["world_size"], runtime.rank
        wanted = [rank] if size == runtime.world_size else list(range(size))
        ranks: list[Any] = [None] * size
        for r, own in zip(wanted, manager.read_own(found, wanted, map_location="cpu")):
            ranks[r] = own
        streams["ranks"] = ranks
    state = extra | {"strategy": sharded}
    if prepare is not None:
        prepare(state)
    load(state)
    return Resumed(folder, found.path.name, disk=True)


def resumes(resume: bool, restart_count: int) -> bool:
    """Whether ``fit()`` resumes from the run's snapshots: when the config asks (``resume=True``),
    and always on a restart (``restart_count > 0``): ``resume=False`` means "this job starts
    afresh", which its first attempt did; a restarted worker that started afresh again would move
    its own job's snapshots aside."""
    return resume or restart_count > 0
