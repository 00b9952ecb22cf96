"""A step of several models and optimizers, written by the user in one function: ``Trainer({"g":
G, "d": D}, {"g": opt_g, "d": opt_d}, data, config, step_fn=gan_step)`` calls ``gan_step(step)``
once per optimizer step, with ``step`` a :class:`StepContext` (docs/trainer.md, "Several models and
optimizers")."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any, cast

import torch
from torch import nn

from ddpkit._errors import ConfigError
from ddpkit.nn._dropout import convert_dropout
from ddpkit.snapshot._run_dir import RunRecord
from ddpkit.strategies import DDPConfig, strategy_config
from ddpkit.strategies._ddp import SeveralModels
from ddpkit.training._config import TrainerConfig
from ddpkit.training._evaluation import MetricFn
from ddpkit.training._step import (
    MicroBatch,
    Step,
    StepBody,
    TrainStep,
    dropout_layout,
)
from ddpkit.training._validation import check_metric_driven, metric_driven


class StepContext:
    """What a step function gets: the wrapped ``models`` and ``optimizers`` by name, the
    micro-batches, and the two calls that replace ``loss.backward()`` and ``optimizer.step()``."""

    def __init__(self, owner: TrainStep, micro: list[MicroBatch]) -> None:
        self._owner, self._micro = owner, micro
        self._strategy = cast(SeveralModels, owner.strategy)
        self.models: dict[str, torch.nn.Module] = self._strategy.models
        self.optimizers: dict[str, torch.optim.Optimizer] = self._strategy.optimizers
        # each optimizer stepped so far: taken, or skipped (non-finite)
        self.taken: dict[str, bool] = {}
        self._at: MicroBatch | None = None
        # The optimizers whose latest backward ran under no_sync(): their gradients are this rank's
        # own until a backward on the step's last micro-batch all-reduces them.
        self._unsynced: set[str] = set()
        # The optimizers some step.backward() named in this step: the ones it trains.
        self.trained: set[str] = set()
        self._passes = 0  # passes over the micro-batches begun

    @property
    def step(self) -> int:
        """The optimizer steps taken before this one, over the run (a resume goes on counting)."""
        return self._owner.state.step

    @property
    def epoch(self) -> int:
        """The epoch this step belongs to (epochs completed before it)."""
        return self._owner.state.epoch

    def micro_batches(self) -> Iterator[Any]:
        """This rank's micro-batches of the step; may be iterated again. The loop's body runs under
        autocast, the global batch's dropout layout and, on all but the last micro-batch, every
        model's ``no_sync()``: a forward and its backward both belong inside it, and the loop must
        run to its end."""
        owner, epoch = self._owner, self._owner.state.epoch
        passes, self._passes = self._passes, self._passes + 1
        try:
            for micro in self._micro:
                self._at = micro
                sync = nullcontext() if micro.last else owner.strategy.no_sync()
                dropout = dropout_layout(micro, owner.config, epoch, passes)
                with sync, owner.autocast(), dropout:
                    yield micro.batch
        finally:
            # Left early too (a break, zip with a shorter iterable, next(iter(...))): a backward
            # after it would run outside the micro-batch's no_sync() and autocast.
            self._at = None

    def backward(self, loss: torch.Tensor, *names: str) -> None:
        """``loss`` (the current micro-batch's mean, a 0-dim tensor) backward, for the optimizers
        ``names``' verdict; recorded as ``train/loss_<names joined by +>``. Divided by the
        micro-batch's divisor, scaled under fp16, and a non-finite value put into the gradients
        every rank's verdict reads."""
        owner, micro = self._owner, self._at
        if micro is None:
            raise RuntimeError("step.backward() runs inside `for batch in step.micro_batches():`")
        if not names or any(n not in owner.steps for n in names):
            raise ConfigError(
                f"step.backward(loss, *names): name optimizers among {sorted(owner.steps)}"
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = (
                f"shape {tuple(loss.shape)}"
                if isinstance(loss, torch.Tensor)
                else f"type {type(loss).__name__}"
            )
            raise ConfigError(
                f"step.backward(loss, {', '.join(map(repr, names))}) got a loss of {got}: pass "
                "the micro-batch's mean, a 0-dim tensor (loss.mean(), or reduction='mean')"
            )
        if loss.ndim:
            loss = loss.reshape(())  # the loss window stacks 0-dim losses
        self.trained.update(names)
        if micro.last:
            self._unsynced.difference_update(names)
        else:
            self._unsynced.update(names)
        views = [self._strategy.views[name] for name in names]
        # backward runs in the forward's dtypes anyway
        with torch.autocast(self._strategy.runtime.device.type, enabled=False):
            owner.backward(loss, micro, None, views, "+".join(names))
        if micro.last:  # its backward synchronised
            owner.observe.backward_returned()

    def optimizer_step(self, name: str) -> bool:
        """Unscale (fp16), the verdict on every rank alike, clip (``clip_grad_norm``, this
        optimizer's own norm), step and its scheduler, then its gradients set to None; False when
        skipped (non-finite, ``on_nonfinite="skip"``). Raises FloatingPointError on every rank under
        ``on_nonfinite="stop"``."""
        owner = self._owner
        if name not in owner.steps or name in self.taken:
            raise ConfigError(
                f"step.optimizer_step({name!r}): once a step, for one of {sorted(owner.steps)}"
            )
        if name not in self.trained:
            # its gradients, if any, come from a backward its verdict did not see
            raise ConfigError(
                f"step.optimizer_step({name!r}) in a step with no step.backward(..., {name!r}): "
                f"run its loss's backward through step.backward(loss, {name!r}), or leave the call "
                f"out on the steps that do not train {name!r} (a WGAN's generator between its "
                "critic's steps)"
            )
        if name in self._unsynced:  # every rank alike: the same step function and micro-batches
            raise RuntimeError(
                f"step.optimizer_step({name!r}): the step's last micro-batch had no "
                f"step.backward(..., {name!r}) after one under no_sync(), so the gradients of "
                f"{name!r} were never all-reduced and each rank would step with its own: run `for "
                "batch in step.micro_batches():` to its end (no break), with a backward on every "
                "micro-batch"
            )
        taken = self.taken[name] = owner.optimize(name, more=True)
        self.optimizers[name].zero_grad(set_to_none=True)
        return taken


StepFn = Callable[[StepContext], Any]
"""``step_fn(step)``: one optimizer step of several models and optimizers, written by the user."""


def step_fn_body(step_fn: StepFn) -> StepBody:
    """The Trainer's step body (:data:`~ddpkit.training._step.StepBody`) with a ``step_fn``."""

    def body(owner: TrainStep, step: Step) -> dict[str, bool]:
        context = StepContext(owner, list(step.micro_batches))  # (count_fn is refused)
        step_fn(context)
        # One that a backward named must step: unstepped, a NaN of one rank would reach the next
        # step without a verdict. One no backward named is left out (a WGAN's generator).
        unstepped = sorted(context.trained - set(context.taken))
        if unstepped:
            raise RuntimeError(
                f"the step function did not call step.optimizer_step() for {', '.join(unstepped)}, "
                "which a step.backward() named: step every optimizer a step trains, once"
            )
        return context.taken

    return body


class Schedulers:
    """The optimizers' schedulers as one, for the Trainer's epoch ends, validations and snapshots.
    ``metric_driven``: one of them steps on a validation metric (``ReduceLROnPlateau``)."""

    def __init__(self, schedulers: Mapping[str, Any]) -> None:
        self.schedulers = dict(schedulers)
        self.metric_driven = any(map(metric_driven, self.schedulers.values()))

    def step(self, metrics: float | None = None) -> None:
        """Step those that need no metric; with ``metrics`` (a validation's), the others."""
        for scheduler in self.schedulers.values():
            if metrics is None and not metric_driven(scheduler):
                scheduler.step()
            elif metrics is not None and metric_driven(scheduler):
                scheduler.step(metrics)

    def state_dict(self) -> dict[str, Any]:
        return {name: s.state_dict() for name, s in self.schedulers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, s in self.schedulers.items():
            s.load_state_dict(state[name])


NO_METRIC_FN = (
    "pass metric_fn=lambda models, batch: {name: per-sample values} (models: the models by name, "
    "in eval mode): several models have no one forward to take a default loss from"
)
_OWN_LOSSES = "the step function computes each loss and passes it to step.backward(loss, name)"
REFUSED = {
    "loss_fn": _OWN_LOSSES,
    "batch_loss_fn": _OWN_LOSSES,
    "count_fn": (
        "step.backward divides each micro-batch's mean loss by its share of the step's samples; "
        "train one model with count_fn to weigh micro-batches by their tokens"
    ),
    "compile": "leave it off, or train one model with compile=True",
    "snapshot memory": "leave SnapshotConfig(memory=...) off: snapshots go to disk",
}
"""What a Trainer with ``step_fn`` refuses, each with the way out."""


def several_models(
    config: TrainerConfig,
    models: Any,
    optimizers: Any,
    scheduler: Any,
    runtime: Any,
    refused: dict[str, Any],
    val_data: Any = None,
    metric_fn: Callable[[dict[str, nn.Module], Any], Mapping[str, Any]] | None = None,
) -> tuple[SeveralModels, Schedulers | None, RunRecord, MetricFn | None]:
    """The strategy, the schedulers as one, the run's record and the evaluation's metric function
    of a Trainer with a ``step_fn``; ``refused`` (:data:`REFUSED`'s names and the values given) is
    refused, naming the way out. ``metric_fn(models, batch)`` gets the models by name, unwrapped."""
    strategy = strategy_config(config.strategy)
    if strategy.name != "ddp":
        raise ConfigError(
            f"step_fn with several models runs under strategy='ddp' (not {strategy.name!r}): pass "
            "strategy='ddp', or train one model with zero/fsdp"
        )
    if not isinstance(models, Mapping) or not models:
        raise ConfigError(
            "with step_fn, pass the models by name: Trainer({'g': G, 'd': D}, optimizers, ...)"
        )
    if not isinstance(optimizers, Mapping) or not optimizers:
        raise ConfigError(
            "with step_fn, pass the optimizers by name: Trainer(models, {'g': opt_g, 'd': opt_d}, "
            "...)"
        )
    if scheduler is not None and not isinstance(scheduler, Mapping):
        raise ConfigError(
            "with step_fn, pass the schedulers by optimizer name: scheduler={'g': sched_g}"
        )
    unknown = sorted(set(scheduler or {}) - set(optimizers))
    if unknown:
        raise ConfigError(
            f"scheduler names {unknown} name no optimizer: use names among {sorted(optimizers)}"
        )
    for name, sched in (scheduler or {}).items():
        target = getattr(sched, "optimizer", None)
        if target is not None and target is not optimizers[name]:  # filed under another's name
            owner = next((n for n, o in optimizers.items() if o is target), None)
            made = f"optimizer {owner!r}" if owner else "an optimizer the Trainer is not given"
            raise ConfigError(
                f"scheduler={{{name!r}: {type(sched).__name__}}} was built with {made}, not "
                f"{name!r}: file each scheduler under the name of the optimizer it was built with"
            )
        if metric_driven(sched):
            check_metric_driven(config, sched, val_data)
    if val_data is not None and metric_fn is None:
        raise ConfigError(f"val_data with step_fn needs a metric_fn: {NO_METRIC_FN}")
    for what, value in refused.items():
        if value is not None and value is not False:
            raise ConfigError(f"{what} is not supported with step_fn: {REFUSED[what]}")
    if config.global_batch_dropout:
        # one layer-id space over all models: no two layers share a mask
        converted = nn.ModuleDict(dict(models))
        convert_dropout(converted)  # in place: a model that is a dropout itself is replaced
        models = dict(converted.items())
    # The record (checked on resume) holds every optimizer's groups, by the optimizer's name.
    groups = SimpleNamespace(
        param_groups=[g for opt in optimizers.values() for g in opt.param_groups]
    )
    record = RunRecord.of(
        config, cast(torch.optim.Optimizer, groups), nn.ModuleDict(dict(models)), named=optimizers
    )
    built = SeveralModels(
        models,
        optimizers,
        runtime=runtime,
        config=cast(DDPConfig, strategy),
        sync_batchnorm=config.sync_batchnorm,
    )
    metrics = None
    if metric_fn is not None:
        by_name = metric_fn

        def metrics(modules: nn.Module, batch: Any) -> Mapping[str, Any]:
            return by_name(dict(cast(nn.ModuleDict, modules).items()), batch)

    return built, Schedulers(scheduler) if scheduler else None, record, metrics
