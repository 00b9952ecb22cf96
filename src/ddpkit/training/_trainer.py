"""The Trainer: DDP epochs with exact metrics, atomic snapshots, and resume that continues bit for
bit (docs/trainer.md). Built on the primitives a hand-written loop uses; the loop reads::

    for step in epoch_steps(...):       # each optimizer step's micro-batches
        taken = self.train_step(step)   # forward/backward on each, the optimizer step
        self._after_step(step, taken)   # log, agree, snapshot, stop?

Every ``logging.every_steps`` steps and at an epoch's end one small all-gather gives the exact mean
training loss and spreads a stop signal any rank received: all ranks save and stop after the same
step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import Dataset

from ddpkit._errors import PREEMPTED_EXIT_CODE, ConfigError, Preempted
from ddpkit.data import ShardedBatchSampler, build_loader
from ddpkit.distributed import Group
from ddpkit.distributed import _progress as marks
from ddpkit.distributed import _signals as signals
from ddpkit.distributed._collectives import all_reduce, broadcast_object
from ddpkit.distributed._progress import Phase
from ddpkit.distributed._runtime import get_runtime, print0
from ddpkit.distributed._seeding import seed_rank
from ddpkit.nn._dropout import convert_dropout
from ddpkit.snapshot import _run_dir as run_dir_lib
from ddpkit.snapshot._snapshots import Snapshots, resumes
from ddpkit.snapshot._state import TrainState
from ddpkit.strategies import Strategy, build_strategy
from ddpkit.tracking._metrics import MetricsWriter, Progress, format_metrics, run_summary
from ddpkit.training._config import TrainerConfig  # noqa: F401  (imported from here by scripts)
from ddpkit.training._evaluation import BatchLoss, BatchLossFn, LossFn
from ddpkit.training._several import NO_METRIC_FN, StepFn, several_models, step_fn_body
from ddpkit.training._step import (
    CountFn,
    EpochLoss,
    Models,
    Step,
    StepOutput,
    StopReason,
    TrainStep,
    epoch_steps,
)
from ddpkit.training._validation import Validation, check_metric_driven, metric_driven

# The Trainer calls a callback's hooks on every rank, in order, between its own collectives: a
# callback may make collectives of its own if it makes the same ones on every rank.


class Callback:
    """The hooks the Trainer calls. Subclass and override the ones you need (all do nothing
    here)."""

    def on_fit_start(self, trainer: Any) -> None:
        """After a resume (or a fresh start), before the first step."""

    def on_step_end(self, trainer: Any, taken: bool, output: StepOutput) -> None:
        """After each optimizer step; ``taken`` is False for a step skipped for non-finite
        gradients. ``output`` (:class:`~ddpkit.training._step.StepOutput`): this rank's loss,
        the lr and the gradient norm of the step. The model's gradients are still the step's
        (synchronised; unscaled and clipped where the step did so); the next step sets them to None
        before its first forward, so a callback may backpropagate through the model (a GAN's
        generator step through its discriminator) without changing the next step."""

    def on_validation_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        """After each validation, once it is recorded and counted (early stopping, the best
        weights): at an epoch's end (before ``on_epoch_end``), every
        ``TrainerConfig.val_every_steps`` steps (before that step's snapshot), or where
        ``max_steps`` stopped the run inside an epoch. ``metrics``: the ``val/...`` metrics, with
        ``epoch`` (epochs completed) and ``step``."""

    def on_epoch_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        """After an epoch's validation and records, before its snapshots (which hold what the
        callback changed). Setting ``trainer.stopped_by`` (a string) ends training after this
        epoch; raising ends it at once, on every rank that raises."""

    def on_fit_end(self, trainer: Any) -> None:
        """When training ends without an error: epochs done, max_steps, early stopping, or a stop
        signal (then just before ``fit()`` raises :class:`~ddpkit.Preempted`)."""


def call(callbacks: Sequence[Any], hook: str, *args: Any) -> None:
    """Call ``hook`` on each callback that has it, in order."""
    for cb in callbacks:
        method = getattr(cb, hook, None)
        if method is not None:
            method(*args)


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def own_parts(
    window: Any, callbacks: Sequence[Any], extra_state: Mapping[str, Any] | None
) -> dict[str, Any]:
    """What each rank keeps its own of in a snapshot: its unagreed losses (``window``), the
    callbacks that have a ``state_dict``/``load_state_dict`` (under their ``state_key`` attribute,
    or their class name), and the script's ``extra_state``."""
    parts: dict[str, Any] = {"loss_window": window}
    for cb in callbacks:
        if _stateful(cb):
            key = f"callback:{getattr(cb, 'state_key', None) or type(cb).__qualname__}"
            if key in parts:
                raise ConfigError(
                    f"two callbacks keep their state under {key!r}: give each a distinct "
                    "`state_key` attribute"
                )
            parts[key] = cb
    for name, obj in (extra_state or {}).items():
        if not _stateful(obj):
            raise ConfigError(
                f"extra_state[{name!r}] is a {type(obj).__name__}, which has no state_dict() and "
                "load_state_dict(): give an object with both (e.g. a small class around the value)"
            )
        parts[f"extra:{name}"] = obj
    return parts


def build_models(
    config: TrainerConfig,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    runtime: Any,
    val_data: Any,
    *,
    step_fn: StepFn | None,
    loss_fn: LossFn | None,
    batch_loss_fn: BatchLossFn | None,
    metric_fn: Any,
    count_fn: CountFn | None,
) -> Models:
    """What a Trainer trains: one model and optimizer spread over the ranks as ``config.strategy``
    says, with its loss (:class:`~ddpkit.training._evaluation.BatchLoss`); or, with a ``step_fn``,
    several by name (:func:`several_models`), whose step computes the losses (``loss_fn``,
    ``batch_loss_fn`` and ``count_fn`` are refused by name)."""
    if step_fn is not None:
        refused = {
            "loss_fn": loss_fn, "batch_loss_fn": batch_loss_fn, "count_fn": count_fn,
            "compile": config.compile, "snapshot memory": config.snapshot.memory,
        }  # fmt: skip
        several, schedulers, record, metrics = several_models(
            config, model, optimizer, scheduler, runtime, refused, val_data, metric_fn
        )
        named = schedulers.schedulers if schedulers else {}
        return Models(
            several, several.views, several.outside, BatchLoss(None, None, metrics), metrics,
            step_fn_body(step_fn), schedulers,
            stepped={name: s for name, s in named.items() if not metric_driven(s)},
            plateau=schedulers if schedulers and schedulers.metric_driven else None,
            record=record,
        )  # fmt: skip
    if metric_driven(scheduler):  # stepped at each validation, with its metric
        check_metric_driven(config, scheduler, val_data)
    if config.global_batch_dropout:
        convert_dropout(model)
    # the lr as asked, before any scheduler step
    record = run_dir_lib.RunRecord.of(config, optimizer, model)
    # zero and fsdp rebuild the optimizer over what they shard (the scheduler follows)
    strategy = build_strategy(
        config.strategy, model, optimizer, runtime=runtime, sync_batchnorm=config.sync_batchnorm,
        scheduler=scheduler,
    )  # fmt: skip
    plateau = scheduler if metric_driven(scheduler) else None
    batch_loss = BatchLoss(loss_fn, batch_loss_fn, metric_fn, count_fn)
    return Models(
        strategy, {"": strategy}, {}, batch_loss, batch_loss.metrics, None, scheduler,
        stepped={} if scheduler is None or plateau else {"": scheduler}, plateau=plateau,
        record=record,
    )  # fmt: skip


class Trainer:
    """DDP training of ``model`` with ``optimizer`` on ``train_data``; see :class:`TrainerConfig`.

    ``loss_fn``, ``batch_loss_fn``, ``metric_fn`` and ``count_fn`` (per-token losses): see
    :class:`.BatchLoss`.

    ``group`` (a group of :func:`~ddpkit.split_world`, or a process group) is the ranks that train
    this model together; rank, world size, sharding, metrics, snapshots and records all count within
    it. ``callbacks`` are objects with some of :class:`Callback`'s
    methods.

    ``step_fn`` (with ``model`` and ``optimizer`` dicts by name, ``scheduler`` one by optimizer
    name): a step of several models and optimizers written as one function (a GAN, distillation);
    ``metric_fn(models, batch)`` then gets the models by name. See :mod:`ddpkit.training._several`.

    ``scheduler``: an LR scheduler, stepped every epoch or step (``scheduler_interval``); a
    metric-driven one (``ReduceLROnPlateau``) is stepped at each validation instead, with
    ``early_stopping.metric``'s value.

    Snapshots hold, besides the Trainer's own state, each rank's own state of every callback that
    has ``state_dict()`` / ``load_state_dict()`` (under its ``state_key`` attribute, or its class
    name) and of each object of ``extra_state`` (a name -> object with those two methods: a hidden
    state the script carries from step to step, a counter): every rank saves its own and gets its
    own back on resume, tensors on the CPU.
    """

    config: TrainerConfig
    strategy: Strategy
    model: nn.Module  # inside DDP (or fsdp's wrapping) when there is a process group
    optimizer: torch.optim.Optimizer
    state: TrainState  # epoch, step, cursor, skipped steps
    epoch_loss: EpochLoss  # the loss the ranks agreed on in this epoch
    stopped_by: StopReason | str | None = None
    _stop_signal = 0  # the stop signal this rank received, which the next agreement spreads
    _last_taken = False  # whether the epoch's last step was taken (a step's snapshot may be due)

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_data: Dataset,
        config: TrainerConfig,
        *,
        val_data: Dataset | None = None,
        scheduler: Any = None,
        loss_fn: LossFn | None = None,
        batch_loss_fn: BatchLossFn | None = None,
        metric_fn: Callable[[Any, Any], Mapping[str, Any]] | None = None,
        count_fn: CountFn | None = None,
        group: Group = None,
        callbacks: Sequence[Any] = (),
        extra_state: Mapping[str, Any] | None = None,
        step_fn: StepFn | None = None,
    ) -> None:
        in_use = run_dir_lib.refuse_shared(config.run_dir, config.phase)
        # rank, world size and "main" count in this group (the job, or one of split_world())
        self.config, self.runtime = config, get_runtime(group, member=True)
        rt = self.runtime
        self.group, self.callbacks, self.step_fn = rt.group, list(callbacks), step_fn
        models = build_models(
            config, model, optimizer, scheduler, rt, val_data, step_fn=step_fn, loss_fn=loss_fn,
            batch_loss_fn=batch_loss_fn, metric_fn=metric_fn, count_fn=count_fn,
        )  # fmt: skip
        self.strategy, self.scheduler = models.strategy, models.scheduler
        self.model, self.optimizer = self.strategy.model, self.strategy.optimizer
        seed_rank(config.seed, rt.rank)  # the models are identical now: each rank its own streams
        self.loader = build_loader(train_data, group=rt.group, **config.loader_args(rt.world_size))
        self.sampler = cast(ShardedBatchSampler, self.loader.batch_sampler)  # build_loader's
        self.state, self.epoch_loss, self.run_dir = TrainState(), EpochLoss(), config.phase_dir
        self.writer = MetricsWriter(
            self.run_dir, enabled=rt.is_main, tensorboard=config.logging.tensorboard,
            loggers=config.logging.trackers, params=config.to_json(),
        )  # fmt: skip
        self.train_step = TrainStep(
            config, models, runtime=rt, state=self.state, sampler=self.sampler, log=self.writer.log
        )
        self.validation = Validation(
            config, rt, val_data, strategy=self.strategy, metrics=models.metrics,
            autocast=self.train_step.autocast, log=self.writer.log, plateau=models.plateau,
        )  # fmt: skip
        states = {
            "train": self.state, "data": self.loader, "epoch_loss": self.epoch_loss,
            "early_stopping": self.validation.early_stopping, "validation": self.validation,
            "scheduler": self.scheduler, "scaler": self.scaler, "records": self.writer,
        }  # fmt: skip
        self.snapshots = Snapshots.of_trainer(
            self.run_dir, config.snapshot, runtime=rt, strategy=self.strategy, states=states,
            own=own_parts(self.train_step.window, self.callbacks, extra_state), seed=config.seed,
            generator=self.loader.generator, new_rank_state=config.new_rank_state,
            record=models.record, global_micro_batch=self.sampler.global_batch_size,
            log=self.writer.log,
        )  # fmt: skip
        self.memory = self.snapshots.memory  # copies in shared memory after steps (None: off)
        self._notice = signals.preemption_notice(rt.launcher, self.group)  # Ray's, of a node's loss
        run_dir_lib.TRAINERS[self] = in_use

    # The counters, as the state holds them.
    epoch = property(lambda self: self.state.epoch, lambda self, v: setattr(self.state, "epoch", v))
    step = property(lambda self: self.state.step, lambda self, v: setattr(self.state, "step", v))
    cursor = property(
        lambda self: self.state.cursor, lambda self, v: setattr(self.state, "cursor", v)
    )
    skipped_steps = property(lambda self: self.state.skipped_steps)
    resumed_from = property(lambda self: self.snapshots.resumed_from)
    # What the Trainer's parts own, under the Trainer's names.
    scaler = property(lambda self: self.train_step.scaler)  # fp16's GradScaler, else None
    speed = property(lambda self: self.train_step.observe.speed)
    early_stopping = property(lambda self: self.validation.early_stopping)
    best_weights = property(lambda self: self.validation.best_weights)
    val_data = property(lambda self: self.validation.val_data)

    def state_dict(self) -> dict[str, Any]:
        """Everything the next step needs (collective); see
        :meth:`~ddpkit.Snapshots.state_dict`."""
        return self.snapshots.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (collective: the best so far is read on rank 0 and
        shared). With ``on_data_change="restart_epoch"`` and changed data, the epoch starts again,
        its loss counted afresh (what was agreed belongs to the old data's order)."""
        self.snapshots.load_state_dict(state)
        if self.loader.data_changes:
            self.cursor = 0
            self.epoch_loss.reset()
            self.train_step.window.clear()
        self.validation.resume(self.group)

    def save(self) -> None:
        """Snapshot this step (every rank must call it); with a stop decided, wait until it is whole
        on disk."""
        with marks.phase(Phase.SNAPSHOT):
            self.snapshots.save(wait=self.stopped_by is not None)

    def wait_for_snapshot(self) -> None:
        """Block until the snapshot being written in the background (if any) is whole on disk."""
        with marks.phase(Phase.SNAPSHOT):
            self.snapshots.wait()

    def fit(self) -> dict[str, float]:
        """Train until ``epochs`` (or ``max_steps``, early stopping, or a stop signal); return the
        last epoch's metrics, with the latest validation's under ``val_every_steps``.

        ``run_dir`` is locked for the duration (a second job on it is refused, naming this one;
        with a ``phase``, until the process ends). A stop signal raises :class:`~ddpkit.Preempted`
        once the snapshot is saved, unless ``raise_on_stop_signal=False``. A run that finished,
        resumed, trains nothing: its final state is restored, and its last epoch's metrics returned.
        """
        self._resuming = resumes(self.config.resume, self.runtime.restart_count)
        lock = run_dir_lib.claim(
            self.run_dir, is_main=self.runtime.is_main, fresh=not self._resuming, group=self.group,
            root=self.config.run_dir if self.config.phase else None,
        )  # fmt: skip
        try:
            last = self._fit()
        finally:
            if lock is not None:
                lock.release()
        if self.stopped_by != StopReason.SIGNAL:
            speed = self.speed.run.summary()  # the slowest rank over the run
            summary = run_summary(
                str(self.stopped_by), self.state, last, self.validation, self.run_dir, speed
            )
            print0(summary, group=self.group)
            signals.pass_on(self._stop_signal)  # one that came after the last agreement
        elif self.config.raise_on_stop_signal:
            preempted = Preempted.by(self._stop_signal, self.step)
            print0(
                f"ddpkit: {preempted}; raising ddpkit.Preempted (exit code {PREEMPTED_EXIT_CODE}: "
                "pre-empted, resume me)",
                group=self.group,
            )
            raise preempted
        return last

    def _fit(self) -> dict[str, float]:
        cfg, rt = self.config, self.runtime
        if self._resuming:
            self.snapshots.resume(self.load_state_dict)
        if self.resumed_from is None:
            self.writer.log(
                "event", self.step, {"event": "start", "restart_count": rt.restart_count}
            )
        with self._run_dir_write(self.run_dir / "config.json"):
            run_dir_lib.write_resolved_config(self.run_dir, cfg, rt, self.sampler.batch_size)
        call(self.callbacks, "on_fit_start", self)
        # A finished run, resumed: nothing left to train.
        if self.early_stopping.should_stop:
            self.stopped_by = StopReason.EARLY_STOPPING
        if cfg.max_steps is not None and self.step >= cfg.max_steps:
            self.stopped_by = StopReason.MAX_STEPS
        finished = self.resumed_from is not None and (
            self.stopped_by is not None or self.epoch >= cfg.epochs
        )
        # its final state restored (above): its final metrics are the records'
        last = broadcast_object(self.writer.last_epoch(), group=self.group) if finished else {}
        try:
            with signals.stop_signals(self._on_stop_signal):
                while self.epoch < cfg.epochs and self.stopped_by is None:
                    if not self._train_epoch():
                        stopped_inside = self.stopped_by == StopReason.MAX_STEPS
                        if stopped_inside and (
                            val := self.validation.inside_epoch(self.epoch, self.step)
                        ):
                            last = val  # else `last` stays the last epoch's metrics
                            call(self.callbacks, "on_validation_end", self, last)
                        break
                    last = self._end_epoch()
            if self.stopped_by is None:
                self.stopped_by = StopReason.EPOCHS
        except BaseException as err:
            # the launcher's failure summary shows the traceback's end, notes included (3.11+)
            if hasattr(err, "add_note"):
                err.add_note(
                    f"ddpkit: rank {rt.rank} failed in epoch {self.epoch}, at optimizer step "
                    f"{self.step}"
                )
            raise
        # with val_every_steps: the latest validation (at epoch ends: in `last`)
        last |= self.validation.latest
        if self.snapshots.schedule.at_stop(self.stopped_by):
            self.save()  # (a no-op after an epoch end's snapshot of the same step)
        with self._run_dir_write(self.run_dir / "final weights"):
            self.validation.save_final_weights(self.epoch, self.step, self.stopped_by)
        self.wait_for_snapshot()  # the run's last snapshot is whole before fit() returns
        done = {"resumed_finished": True} if finished else {}
        self.writer.log(
            "event", self.step, {"event": "stop", "reason": str(self.stopped_by), **done}
        )
        self.writer.flush()
        self._stop_on_fault(one_more=True)  # a write since the last agreement
        call(self.callbacks, "on_fit_end", self)
        self.snapshots.close(finished=True)  # what a restart needs from here on is on disk
        return last

    def _train_epoch(self) -> bool:
        """Train on the rest of the current epoch; False when training must stop before its end."""
        cfg, rt = self.config, self.runtime
        accum = cfg.grad_accum_steps
        self.sampler.set_position(self.epoch, self.cursor)
        first = self.sampler._first_step()  # none left at a cursor past a partial last batch
        progress = Progress(
            rt.is_main and cfg.logging.progress,
            total=-(-self.sampler.steps_per_epoch // accum),
            desc=f"epoch {self.epoch + 1}/{cfg.epochs}",
            initial=first // accum,
        )
        # The window carries on: empty after the last epoch's agreement, or as a snapshot left it.
        self._window_start = self._epoch_start = time.perf_counter()
        # on the CPU, batches are already where they belong
        device = None if rt.device.type == "cpu" else rt.device
        try:
            for step in epoch_steps(
                self.loader, self.sampler, accum, first, device, self.train_step.observe
            ):
                taken = self.train_step(step)  # ddpkit.training._step
                self.state.cursor = step.cursor
                if not self._after_step(step, taken, progress):
                    return False
            return True
        finally:
            progress.close()

    def _after_step(self, step: Step, taken: bool, progress: Progress) -> bool:
        """After a step: callbacks, validation, the agreement and its record, then its snapshots;
        False to stop mid-epoch. Every rank reaches the same decisions here: steps are taken or
        skipped everywhere alike."""
        cfg, count = self.config, self.state.step
        if self.callbacks:
            output = self.train_step.output(taken)
            call(self.callbacks, "on_step_end", self, output.taken, output)
            count = self.state.step  # a callback may move it
        if cfg.max_steps is not None and count >= cfg.max_steps:
            self.stopped_by = StopReason.MAX_STEPS
        # before the step's snapshot, whose early-stopping state then counts this validation
        if self.validation.due(count, taken):
            # left out of the window's wall time, its time in a record of its own
            with self.speed.aside() as took, self._run_dir_write(self.best_weights.path):
                self.validation.after_step(self.epoch, count)
            val = {"epoch": self.epoch, "step": count, **self.validation.latest}
            self.writer.log(
                "event", count, {"event": "validation", "seconds": round(took.seconds, 3)}
            )
            call(self.callbacks, "on_validation_end", self, val)
            if self.early_stopping.should_stop:
                self.stopped_by = StopReason.EARLY_STOPPING
            count = self.state.step
        postfix = None
        if (
            step.last_in_epoch
            or self.stopped_by
            or (taken and count % cfg.logging.every_steps == 0)
        ):
            postfix = self._log_window()
        progress.update(postfix)
        if self.stopped_by is not None and not step.last_in_epoch:
            return False
        self._last_taken = taken
        if step.last_in_epoch:  # its snapshots come once the epoch's end is done (_end_epoch)
            return True
        self._snapshot(count, taken, self.snapshots.schedule.after_step(count, taken, False))
        return True

    def _snapshot(self, count: int, taken: bool, disk: bool, *, in_window: bool = True) -> None:
        """The snapshots due where the run stands now, once everything of the step (or of the
        epoch's end) is done: a copy is a state an uninterrupted run passes through. ``in_window``:
        timed as the log window's (not at an epoch's end, whose window is recorded)."""
        memory = self.snapshots.in_memory_due(count, taken)
        if disk or memory:
            with self.train_step.observe.snapshot(in_window):
                if disk:
                    self.save()
                if memory:
                    self.snapshots.save_in_memory()

    def _log_window(self) -> dict[str, Any]:
        """Agree on the mean training loss since the last agreement, record it, and start a new
        window."""
        window = self.train_step.window
        # a barrier under Ray: every rank asks here
        if self._notice is not None and (notice := self._notice()):
            # one snapshot for a notice, at this step (the schedule's), then training goes on
            self._notice = None
            self.snapshots.schedule.notice = notice
            self.writer.log("event", self.step, {"event": "preemption_notice", "notice": notice})
        # The window ends here, before the agreement (the wait for the slowest rank is the next
        # window's); on a GPU once the device has done its work.
        if self.runtime.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        end = time.perf_counter()
        wall = self.speed.window_seconds(self._window_start, end)  # less a validation's time
        tokens = self.train_step.batch_loss.count_fn is not None
        # Every rank's phases travel in the agreement's one collective, at window ends only.
        row = self.speed.row(wall, float(sum(window.sizes)) if tokens else None)
        agreed = window.agree(
            self.runtime.device, bool(self._stop_signal), self.group, row, fault=self._fault()
        )
        if agreed.fault:
            self._stop_on_fault()
        self.epoch_loss.add(agreed)
        if agreed.stop and self.stopped_by is None:
            self.stopped_by = StopReason.SIGNAL
        ms = 1000 * wall / max(window.tried, 1)
        times = self.speed.times(agreed.rows, wall, window.tried)
        rates = self.speed.rates(times, tokens) if times is not None else {}
        if window.steps:
            record = {
                "epoch": self.epoch,
                "train/loss": agreed.mean,
                "lr": self._lr(),
                "ms_per_step": round(ms, 3),
            }
            # several models'
            record |= {f"train/loss_{name}": mean for name, mean in agreed.means.items()}
            if self.train_step.optimizer_step.grad_norm is not None:
                # of the last step taken, before clipping
                record["grad_norm"] = float(self.train_step.optimizer_step.grad_norm)
            self.writer.log("train", self.step, record | rates)
        if times is not None and window.tried:
            self.writer.log("ranks", self.step, times.record())
        window.clear()
        self._window_start = end
        postfix: dict[str, Any] = {"loss": agreed.mean, "ms/step": ms}
        postfix |= {k.replace("_per_s", "/s"): v for k, v in rates.items()}
        if times is not None and (slowest := times.slowest()).slow:
            postfix["slow"] = slowest.text()
        return postfix

    def _end_epoch(self) -> dict[str, float]:
        cfg = self.config
        # resumed from a copy taken after the epoch's last step, before its agreement
        if self.train_step.window.tried:
            self._log_window()
        self.state.epoch += 1
        self.state.cursor = 0
        # (several models': those of them that need no metric)
        epochly = cfg.scheduler_interval == "epoch" and not metric_driven(self.scheduler)
        if self.scheduler is not None and epochly:
            self.scheduler.step()
        metrics: dict[str, float] = {"epoch": self.epoch, "step": self.step, "lr": self._lr()}
        # the mean over all the epoch's steps (a snapshot holds the sums so far)
        metrics["train/epoch_loss"] = self.epoch_loss.mean
        self.epoch_loss.reset()
        evaluate = self.validation.evaluate if self.validation.at_epoch_end else None
        if evaluate is not None:
            metrics |= evaluate()
        seconds = round(time.perf_counter() - self._epoch_start, 3)  # training and validation
        if self.validation.at_epoch_end:
            with self._run_dir_write(self.best_weights.path):
                self.validation.update(metrics, self.epoch, self.step)
            if self.early_stopping.should_stop:
                self.stopped_by = StopReason.EARLY_STOPPING
        # the records and callbacks get the epoch's time too; fit() returns the metrics alone
        timed = metrics | {"epoch_seconds": seconds}
        self.writer.epoch_end(self.step, timed)
        print0(format_metrics(timed), group=self.group)
        if evaluate is not None:  # once recorded and counted
            val = {
                k: v for k, v in metrics.items() if k.startswith("val/") or k in ("epoch", "step")
            }
            call(self.callbacks, "on_validation_end", self, val)
        call(self.callbacks, "on_epoch_end", self, timed)
        # The epoch's end is whole: its snapshots hold it (a callback's changes and stop included).
        disk = self.snapshots.schedule.at_epoch_end(
            self.epoch, self.step, self._last_taken, self.stopped_by is not None
        )
        self._snapshot(self.step, self._last_taken, disk, in_window=False)
        return metrics

    def evaluate(self, data: Dataset, prefix: str = "test") -> dict[str, float]:
        """Exact metrics over every sample of ``data`` (each counted once), named
        ``prefix/metric``."""
        if self.validation.evaluator is None:  # several models without a metric_fn
            raise ConfigError(f"trainer.evaluate() with step_fn needs a metric_fn: {NO_METRIC_FN}")
        out = self.validation.evaluator(data, prefix)
        if prefix != "val":
            self.writer.log(prefix, self.step, out)
        return out

    def _on_stop_signal(self, signum: int) -> None:
        # only a flag: the next agreement spreads it, so every rank stops after the same step
        self._stop_signal = signum

    @contextmanager
    def _run_dir_write(self, path: Path) -> Iterator[None]:
        """A write of the run directory that only the main rank makes: failed (a full disk), it is
        kept for the ranks' next agreement, which stops every rank (:meth:`_stop_on_fault`)."""
        try:
            yield
        except OSError as err:
            if not self.runtime.is_main:
                raise
            self.writer.record_fault(Path(err.filename or path), err)

    def _stop_on_fault(self, one_more: bool = False) -> None:
        """Raise on every rank when a write of the run directory failed on the main rank, naming
        the file, the reason and where a restart resumes from (collective: every rank calls it;
        ``one_more``: the ranks first agree on it, past their last agreement)."""
        group = self.group
        if one_more and not all_reduce(float(self._fault()), op="max", group=group):
            return
        path, errno, reason = broadcast_object(self.writer.fault, group=group) or ("?", 0, "")
        done = self.snapshots.schedule.saved_at
        where = (
            f"the snapshot of step {done[1]} (or a newer copy in memory)"
            if done is not None
            else "the newest snapshot on disk or in memory, or the start"
        )
        raise OSError(
            errno,
            f"ddpkit: cannot write {path} ({reason}): every rank stops at step {self.step}; free "
            f"room there, and a restart resumes from {where}",
        )

    def _fault(self) -> int:
        """The errno of this rank's failed write of the run directory (0: none)."""
        return self.writer.fault[1] or 1 if self.writer.fault else 0

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
