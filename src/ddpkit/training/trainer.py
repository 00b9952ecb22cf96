"""The Trainer: DDP epochs with exact metrics, atomic snapshots, and resume that continues bit for bit.

Built on the same primitives a hand-written loop uses (:func:`~ddpkit.prepare_model`,
:class:`~ddpkit.ShardedBatchSampler`, :func:`~ddpkit.evaluate`, :mod:`ddpkit.snapshot`); nothing here is
needed to write a loop by hand.

One optimizer step, on every rank:

1. ``grad_accum_steps`` micro-batches; all but the last run under the strategy's ``no_sync()``, so gradients
   are synchronised once per step; each loss is divided by the number of micro-batches (gradients add up, and
   the step should follow the mean), and an epoch's last, smaller batch is weighed by each rank's share of its
   samples (:func:`~ddpkit.training.loss_window.loss_share`), so the step follows the mean over samples, not over ranks.
2. The strategy (:mod:`ddpkit.strategies`: ``ddp``, ``zero``, ``fsdp``) gives the verdict on the step, the
   same on every rank: if the synchronised gradients, and every rank's loss, are finite the step is taken
   everywhere, else it is skipped (or training stops) everywhere. Under ``ddp`` and ``zero`` no collective of
   ours runs in a normal step; under ``fsdp`` one all-reduce of two numbers covers every rank's shard.
3. Clipping (global norm, over all shards), ``optimizer.step()``, the scheduler (if stepped per step), a
   snapshot every N steps (:mod:`ddpkit.snapshot.manager`: each rank writes its part; asynchronously by default).
4. Every ``log_every_steps`` steps and at the end of an epoch, one small all-reduce gives the exact mean
   training loss since the last one, and spreads a SIGTERM/SIGUSR1 that any rank received, so that all ranks
   save and stop after the same step.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddpkit.data import ShardedBatchSampler, build_eval_loader, build_loader, to_device
from ddpkit.distributed import signals
from ddpkit.distributed.collectives import all_reduce, broadcast_object
from ddpkit.distributed.log import print0
from ddpkit.distributed.runtime import Runtime, get_runtime
from ddpkit.distributed.seeding import stream_seed
from ddpkit.errors import PREEMPTED_EXIT_CODE, ConfigError, Preempted
from ddpkit.nn.dropout import (
    BatchLayout,
    GlobalBatchDropout,
    batch_layout,
    convert_dropout,
)
from ddpkit.snapshot import run_dir as run_dir_lib
from ddpkit.snapshot.best import BestWeights
from ddpkit.snapshot.manager import SnapshotManager
from ddpkit.strategies import Strategy, build_strategy
from ddpkit.tracking.metrics import MetricsWriter
from ddpkit.tracking.progress import Progress, run_summary
from ddpkit.training import callbacks as callbacks_lib
from ddpkit.training.config import TrainerConfig
from ddpkit.training.evaluation import classification_metrics, evaluate
from ddpkit.training.loss_window import LossWindow, batch_len, loss_share
from ddpkit.training.losses import cross_entropy
from ddpkit.training.snapshots import TrainerSnapshots

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BatchLossFn = Callable[[nn.Module, Any], torch.Tensor]


class Trainer(TrainerSnapshots):
    """DDP training of ``model`` with ``optimizer`` on ``train_data``; see :class:`TrainerConfig`.

    The loss is ``loss_fn(model(inputs), targets)`` for ``(inputs, targets)`` batches (cross-entropy by
    default), or ``batch_loss_fn(model, batch)`` for any other batch. Validation reports the means of
    ``metric_fn(model, batch)``'s per-sample values (loss and accuracy for classification by default).

    ``group`` (a group of :func:`~ddpkit.split_world`, or a process group) is the ranks that train this model
    together; rank, world size, sharding, metrics, snapshots and records all count within it. ``callbacks``
    are objects with some of :class:`~ddpkit.training.callbacks.Callback`'s methods.
    """

    # What the Trainer holds, and what a snapshot restores:
    config: TrainerConfig
    runtime: Runtime
    model: nn.Module  # inside DDP when there is a process group
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler | None
    epoch: int  # epochs completed
    step: int  # optimizer steps taken
    cursor: int  # samples of the current epoch already trained on, over all ranks
    best: float | None  # best value of the early-stopping metric
    bad_epochs: int  # epochs since it improved
    skipped_steps: int  # steps skipped for a non-finite loss or non-finite gradients (not fp16 overflows)

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
        metric_fn: Callable[[nn.Module, Any], Mapping[str, Any]] | None = None,
        group: Any = None,
        callbacks: Sequence[Any] = (),
    ) -> None:
        if loss_fn is not None and batch_loss_fn is not None:
            raise ConfigError("pass loss_fn (for (inputs, targets) batches) or batch_loss_fn, not both")
        # Rank, world size and "main" count in this group: the whole job, or one group of split_world().
        self.config, self.runtime = config, get_runtime(group)
        if self.runtime.rank < 0:
            raise ConfigError(
                f"global rank {get_runtime().rank} is not a member of the group it was given: pass each rank its "
                "own group (split_world() returns it)"
            )
        rt = self.runtime
        self.group = rt.group
        self.callbacks = callbacks_lib.resolve(callbacks)
        if config.global_batch_dropout:
            convert_dropout(model)
        # The strategy wraps the model (and, for zero and fsdp, rebuilds the optimizer over what it shards,
        # pointing the scheduler at the new one).
        self.strategy: Strategy = build_strategy(
            config.strategy, model, optimizer, options=config.strategy_options, runtime=rt,
            sync_batchnorm=config.sync_batchnorm, scheduler=scheduler, ddp_kwargs=config.ddp_kwargs,
        )
        self.model = self.strategy.model
        # Scripts seed every rank alike so that models start identical; the strategy has now made them
        # identical, and with one seed everywhere ranks would also draw identical dropout masks and augmentations.
        torch.manual_seed(stream_seed("rank", config.seed, rt.rank))
        self.optimizer, self.scheduler = self.strategy.optimizer, scheduler
        self._global_dropout = any(isinstance(m, GlobalBatchDropout) for m in self.model.modules())
        self._grad_norm: torch.Tensor | None = None  # known when clipping
        self._on_cpu = rt.device.type == "cpu"
        self.scaler = torch.amp.GradScaler(rt.device.type) if config.precision == "fp16" else None
        self.loss_fn = loss_fn or cross_entropy
        self._hparams = run_dir_lib.optimizer_hparams(optimizer)  # as asked, before any scheduler step
        self.batch_loss_fn = batch_loss_fn
        self.metric_fn = metric_fn or (classification_metrics if loss_fn is None and batch_loss_fn is None else None)
        self.train_data, self.val_data = train_data, val_data
        self.loader = build_loader(
            train_data,
            config.per_rank_batch(rt.world_size),
            shuffle=config.shuffle,
            seed=config.seed,
            drop_last=config.drop_last,
            num_workers=config.num_workers,
            group=self.group,
        )
        # The sampler's position and the loader's generator are part of every snapshot.
        self.sampler: ShardedBatchSampler = self.loader.batch_sampler
        self.generator: torch.Generator = self.loader.generator
        self.epoch = self.step = self.cursor = self.bad_epochs = self.skipped_steps = 0
        self.best = None
        self.run_dir = Path(config.run_dir)
        self.writer = MetricsWriter(self.run_dir, enabled=rt.is_main, tensorboard=config.tensorboard,
                                    loggers=config.loggers, params=asdict(config))
        self.best_weights = BestWeights(self.run_dir / "best.pt", config.best_metric or config.early_stopping_metric,
                                        config.early_stopping_mode, enabled=rt.is_main)
        self._epoch_loss = [0.0, 0.0]  # agreed sum of loss x samples, and samples, in this epoch
        self._epoch_start = time.perf_counter()
        self._stop_signal = 0
        self._saved_at: tuple[int, int, int] | None = None
        self._snapshots = SnapshotManager(self.run_dir / "snapshots", group=self.group, keep_last=config.keep_snapshots,
                                       async_write=config.snapshot_async)
        self.stopped_by: str | None = None
        self.resumed_from: int | None = None

    # -- the loop -----------------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        """Train until ``epochs`` (or ``max_steps``, early stopping, or a stop signal); return the last metrics.

        ``run_dir`` is locked for the duration (a second job on it is refused, naming this one). A stop signal
        raises :class:`~ddpkit.Preempted` once the snapshot is saved, unless ``raise_on_stop_signal=False``.
        """
        lock = run_dir_lib.claim(self.run_dir, is_main=self.runtime.is_main, fresh=not self.config.resume,
                                 group=self.group)
        try:
            return self._fit()
        finally:
            if lock is not None:
                lock.release()

    def _fit(self) -> dict[str, float]:
        cfg, rt = self.config, self.runtime
        if not (cfg.resume and self.resume()):
            self.writer.log("event", self.step, {"event": "start", "restart_count": rt.restart_count})
        else:
            self.best_weights.load()
            # The file is on rank 0's disk; every rank must know the best so far to decide alike.
            best = broadcast_object((self.best_weights.value, self.best_weights.epoch), group=self.group)
            self.best_weights.value, self.best_weights.epoch = best
        self._write_config()
        callbacks_lib.call(self.callbacks, "on_fit_start", self)
        handlers = signals.catch_stop_signals(self._on_stop_signal)
        last: dict[str, float] = {}
        try:
            # A finished run, resumed: nothing left to train.
            if cfg.early_stopping_metric is not None and self.bad_epochs >= cfg.early_stopping_patience:
                self.stopped_by = "early_stopping"
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                self.stopped_by = "max_steps"
            while self.epoch < cfg.epochs and self.stopped_by is None:
                self.sampler.set_position(self.epoch, self.cursor)
                if not self._train_epoch():
                    break
                last = self._end_epoch()
        except BaseException as err:
            # The launcher's failure summary shows the end of the traceback, notes included (Python >= 3.11).
            if hasattr(err, "add_note"):
                err.add_note(f"ddpkit: rank {rt.rank} failed in epoch {self.epoch}, at optimizer step {self.step}")
            raise
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if self.stopped_by in ("max_steps", "signal"):
            self.save()
        self.wait_for_snapshot()  # the run's last snapshot is whole before fit() returns
        self.writer.log("event", self.step, {"event": "stop", "reason": self.stopped_by or "epochs"})
        self.writer.flush()
        callbacks_lib.call(self.callbacks, "on_fit_end", self)
        if self.stopped_by != "signal":
            self._print0(run_summary(self.stopped_by or "epochs", self.epoch, self.step, last, self.best_weights,
                                     self.run_dir))
        if self.stopped_by == "signal" and cfg.raise_on_stop_signal:
            received = signal.Signals(self._stop_signal).name if self._stop_signal else "a signal to another rank"
            self._print0(f"ddpkit: stopped by {received} after optimizer step {self.step}; the snapshot is saved; "
                         f"raising ddpkit.Preempted (exit code {PREEMPTED_EXIT_CODE}: pre-empted, resume me)")
            raise Preempted(self.step, received)
        return last

    def _train_epoch(self) -> bool:
        """Train on the rest of the current epoch; False when training must stop before its end."""
        cfg, rt = self.config, self.runtime
        accum, micro_gbs = cfg.grad_accum_steps, self.sampler.global_batch_size
        remaining = len(self.sampler)
        first_micro = self.cursor // micro_gbs
        progress = Progress(
            rt.is_main and cfg.progress,
            total=-(-self.sampler.steps_per_epoch // accum),  # optimizer steps: micro-batches / accum, rounded up
            desc=f"epoch {self.epoch + 1}/{cfg.epochs}",
            initial=first_micro // accum,
        )
        window = LossWindow(on_host=self._on_cpu)
        t0 = self._epoch_start = time.perf_counter()
        for i, batch in enumerate(self.loader):
            group_size = min(accum, remaining - (i // accum) * accum)
            last_in_group = i % accum == group_size - 1
            if i % accum == 0:
                step_samples = self.sampler.samples_in_step(first_micro + i, accum)
            if not self._on_cpu:  # on the CPU, batches are already where they belong
                batch = to_device(batch, rt.device)
            n = batch_len(batch)
            sync = nullcontext() if last_in_group else self.strategy.no_sync()
            layout = batch_layout(self._layout(first_micro + i)) if self._global_dropout else nullcontext()
            with sync:
                with self._autocast(), layout:
                    loss = self._loss(self.model, batch)
                window.add(loss, n)
                scaled = self.strategy.mark_nonfinite(loss)
                share = loss_share(n, self.sampler.world_size, step_samples, group_size, micro_gbs)
                if share != 1:
                    scaled = scaled / share
                (self.scaler.scale(scaled) if self.scaler else scaled).backward()
            if not last_in_group:
                continue
            taken = self._optimizer_step(window)
            window.end_step(taken)
            if self.callbacks:
                callbacks_lib.call(self.callbacks, "on_step_end", self, taken)
            self.cursor = min((first_micro + i + 1) * micro_gbs, self.sampler.num_samples)
            end_of_epoch = i + 1 == remaining
            if cfg.max_steps is not None and self.step >= cfg.max_steps:
                self.stopped_by = "max_steps"
            postfix = None
            # Every rank reaches the same decision here: steps are taken or skipped everywhere alike.
            if end_of_epoch or self.stopped_by or (taken and self.step % cfg.log_every_steps == 0):
                train_loss = self._agree(window)
                ms = 1000 * (time.perf_counter() - t0) / max(window.tried, 1)
                postfix = {"loss": train_loss, "ms/step": ms}
                if window.steps:
                    record = {"epoch": self.epoch, "train/loss": train_loss, "lr": self._lr(),
                              "ms_per_step": round(ms, 3)}
                    if self._grad_norm is not None:
                        record["grad_norm"] = float(self._grad_norm)  # of the last step taken, before clipping
                    self.writer.log("train", self.step, record)
                window.clear()
                t0 = time.perf_counter()
            progress.update(postfix)
            if self.stopped_by is not None and not end_of_epoch:
                progress.close()
                return False
            # An epoch-end snapshot follows the last step of an epoch; do not write that step twice.
            if taken and cfg.snapshot_every_steps and self.step % cfg.snapshot_every_steps == 0:
                if not (end_of_epoch and cfg.snapshot_every_epochs):
                    self.save()
        progress.close()
        return True

    def _optimizer_step(self, window: LossWindow) -> bool:
        """Clip and step if the synchronised gradients are finite; True if the step was taken.

        The strategy's verdict is the same on every rank (see :meth:`Strategy.check_gradients`); it costs a
        host sync per step (as a GradScaler does).
        """
        cfg = self.config
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip and check true gradients, not scaled ones
        verdict = self.strategy.check_gradients(cfg.clip_grad_norm)
        if not verdict.finite:
            return self._nonfinite_step(window)
        if cfg.clip_grad_norm is not None:
            self._grad_norm = verdict.norm
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        # Freed now rather than before the next backward: the next forward pass then runs without them, so
        # peak memory is lower by the size of the gradients.
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None and cfg.scheduler_interval == "step":
            self.scheduler.step()
        self.step += 1
        return True

    def _nonfinite_step(self, window: LossWindow) -> bool:
        """Every rank is here at the same step (the gradients said so); find out why, then skip or stop."""
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)  # also parameters outside the optimizer: no NaN may stay behind
        # Rare, and entered by every rank together, so a collective is safe: how many ranks had a bad loss?
        bad_ranks = int(all_reduce(float(not window.step_is_finite()), group=self.group))
        if self.scaler is not None:
            self.scaler.update()  # the scaler saw the inf/NaN in unscale_: it lowers its scale
            if not bad_ranks:  # fp16 overflow with finite losses: routine, the scaler's business
                self.writer.log("event", self.step, {"event": "fp16_overflow", "scale": self.scaler.get_scale()})
                return False
        what = f"non-finite loss on {bad_ranks} rank(s)" if bad_ranks else "non-finite gradients (losses finite)"
        if cfg.on_nonfinite == "stop":
            raise FloatingPointError(
                f"{what} at optimizer step {self.step} (epoch {self.epoch}); every rank stops here. Lower the "
                "learning rate, clip gradients (clip_grad_norm), or pass on_nonfinite='skip'"
            )
        self.skipped_steps += 1
        self.writer.log("event", self.step, {"event": "skipped_nonfinite", "reason": what,
                                             "skipped": self.skipped_steps})
        return False

    def _agree(self, window: LossWindow) -> float:
        """The global mean loss of the steps since the last agreement; spreads a stop signal to every rank.

        Collective: every rank calls it after the same steps.
        """
        total = all_reduce({
            "loss": window.local_sum(self.runtime.device),
            "samples": sum(window.sizes),
            "stop": float(bool(self._stop_signal)),
        }, group=self.group)
        self._epoch_loss[0] += float(total["loss"])
        self._epoch_loss[1] += float(total["samples"])
        if total["stop"] and self.stopped_by is None:
            self.stopped_by = "signal"
        return float(total["loss"] / total["samples"]) if total["samples"] else float("nan")

    def _end_epoch(self) -> dict[str, float]:
        cfg = self.config
        self.epoch += 1
        self.cursor = 0
        if self.scheduler is not None and cfg.scheduler_interval == "epoch":
            self.scheduler.step()
        metrics: dict[str, float] = {"epoch": self.epoch, "step": self.step, "lr": self._lr()}
        # The mean over the epoch's steps trained by this process (after a resume mid-epoch: since the resume).
        loss_sum, samples = self._epoch_loss
        metrics["train/epoch_loss"] = loss_sum / samples if samples else float("nan")
        self._epoch_loss = [0.0, 0.0]
        if self.val_data is not None:
            metrics |= self.evaluate(self.val_data, prefix="val")
        seconds = round(time.perf_counter() - self._epoch_start, 3)  # training and validation
        if cfg.early_stopping_metric is not None:
            if cfg.early_stopping_metric not in metrics:
                raise ConfigError(
                    f"early_stopping_metric={cfg.early_stopping_metric!r} is not among {sorted(metrics)}"
                )
            value = metrics[cfg.early_stopping_metric]
            better = self.best is None or (value < self.best if cfg.early_stopping_mode == "min" else value > self.best)
            self.best, self.bad_epochs = (value, 0) if better else (self.best, self.bad_epochs + 1)
            if self.bad_epochs >= cfg.early_stopping_patience:
                self.stopped_by = "early_stopping"
        if self.best_weights.update(metrics, self.strategy.model_weights, self.epoch, self.step):
            self.writer.log("event", self.step, {"event": "best", "file": "best.pt",
                                                 self.best_weights.metric: self.best_weights.value})
        if cfg.snapshot_every_epochs and self.epoch % cfg.snapshot_every_epochs == 0 or self.stopped_by:
            self.save()
        # The records and callbacks get the epoch's time too; fit() returns only what the training determines.
        timed = metrics | {"epoch_seconds": seconds}
        self.writer.log("epoch", self.step, timed)
        self.writer.epoch_row(timed)
        self.writer.flush()
        self._print0(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in timed.items()))
        callbacks_lib.call(self.callbacks, "on_epoch_end", self, timed)
        return metrics

    def evaluate(self, data: Dataset, prefix: str = "test") -> dict[str, float]:
        """Exact metrics over every sample of ``data`` (each counted once), named ``prefix/metric``."""
        loader = build_eval_loader(
            data, self.config.eval_batch_size, num_workers=self.config.num_workers, group=self.group
        )
        with self.strategy.evaluation():  # fsdp: no collective per forward, as ranks' batch counts may differ
            results = evaluate(self.model, loader, self._metric_fn, group=self.group, autocast=self._autocast)
        out = {f"{prefix}/{k}": v for k, v in results.items()}
        if prefix != "val":
            self.writer.log(prefix, self.step, out)
        return out

    # -- pieces -------------------------------------------------------------------------------------------

    def _loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.batch_loss_fn is not None:
            return self.batch_loss_fn(model, batch)
        inputs, targets = batch
        return self.loss_fn(model(inputs), targets)

    def _metric_fn(self, model: nn.Module, batch: Any) -> Mapping[str, Any]:
        if self.metric_fn is not None:
            return self.metric_fn(model, batch)
        # A custom loss without a metric_fn: report the loss, weighted by batch size (exact for mean losses).
        loss = self._loss(model, batch)
        n = batch_len(batch)
        return {"loss": (loss.detach().double() * n, n)}

    def _layout(self, micro: int) -> BatchLayout:
        """This rank's place in the global batch of the optimizer step that micro-batch ``micro`` belongs to.

        Keyed by the step, not the micro-batch, so :class:`GlobalBatchDropout` draws the same masks with or
        without gradient accumulation: sample ``p`` of a step's global batch gets row ``p`` of its mask.
        """
        accum = self.config.grad_accum_steps
        size, offset = self.sampler.place_in_step(micro, accum)
        return BatchLayout(size, offset, key=stream_seed("dropout", self.config.seed, self.epoch, micro // accum))

    def _autocast(self) -> Any:
        if self.config.precision == "fp32":
            return nullcontext()
        dtype = torch.bfloat16 if self.config.precision == "bf16" else torch.float16
        return torch.autocast(self.runtime.device.type, dtype=dtype)

    def _on_stop_signal(self, signum: int) -> None:
        # Only a flag: the next agreement (every log_every_steps) spreads it, and every rank saves and stops
        # after the same step.
        self._stop_signal = signum

    def _print0(self, *args: Any) -> None:
        print0(*args, group=self.group)

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])
