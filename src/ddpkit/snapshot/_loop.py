"""Snapshots for a hand-written loop: what the Trainer saves, in one object a script builds next to
its loop.

::

    snapshots = ddpkit.Snapshots("runs/x", model=model, optimizer=opt,
                                 scheduler=sched, loader=loader, every_steps=100)
    snapshots.resume()  # the newest whole snapshot, if any: every part restored
    for epoch in range(loader.epoch, epochs):  # the epoch the snapshot was in
        # the index of the batch in its epoch: not 0 after a resume
        for i, (x, y) in enumerate(loader, start=loader.batch_in_epoch):
            ...  # forward, backward, opt.step()
            snapshots.step()  # counts the step; saves when due, stops at a signal
        ...  # the epoch's end: an epoch scheduler's step, an evaluation
    snapshots.close()  # the last write whole; the signal handlers put back

A snapshot is ``run_dir/snapshots/step-N/`` written by
:class:`~ddpkit.snapshot._manager.SnapshotManager`, as the Trainer's are (DCP, the marker written
last, ``keep`` whole snapshots kept): the model(s) and optimizer(s) through
:mod:`torch.distributed.checkpoint`, named by parameter at every world size, so a load reshards;
each rank's own buffers (BatchNorm statistics) under its own name; the schedulers, the loader's
position (its ``state_dict``: epoch and global sample cursor, with the data's fingerprint), the step
count and the ``extra`` objects (rank 0's: the same on every rank) in ``values.pt``; and every
rank's own state in a file of its own: its random streams (python, numpy, torch CPU and CUDA, the
loader's generator; :class:`~ddpkit.snapshot._state.RankStreams`) and the ``own`` objects.

At the same world size every rank gets its own streams and buffers back, and the run goes on bit for
bit. At another (the same global batch: per-rank batch x ranks), the loader's global cursor gives
the same samples in the same steps, every rank takes rank 0's buffers, and the streams are reseeded
from ``(seed, step, rank)``: the run then matches the uninterrupted one within tolerance.

Hazards this answers:

- A save due at an epoch's last batch is taken after the next step instead (:meth:`Snapshots.step`):
  taken there, it would hold the next epoch's first position while the code after the inner loop (an
  epoch scheduler's step, an evaluation that decides something) had not run, and a resume would skip
  it.
- SIGTERM and SIGUSR1 are only noted while the object is open; the ranks agree on them every
  ``signals_every_steps`` steps (one small all-reduce), and every rank then saves after the same
  step and raises :class:`~ddpkit.Preempted` (exit code 75: pre-empted, run me again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ddpkit._errors import ConfigError, Preempted
from ddpkit.data._epoch_loader import EpochLoader
from ddpkit.data._fingerprint import refusal
from ddpkit.distributed import _signals as signals
from ddpkit.distributed._collectives import all_reduce
from ddpkit.distributed._log import print0
from ddpkit.distributed._runtime import Runtime, get_runtime
from ddpkit.snapshot._manager import SnapshotManager
from ddpkit.snapshot._schedule import SnapshotSchedule
from ddpkit.snapshot._state import NewRankState, RankStreams, TrainState
from ddpkit.snapshot._trainer import STREAMS, restore
from ddpkit.strategies._prepare import LoopModel, unwrap

if TYPE_CHECKING:  # the memory backend is imported when a loop asks for it (memory=True)
    from ddpkit.snapshot._memory.snapshots import MemorySnapshots


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


def _named(items: list[Any], name: str) -> dict[str, Any]:
    return {name: items[0]} if len(items) == 1 else {f"{name}.{i}": x for i, x in enumerate(items)}


class Snapshots:
    """Saves and resumes a hand-written loop; see the module docstring. Every rank builds it and
    calls every method after the same steps (saving and resuming are collectives)."""

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
        signals_every_steps: int = 20,
        seed: int | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        """``model``: a :func:`~ddpkit.prepare_model` result (or the bare module), several by name
        (``{"G": netG, "D": netD}``), or a strategy of :func:`~ddpkit.strategies.build_strategy`
        (``zero``, ``fsdp``: its optimizer comes with it). ``optimizer``, ``scheduler``: one or a
        list. ``loader``: a :func:`~ddpkit.build_loader` loader. ``extra``: objects with
        ``state_dict()``/``load_state_dict()`` that are the same on every rank (a GradScaler, an
        EMA): rank 0's is saved and every rank loads it. ``own``: such objects each rank keeps its
        own of (a rank's metric sums): at another world size rank ``r`` takes old rank ``r``'s, and
        a rank beyond the old world what ``new_rank_state`` says (refused, rank 0's ``"copy"``, or
        ``"fresh"`` with a warning: as ``TrainerConfig.new_rank_state``). ``every_steps``: a
        snapshot every this many :meth:`step` calls (None: only :meth:`save` and stop signals);
        ``keep``, ``async_write``, ``memory``, ``memory_every_steps``: as
        :class:`~ddpkit.SnapshotConfig`'s (``memory``: a copy in shared memory after steps, under
        ``ddpkit run``, which :meth:`resume` takes when it is newer than the disk's).
        ``signals_every_steps``: how often the ranks agree on a stop signal (one all-reduce of one
        number, as the Trainer's ``LoggingConfig.every_steps``; on a GPU it also waits for the
        device). ``seed``: what the streams are reseeded from at another world size (default: the
        loader's seed, else 0)."""
        checked = (
            ("every_steps", every_steps, 1),
            ("keep", keep, 1),
            ("memory_every_steps", memory_every_steps, 1),
        )
        for name, value, low in checked:
            if value is not None and value < low:
                raise ConfigError(f"Snapshots({name}={value}): give {name} >= {low}")
        if signals_every_steps < 1:
            raise ConfigError(
                f"Snapshots(signals_every_steps={signals_every_steps}): give a value >= 1"
            )
        if loader is not None and not isinstance(loader, EpochLoader):
            raise ConfigError(
                "Snapshots(loader=...) takes a ddpkit.build_loader loader, not "
                f"{type(loader).__name__}: its position (epoch and global sample cursor) is what a "
                "resume continues from"
            )
        self.runtime = rt = runtime or get_runtime()
        optimizers = _listed(optimizer, "optimizer")
        if isinstance(model, (nn.Module, Mapping)):
            models = {"": model} if isinstance(model, nn.Module) else dict(model)
            self.model: Any = LoopModel(models, optimizers)
        elif callable(getattr(model, "state_dict", None)) and hasattr(model, "replicated"):
            if optimizers:
                raise ConfigError(
                    "Snapshots(model=strategy): the strategy's optimizer is saved with it; drop "
                    "optimizer="
                )
            self.model = model
        else:
            raise ConfigError(
                f"Snapshots(model={type(model).__name__}): give a module, a dict of them, or a "
                "strategy"
            )
        self.loader, self.every_steps, self.signals_every_steps = (
            loader,
            every_steps,
            signals_every_steps,
        )
        self.train = TrainState()
        generator = (
            loader.generator
            if loader is not None and loader.generator is not None
            else torch.Generator()
        )
        if seed is None:
            seed = getattr(loader.batch_sampler, "seed", 0) if loader is not None else 0
        self.streams = RankStreams(
            rt, generator, seed, self.train, own=_listed_map(own, "own"),
            new_rank_state=new_rank_state, warn=lambda line: print0(line, group=rt.group),
        )  # fmt: skip
        # "train" first: the streams' reseed at another world size reads the step.
        self.parts: dict[str, Any] = {"train": self.train}
        if loader is not None:
            self.parts["loader"] = loader
        self.parts |= _named(_listed(scheduler, "scheduler"), "scheduler")
        self.parts |= {f"extra.{k}": v for k, v in _listed_map(extra, "extra").items()}
        self.manager = SnapshotManager(
            Path(run_dir) / "snapshots", group=rt.group, keep_last=keep, async_write=async_write
        )
        self.resumed_from: int | None = None
        """The step of the snapshot :meth:`resume` restored, if any."""
        self._signal, self._stopping, self._deferred = 0, False, False
        # the position last written (or resumed from)
        self._saved_at: tuple[int, int, int] | None = None
        self.schedule = SnapshotSchedule(every_steps, 0, memory_every_steps or 1)
        self.memory: MemorySnapshots | None = None
        """The copies in shared memory (``memory=True``; None where the job has no memory
        folder)."""
        if memory:
            from ddpkit.snapshot._memory.snapshots import TrainerParts, open_memory_snapshots

            parts = TrainerParts(
                runtime=rt, run_dir=Path(run_dir), strategy=self.model, schedule=self.schedule,
                states={**self.parts, STREAMS: self.streams},
                record=_Record(self._record, self._check_record),
                global_micro_batch=(
                    getattr(loader.batch_sampler, "global_batch_size", 0) if loader else 0
                ),
                position=self._position, log=lambda kind, step, record: None,
            )  # fmt: skip
            self.memory = open_memory_snapshots(parts, memory_every_steps)
        self._signals = contextlib.ExitStack()
        self._signals.enter_context(signals.stop_signals(self._on_signal))

    @property
    def steps(self) -> int:
        """Optimizer steps taken (:meth:`step` calls), those before the snapshot resumed from
        included."""
        return self.train.step

    # -- saving ------------------------------------------------------------------------------------

    def step(self) -> bool:
        """Count one optimizer step; save when one is due: every ``every_steps``, or when any rank
        got a stop signal (then raise :class:`~ddpkit.Preempted` once the snapshot is whole). A save
        due at an epoch's last batch waits for the next call (see the module docstring). True if it
        saved."""
        self.train.step += 1
        step = self.train.step
        if step % self.signals_every_steps == 0 and not self._stopping:
            # One rank's signal reaches every rank here, after the same step: all save and stop
            # together.
            flag = float(self._signal > 0)
            self._stopping = bool(
                all_reduce(flag, op="max", group=self.runtime.group)
                if self.runtime.distributed
                else flag
            )
        finishing = self.loader is not None and self.loader.finishing_epoch
        if self.memory is not None and self.schedule.in_memory(step, True) and not finishing:
            # (at an epoch's last batch: the next step's copy, as a disk save is deferred)
            self.memory.save()
        due = (
            self._deferred
            or self._stopping
            or (self.every_steps is not None and step % self.every_steps == 0)
        )
        if not due:
            return False
        if finishing:
            self._deferred = True
            return False
        self._deferred = False
        self.save(wait=self._stopping)
        if self._stopping:
            self.close()
            preempted = Preempted.by(self._signal, step)
            print0(f"ddpkit: {preempted}; raising ddpkit.Preempted", group=self.runtime.group)
            raise preempted
        return True

    def save(self, wait: bool = False) -> None:
        """Snapshot the loop now (every rank). Returns once the state is copied to host memory (the
        write goes on in the background), or written; ``wait``: once it is whole on disk."""
        step, position = self.train.step, self._position()
        if self._saved_at == position:  # already on disk (a save at the loop's end, after step()'s)
            if wait:
                self.manager.wait()
            return
        extra = {
            "states": {name: part.state_dict() for name, part in self.parts.items()},
            "record": self._record(),
        }
        extra["states"][STREAMS] = {"world_size": self.runtime.world_size}
        self.manager.save(
            step,
            self.model.state_dict(),
            extra,
            replicated=self.model.replicated,
            own=self.streams.mine(),
        )
        self._saved_at = position
        if wait:
            self.manager.wait()

    def _position(self) -> tuple[int, int, int]:
        if self.loader is not None:
            self.train.epoch, self.train.cursor = self.loader.position()
        return self.train.position

    def wait(self) -> None:
        """Block until the snapshot being written in the background (if any) is whole on disk."""
        self.manager.wait()

    def close(self) -> None:
        """Take a save that was waiting for an epoch's end, wait for the last write, and put back
        the signal handlers that were in place before. A signal that came after the ranks' last
        agreement is passed on (SIGTERM's default then ends the process)."""
        if self._deferred:
            self._deferred = False
            self.save()
        self.manager.wait()
        # the slots stay until the job ends: a restart from here may still need them
        if self.memory is not None:
            self.memory.close(remove=False)
            self.memory = None
        self._signals.close()
        if not self._stopping and self._signal:
            sig, self._signal = self._signal, 0
            signals.pass_on(sig)

    def __enter__(self) -> Snapshots:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        # the epoch's end may have failed half-way: its position is not one to resume at
        if kind is not None:
            self._deferred = False
        self.close()

    def _on_signal(self, signum: int) -> None:
        self._signal = signum  # only a flag: the next agreement spreads it

    # -- resuming ----------------------------------------------------------------------------------

    def resume(self) -> int:
        """Restore every part from the newest whole snapshot of ``run_dir``, if any (every rank);
        return the step to continue from (0 when there is none). Refused, naming what differs,
        before any tensor is read, when the snapshot holds other parts, other model shapes, or the
        loader's data changed."""
        rt = self.runtime

        def warn(line: str) -> None:
            print0(line, group=rt.group)

        got = restore(
            self.manager, self.memory, rt, strategy_state=self.model.state_dict,
            check=lambda saved, folder: self._check(saved), load=self._load, warn=warn,
        )  # fmt: skip
        if got is None:
            return 0
        if got.disk:
            self._saved_at = self._position()
        return self._resumed(got.source)

    def _load(self, state: dict[str, Any]) -> None:
        """Put a snapshot's state (from disk or memory) into the parts: "train" first, then the
        streams."""
        self.model.load_state_dict(state["strategy"])
        for name, part in self.parts.items():
            part.load_state_dict(state["states"][name])
        self.streams.load_state_dict(state["states"][STREAMS])

    def _resumed(self, source: str) -> int:
        rt, size = self.runtime, self.streams.reseeded_from
        self.resumed_from = self.train.step
        if size is not None:
            print0(
                f"ddpkit: resuming a {size}-rank snapshot on {rt.world_size} ranks: same samples "
                "in the same steps; random streams (dropout, augmentation) are reseeded",
                group=rt.group,
            )
        where = (
            f"epoch {self.loader.epoch}, batch {self.loader.batch_in_epoch}, "
            if self.loader is not None
            else ""
        )
        print0(f"ddpkit: resumed from {source} ({where}step {self.train.step})", group=rt.group)
        return self.train.step

    def _record(self) -> dict[str, Any]:
        """What a resume checks before it reads a tensor: the parts, and the model's shapes."""
        from ddpkit.snapshot._run_record import tensor_shapes

        model = self.model.bare if isinstance(self.model, LoopModel) else unwrap(self.model.model)
        shapes = {k: [list(s), d] for k, (s, d) in tensor_shapes(model.state_dict()).items()}
        return {"parts": sorted(self.parts), "own": sorted(self.streams.own), "shapes": shapes}

    def _check(self, saved: dict[str, Any]) -> None:
        self._check_record(saved["record"])
        loader = self.loader
        if loader is not None and loader.on_data_change != "restart_epoch":
            state = saved["states"]["loader"]
            if changes := loader.changes_since(state):  # refused here, before the model is read
                raise refusal(changes, int(state["epoch"]), int(state["cursor"]))

    def _check_record(self, old: dict[str, Any]) -> None:
        new = self._record()
        problems = []
        for what in ("parts", "own"):
            if old[what] != new[what]:
                problems.append(f"{what} {old[what]} in the snapshot, {new[what]} here")
        changed = sorted(
            k
            for k in set(old["shapes"]) | set(new["shapes"])
            if old["shapes"].get(k) != new["shapes"].get(k)
        )
        if changed:
            problems.append(
                f"the model's {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} differ"
            )
        if problems:
            raise ConfigError(
                f"ddpkit: {self.manager.folder} holds another loop's snapshots: "
                f"{'; '.join(problems)}. Build Snapshots with the same parts and model, or give "
                "another run_dir"
            )


class _Record:
    """What the copies in memory check before a resume, as a Trainer's run record: the parts and
    shapes."""

    def __init__(
        self, state: Callable[[], dict[str, Any]], check: Callable[[dict[str, Any]], None]
    ) -> None:
        self.state, self.checked = state, check

    def state_dict(self) -> dict[str, Any]:
        return self.state()

    def check(self, saved: dict[str, Any], snapshot: str) -> None:
        self.checked(saved)


def _listed_map(value: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    items = dict(value or {})
    for name, item in items.items():
        _listed(item, f"{what}[{name!r}]")
    return items


__all__ = ["Snapshots"]
