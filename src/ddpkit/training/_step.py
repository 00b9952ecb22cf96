"""The training step, from the loader's micro-batches (:func:`epoch_steps`) to
``optimizer.step()`` (:class:`TrainStep`, :class:`OptimizerStep`), what watches it
(:class:`StepObserver`: the step timings, the stall watch's marks, and :class:`LossWindow`, the
losses the ranks agree on). Each micro-batch's mean loss is divided so that the step follows the
mean over every sample (or item, ``count_fn``) of the global batch (:func:`loss_divisor`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from enum import Enum
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ddpkit._errors import ConfigError
from ddpkit._internals.compiler import cpp_compiler, set_ddp_optimizer
from ddpkit.data._loader import batch_len, to_device
from ddpkit.data._sampler import ShardedBatchSampler
from ddpkit.distributed import Group
from ddpkit.distributed import _progress as marks
from ddpkit.distributed._collectives import all_reduce, comm_device, gather_values
from ddpkit.distributed._progress import Phase
from ddpkit.distributed._runtime import Runtime, is_live
from ddpkit.distributed._seeding import mix_seed
from ddpkit.nn._dropout import batch_layout, step_layout
from ddpkit.snapshot._state import TrainState
from ddpkit.strategies import Strategy
from ddpkit.tracking._speed import Speed
from ddpkit.training._config import TrainerConfig
from ddpkit.training._evaluation import BatchLoss, CountFn


@dataclass(slots=True)
class MicroBatch:
    batch: Any
    samples: int  # this rank's samples in it (its items, such as tokens, under count_fn)
    divisor: float  # what its mean loss is divided by (loss_divisor)
    last: bool  # the step's last micro-batch: its backward synchronises the gradients
    index: int  # its global batch's number in the epoch
    # the step's samples over all ranks, and where this rank's first sample of it sits among them
    place: tuple[int, int]


@dataclass(slots=True)
class Step:
    """One optimizer step of an epoch; ``micro_batches`` reads them from the loader as the step
    trains."""

    micro_batches: Iterator[MicroBatch]
    cursor: int  # the epoch's cursor once the step is taken: samples trained on, over all ranks
    last_in_epoch: bool


def loss_divisor(count: Any, world_size: int, total: Any) -> Any:
    """What a rank divides a micro-batch's mean loss over ``count`` samples (or items) by, so that
    the step follows the mean over the ``total`` samples (items) of the step on all ranks. Numbers
    for samples; float64 tensors for items (counts, exact up to 2**53).

    DDP averages the ranks' gradients and micro-batches' gradients add up, so the step's gradient is
    ``sum_i grad(mean_i) / d_i / world``; with ``d_i = total / (count_i * world)`` that is
    ``sum_i count_i * grad(mean_i) / total``. When every micro-batch is full, ``d_i`` is the number
    of micro-batches, exactly."""
    return total / (count * world_size)


def epoch_steps(
    batches: Iterable[Any],
    sampler: ShardedBatchSampler,
    accum: int,
    first: int,
    device: torch.device | None,
    observe: StepObserver,
) -> Iterator[Step]:
    """The steps of the rest of an epoch whose first untrained global batch is number ``first``;
    ``batches`` is the loader's pass over them (moved to ``device`` when given; each ``next()`` is
    ``observe``'s ``data``). A step's micro-batches must be read before the next step is asked
    for."""
    it = iter(batches)
    end, num_samples = sampler.steps_per_epoch, sampler.num_samples
    for start in range(first, end, accum):
        stop = min(start + accum, end)
        yield Step(
            _micro_batches(it, range(start, stop), accum, sampler, device, observe),
            min(stop * sampler.global_batch_size, num_samples),
            stop == end,
        )


def _micro_batches(
    it: Iterator[Any],
    indices: range,
    accum: int,
    sampler: ShardedBatchSampler,
    device: torch.device | None,
    observe: StepObserver,
) -> Iterator[MicroBatch]:
    for index in indices:
        began = time.perf_counter()
        batch = next(it)
        n = batch_len(batch)
        observe.data(time.perf_counter() - began, n)
        if device is not None:
            batch = to_device(batch, device)
        place = sampler.place_in_step(index, accum)
        divisor = float(loss_divisor(n, sampler.world_size, place[0]))
        yield MicroBatch(batch, n, divisor, index == indices[-1], index, place)


class WeightedStep:
    """A step's micro-batches with their item counts (``count_fn``) as ``samples``, the all-reduce
    of the step's total in flight: :meth:`divisor` waits for it, so it overlaps the first forward.
    """

    def __init__(self, step: Step, count_fn: CountFn, world_size: int, group: Group = None) -> None:
        # Read every micro-batch of the step: the total must be known before the first backward.
        self.micro = list(step.micro_batches)
        self.world_size = world_size
        self.counts = [_as_count(count_fn(m.batch)) for m in self.micro]
        device = comm_device(group)
        self.total = torch.stack([c.to(device) for c in self.counts]).sum()
        self._work = (
            dist.all_reduce(self.total, group=group, async_op=True) if is_live(group) else None
        )

    def __iter__(self) -> Iterator[MicroBatch]:
        for micro, count in zip(self.micro, self.counts):
            # a 0-dim float64 tensor (_as_count), read by divisor()
            yield replace(micro, samples=count)  # type: ignore[arg-type]

    def divisor(self, micro: MicroBatch) -> torch.Tensor:
        """The divisor of ``micro``'s mean loss; the first call waits for the step's total."""
        if self._work is not None:
            self._work.wait()
            self._work = None
        count = micro.samples.to(self.total.device)  # type: ignore[attr-defined]
        return loss_divisor(count, self.world_size, self.total)


def dropout_layout(
    micro: MicroBatch, config: TrainerConfig, epoch: int, passes: int
) -> AbstractContextManager[Any]:
    """The global batch's dropout layout of ``micro`` in pass ``passes`` (from 0) over its step's
    micro-batches: each sample's mask from its place in the global batch; nothing without
    ``global_batch_dropout``."""
    if not config.global_batch_dropout:
        return nullcontext()
    at = step_layout(micro.place, micro.index, config.grad_accum_steps, config.seed, epoch)
    if passes:
        # a key of its own per pass, the same on every rank: every rank runs the same passes
        at = replace(at, key=mix_seed(at.key, passes))
    return batch_layout(replace(at, size=batch_len(micro.batch)))


def _as_count(value: Any) -> torch.Tensor:
    # float64: counts stay exact up to 2**53 items, where float32 would round above 2**24.
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"count_fn returned a tensor of shape {tuple(value.shape)}: return one number"
            )
        return value.detach().reshape(()).to(torch.float64)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.tensor(float(value), dtype=torch.float64)
    raise TypeError(f"count_fn returned a {type(value).__name__}: return an int or a 0-dim tensor")


class OptimizerStep:
    """Clip and step when the synchronised gradients are finite; skip or stop everywhere alike when
    not. ``grad_norm``: the global norm of the last step taken, before clipping (when clipping);
    ``step_norm``: that of the step just done, where the strategy computed it; ``lr``: its rate.

    The step counter, the skip count and the fp16 scaler's update are :class:`TrainStep`'s: once a
    step, however many optimizers it has. ``outside``: the parameters beside the optimizer's whose
    gradients a skip sets to None too (None: every parameter of the strategy's model).
    """

    def __init__(
        self,
        config: TrainerConfig,
        strategy: Strategy,
        *,
        scheduler: Any,
        scaler: torch.amp.GradScaler | None,
        state: TrainState,
        log: Callable[[str, int, dict[str, Any]], None],
        group: Group,
        outside: list[torch.nn.Parameter] | None = None,
    ) -> None:
        self.config, self.strategy = config, strategy
        self.scheduler, self.scaler = scheduler, scaler
        self.state, self.log, self.group = state, log, group
        self.outside = outside
        self.grad_norm: torch.Tensor | None = None
        self.step_norm: torch.Tensor | None = None
        self.lr = 0.0
        self.skipped = False  # for non-finite values (not an fp16 overflow)

    def begin(self) -> None:
        """Before the step's first forward: the gradients set to None (what reached them since the
        previous step, a callback's backward, is not added to this step's)."""
        self.strategy.optimizer.zero_grad(set_to_none=True)
        self.skipped = False

    def __call__(self, window: LossWindow) -> bool:
        """True if the step was taken."""
        cfg, optimizer = self.config, self.strategy.optimizer
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)  # clip and check true gradients, not scaled ones
        verdict = self.strategy.check_gradients(cfg.clip_grad_norm)
        self.lr, self.step_norm = optimizer.param_groups[0]["lr"], verdict.norm
        if not verdict.finite:
            return self._nonfinite(window)
        if cfg.clip_grad_norm is not None:
            self.grad_norm = verdict.norm
        if self.scaler is not None:
            self.scaler.step(optimizer)
        else:
            optimizer.step()
        # The gradients stay, for on_step_end callbacks to read, until the next step's begin().
        if self.scheduler is not None and cfg.scheduler_interval == "step":
            self.scheduler.step()
        return True

    def _nonfinite(self, window: LossWindow) -> bool:
        """Every rank is here at the same step (the gradients said so); find out why, then skip or
        stop."""
        state = self.state
        self.strategy.optimizer.zero_grad(set_to_none=True)
        # parameters outside the optimizer too: no NaN stays
        if self.outside is None:
            self.strategy.model.zero_grad(set_to_none=True)
        else:
            for p in self.outside:
                p.grad = None
        # Rare, and entered by every rank together, so a collective is safe: how many ranks had a
        # bad loss?
        bad_ranks = int(all_reduce(float(not window.step_is_finite()), group=self.group))
        if self.scaler is not None:
            # (the scaler saw the inf/NaN in unscale_: TrainStep's update lowers its scale)
            if not bad_ranks:  # fp16 overflow with finite losses: routine, the scaler's business
                scale = self.scaler.get_scale()
                self.log("event", state.step, {"event": "fp16_overflow", "scale": scale})
                return False
        what = "non-finite gradients (losses finite)"
        if bad_ranks:
            what = f"non-finite loss on {bad_ranks} rank(s)"
        if self.config.on_nonfinite == "stop":
            raise FloatingPointError(
                f"{what} at optimizer step {state.step} (epoch {state.epoch}); every rank stops "
                "here. Lower the learning rate, clip gradients (clip_grad_norm), or pass "
                "on_nonfinite='skip'"
            )
        self.skipped = True
        # the step counts once in skipped_steps when it ends, however many optimizers skipped
        skipped = state.skipped_steps + 1
        self.log(
            "event", state.step, {"event": "skipped_nonfinite", "reason": what, "skipped": skipped}
        )
        return False


def compile_for_training(model: torch.nn.Module, device: torch.device) -> Any:
    """``TrainerConfig(compile=True)``: ``torch.compile(model)`` (the strategy's wrapped module)
    with Dynamo's DDP optimizer on, so that each bucket's all-reduce still overlaps the backward
    (docs/language-models.md). Only the training forward is compiled."""
    if device.type == "cpu" and cpp_compiler() is None:
        raise ConfigError(
            "compile=True on the CPU needs a C++ compiler (inductor builds its kernels with one) "
            "and none was found: install g++ (apt-get install g++) or set CXX, or leave "
            "compile=False"
        )
    set_ddp_optimizer()
    return torch.compile(model)


class StepObserver:
    """What watches a step, which calls it once a phase: the step timings (data, compute, comm,
    optimizer: :class:`~ddpkit.tracking._speed.Speed`), the marks ``ddpkit run``'s stall watch
    reads (:mod:`ddpkit.distributed._progress`), and the :class:`LossWindow`."""

    def __init__(self, speed: Speed, window: LossWindow) -> None:
        self.speed, self.timings, self.window = speed, speed.timings, window

    def begin(self, step: int) -> None:
        """Optimizer step ``step`` (counted from 1) begins; its first micro-batch is read next."""
        marks.begin_step(step)
        self.timings.start_step()

    def data(self, seconds: float, samples: int) -> None:
        """A micro-batch of ``samples`` was read from the loader, which took ``seconds``."""
        self.timings.data(seconds, samples)

    def forward(self, batch: Any) -> AbstractContextManager[None]:
        """Around a micro-batch's forward and backward: the run's first one's FLOPs are counted,
        once a device peak is known."""
        return self.speed.counting(batch)

    def backward(
        self, loss: torch.Tensor, micro: MicroBatch, start: torch.Tensor, name: Any
    ) -> None:
        """Before the backward of ``micro``, whose mean is ``loss`` (into the window, under
        ``name``) and which starts from ``start``: the step's synchronising backward (its last
        micro-batch's) marks the moment its last gradient is ready, where ``comm`` begins."""
        self.window.add(loss, micro.samples, name)
        if micro.last:
            self.timings.sync_backward(start)

    def backward_returned(self) -> None:
        """A synchronising backward returned and more of the step follows before its optimizer's
        (a step of several optimizers): its ``comm`` ends."""
        self.timings.backward_returned()

    def optimizer(self) -> None:
        """An optimizer step begins: the step's last backward has returned."""
        self.timings.before_optimizer()
        marks.mark(Phase.OPTIMIZER)

    def optimizer_done(self, more: bool) -> None:
        """The optimizer step is done (taken or skipped); ``more``: the step goes on."""
        marks.mark(Phase.USER)
        self.timings.after_optimizer(more)

    def end(self, taken: bool) -> None:
        """The step ends, ``taken`` or skipped (a skipped step's losses leave the window)."""
        self.timings.end_step()
        self.window.end_step(taken)

    @contextmanager
    def snapshot(self, in_window: bool) -> Iterator[None]:
        """Around a step's (or an epoch end's) snapshots: marked; ``in_window``: timed as the log
        window's ``snapshot`` phase."""
        with self.timings.phase("snapshot") if in_window else nullcontext():
            with marks.phase(Phase.SNAPSHOT):
                yield


StepBody = Callable[["TrainStep", Step], dict[str, bool]]
"""What a step runs between its start and its end: forward and backward on the micro-batches and
the optimizer steps (:meth:`TrainStep.backward`, :meth:`TrainStep.optimize`); returns whether each
optimizer step was taken, by name."""


@dataclass(frozen=True)
class Models:
    """What a Trainer trains (:func:`~ddpkit.training._trainer.build_models`): the ``strategy``
    over the ranks and each optimizer's view of it by name (one model: ``""``), the parameters
    beside each optimizer's (``outside``), how a batch becomes a loss, the metrics an evaluation
    takes (None: several models without a ``metric_fn``), the step's ``body`` (None:
    :meth:`TrainStep.one_model`), the schedulers (``scheduler``, the epoch ends' and
    the snapshots': one, or several as one; ``stepped``, each optimizer step's, by name;
    ``plateau``, each validation's, with its metric) and the run's ``record``."""

    strategy: Any
    views: Mapping[str, Strategy]
    outside: Mapping[str, list[torch.nn.Parameter]]
    batch_loss: BatchLoss
    metrics: Callable[[torch.nn.Module, Any], Mapping[str, Any]] | None
    body: StepBody | None
    scheduler: Any
    stepped: Mapping[str, Any]
    plateau: Any
    record: Any


class TrainStep:
    """The Trainer's step, of one model and optimizer or of several (a ``body``:
    :func:`ddpkit.training._several.step_fn_body`): calling it runs the step and returns whether
    every optimizer step was taken. It owns what the step runs under: the precision (fp16's
    GradScaler, autocast), the forward (compiled with ``compile=True``), an :class:`OptimizerStep`
    per optimizer of ``models`` (the first's norm and lr are the records'), and its
    :class:`StepObserver`."""

    def __init__(
        self,
        config: TrainerConfig,
        models: Models,
        *,
        runtime: Runtime,
        state: TrainState,
        sampler: ShardedBatchSampler,
        log: Callable[[str, int, dict[str, Any]], None],
    ) -> None:
        strategy = models.strategy
        self.config, self.strategy, self.state = config, strategy, state
        self.batch_loss, self.sampler = models.batch_loss, sampler
        device = runtime.device
        # fp16's small exponent range underflows small gradients; bf16 has fp32's range
        self.scaler = torch.amp.GradScaler(device.type) if config.precision == "fp16" else None
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.precision)
        self.autocast = partial(torch.autocast, device.type, dtype) if dtype else nullcontext
        model = strategy.model
        self.forward = compile_for_training(model, device) if config.compile else model
        speed = Speed(
            model, device, enabled=config.logging.step_timings, precision=config.precision,
            world_size=runtime.world_size, peak_flops=config.logging.peak_flops,
            compiled=config.compile,
        )  # fmt: skip
        self.observe = StepObserver(speed, LossWindow(on_host=device.type == "cpu"))
        self.window = self.observe.window
        self.steps = {
            name: OptimizerStep(
                config,
                view,
                scheduler=models.stepped.get(name),
                scaler=self.scaler,
                state=state,
                log=log,
                group=runtime.group,
                outside=models.outside.get(name),
            )  # fmt: skip
            for name, view in models.views.items()
        }
        self.optimizer_step = next(iter(self.steps.values()))
        self.body: StepBody = models.body or TrainStep.one_model

    def __call__(self, step: Step) -> bool:
        for optimizer_step in self.steps.values():
            optimizer_step.begin()  # the gradients set to None before the step's first forward
        self.observe.begin(self.state.step + 1)
        taken_by = self.body(self, step)
        if self.scaler is not None:
            # once a step, after every optimizer's unscale_ (GradScaler's rule)
            self.scaler.update()
        taken = all(taken_by.values())
        if taken:
            self.state.step += 1
        elif any(self.steps[name].skipped for name in taken_by):
            self.state.skipped_steps += 1  # once, however many of its optimizers skipped
        self.observe.end(taken)
        return taken

    def one_model(self, step: Step) -> dict[str, bool]:
        """The step of one model: forward (under autocast and the global batch's dropout layout,
        where they apply), loss and backward on each micro-batch, then the optimizer step."""
        count_fn, group = self.batch_loss.count_fn, self.optimizer_step.group
        weighted = (
            None
            if count_fn is None
            else WeightedStep(step, count_fn, self.sampler.world_size, group)
        )
        for micro in weighted or step.micro_batches:
            # all but the last backward accumulate without synchronising the gradients
            sync = nullcontext() if micro.last else self.strategy.no_sync()
            with self.observe.forward(micro.batch), sync:
                dropout = dropout_layout(micro, self.config, self.state.epoch, 0)
                with self.autocast(), dropout:
                    loss = self.batch_loss(self.forward, micro.batch)
                self.backward(loss, micro, weighted, (self.strategy,))
        (name,) = self.steps
        return {name: self.optimize(name)}

    def backward(
        self,
        loss: torch.Tensor,
        micro: MicroBatch,
        weighted: WeightedStep | None,
        marking: Iterable[Strategy],
        name: str | None = None,
    ) -> None:
        """``micro``'s mean ``loss`` (into the window, under ``name``) with a non-finite value put
        into the gradients that ``marking``'s verdicts read, divided by its divisor in the step (per
        item with ``weighted``, else per sample), scaled under fp16, and backward."""
        start = loss
        for strategy in marking:
            start = strategy.mark_nonfinite(start)
        if weighted is not None:
            start = start / weighted.divisor(micro).to(start.dtype)
        elif micro.divisor != 1:  # 1: the loss as it is, bit for bit
            start = start / micro.divisor
        self.observe.backward(loss, micro, start, name)
        (self.scaler.scale(start) if self.scaler else start).backward()

    def output(self, taken: bool) -> StepOutput:
        """The step just done, for ``on_step_end``."""
        losses, sizes = self.window.last_step
        norm = self.optimizer_step.step_norm
        return StepOutput(
            taken=taken,
            step=self.state.step,
            epoch=self.state.epoch,
            lr=float(self.optimizer_step.lr),
            grad_norm=float(norm) if taken and norm is not None else None,
            # no read of a count left on the device: a callback reads it if it asks
            samples=sum(sizes, 0.0),
            losses=losses,
            sizes=sizes,
        )

    def optimize(self, name: str, more: bool = False) -> bool:
        """Optimizer step ``name``; ``more``: the step goes on after it (several optimizers)."""
        self.observe.optimizer()
        taken = self.steps[name](self.window)
        self.observe.optimizer_done(more)
        return taken


# -- A rank's training losses between two agreements of the ranks.


@dataclass
class Agreed:
    """What the ranks agreed on: the window's loss x samples and samples over all ranks, and a stop
    flag."""

    loss_sum: float
    samples: float
    stop: bool
    means: dict[str, float]  # of each named loss (a step of several models)
    rows: list[list[float]]  # every rank's row passed to LossWindow.agree, in rank order
    fault: int  # the errno of a failed write of the run directory on some rank (0: none)

    @property
    def mean(self) -> float:
        return self.loss_sum / self.samples if self.samples else float("nan")


class LossWindow:
    """This rank's training losses since the ranks last agreed on the mean; a skipped step's are
    dropped. On an accelerator they stay tensors until the agreement (a read waits for the device);
    ``on_host`` (the CPU), their values are read at once."""

    def __init__(self, on_host: bool) -> None:
        self.on_host = on_host
        self.losses: list[torch.Tensor | float] = []
        self.sizes: list[float | torch.Tensor] = []  # samples, or items (see ddpkit.training._step)
        self.names: list[str] = []  # each loss's name, in a step of several models (else none)
        self.steps = 0  # steps taken
        self.tried = 0  # steps taken or skipped
        self._step_start = 0
        self.last_step: tuple[list[torch.Tensor | float], list[float | torch.Tensor]] = ([], [])

    def add(self, loss: torch.Tensor, size: int | torch.Tensor, name: str | None = None) -> None:
        self.losses.append(loss.item() if self.on_host else loss.detach())
        self.sizes.append(
            float(size) if self.on_host or not isinstance(size, torch.Tensor) else size.detach()
        )
        if name is not None:
            self.names.append(name)

    def step_is_finite(self) -> bool:
        return all(math.isfinite(float(loss)) for loss in self.losses[self._step_start :])

    def end_step(self, taken: bool) -> None:
        self.tried += 1
        # The step's own losses, for on_step_end (a skipped step's too: they may say why it was
        # skipped).
        self.last_step = (self.losses[self._step_start :], self.sizes[self._step_start :])
        if taken:
            self.steps += 1
        else:
            del (
                self.losses[self._step_start :],
                self.sizes[self._step_start :],
                self.names[self._step_start :],
            )
        self._step_start = len(self.losses)

    def local_sum(self, device: torch.device) -> torch.Tensor:
        """Sum of loss x samples (or items) over this rank's micro-batches, in float64."""
        if self.on_host or not self.losses:
            total = math.fsum(float(loss) * size for loss, size in zip(self.losses, self.sizes))
            return torch.tensor(total, dtype=torch.float64, device=device)
        # item counts, left on the device
        if any(isinstance(size, torch.Tensor) for size in self.sizes):
            sizes = torch.stack(
                [torch.as_tensor(s, dtype=torch.float64, device=device) for s in self.sizes]
            )
        else:
            sizes = torch.tensor(self.sizes, dtype=torch.float64, device=device)
        # Tensors, off the host; numbers where a snapshot restored them (the float64 of the same
        # values).
        losses = [
            torch.as_tensor(loss, dtype=torch.float64, device=device).reshape(())
            for loss in self.losses
        ]
        return torch.stack(losses) @ sizes

    def state_dict(self) -> dict[str, Any]:
        """The losses not yet agreed on (a snapshot between two agreements): each rank's own, as
        numbers, so that the resumed run's agreement sums the very values the uninterrupted run's
        does."""
        state = {
            "losses": [float(loss) for loss in self.losses],
            "sizes": [float(size) for size in self.sizes],
            "steps": self.steps,
            "tried": self.tried,
        }
        return state | {"names": list(self.names)} if self.names else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.losses, self.sizes = list(state["losses"]), list(state["sizes"])
        self.names = list(state.get("names", []))
        self.steps, self.tried = int(state["steps"]), int(state["tried"])
        self._step_start = len(self.losses)

    def load_rank_states(self, states: list[dict[str, Any]], rank: int) -> None:
        """At another world size: rank 0 takes every old rank's losses, the others none, so that the
        next agreement makes the same sum; the step counts are every rank's alike."""
        counts = {"steps": states[0]["steps"], "tried": states[0]["tried"]}
        if rank == 0:
            mine = {
                "losses": [x for s in states for x in s["losses"]],
                "sizes": [x for s in states for x in s["sizes"]],
                "names": [x for s in states for x in s.get("names", [])],
            }
        else:
            mine = {"losses": [], "sizes": [], "names": []}
        self.load_state_dict(mine | counts)

    def clear(self) -> None:
        self.losses, self.sizes, self.steps, self.tried, self._step_start = [], [], 0, 0, 0
        self.names = []

    def agree(
        self,
        device: torch.device,
        stop: bool,
        group: Group,
        row: Sequence[float] = (),
        fault: int = 0,
    ) -> Agreed:
        """The global loss sum and sample count since the last agreement, whether any rank must
        stop, and every rank's ``row`` (the window's step timings). Collective (one small
        all-gather): every rank calls it after the same steps; the totals are summed in rank order,
        the same on every rank."""
        mine: dict[str, Any] = {
            "loss": self.local_sum(device),
            "samples": sum(self.sizes),
            "stop": float(stop),
            "fault": float(fault),  # a failed write of the run directory: its errno
        }
        # Named losses (several models): each name's sums too, in the same all-gather. Every rank
        # ran the same step function, so every rank has the same names.
        names = sorted(set(self.names))
        for name in names:
            at = [i for i, n in enumerate(self.names) if n == name]
            mine[f"loss:{name}"] = math.fsum(
                float(self.losses[i]) * float(self.sizes[i]) for i in at
            )
            mine[f"samples:{name}"] = math.fsum(float(self.sizes[i]) for i in at)
        mine["row"] = torch.tensor(list(row), dtype=torch.float64)
        table = gather_values(mine, group)
        total = {k: math.fsum(float(r[k]) for r in table) for k in mine if k != "row"}
        means = {n: total[f"loss:{n}"] / total[f"samples:{n}"] for n in names}
        return Agreed(
            total["loss"],
            total["samples"],
            bool(total["stop"]),
            means,
            [r["row"].tolist() for r in table],
            int(max(float(r["fault"]) for r in table)),
        )


@dataclass
class EpochLoss:
    """The sums agreed so far in the current epoch: loss x samples (or items), and samples; the same
    on every rank, and in every snapshot."""

    loss_sum: float = 0.0
    samples: float = 0.0

    def add(self, agreed: Agreed) -> None:
        self.loss_sum += agreed.loss_sum
        self.samples += agreed.samples

    @property
    def mean(self) -> float:
        return self.loss_sum / self.samples if self.samples else float("nan")

    def reset(self) -> None:
        self.loss_sum, self.samples = 0.0, 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"loss_sum": self.loss_sum, "samples": self.samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loss_sum, self.samples = float(state["loss_sum"]), float(state["samples"])


class StopReason(str, Enum):
    """Why ``fit()`` ended (``trainer.stopped_by``); a callback may stop training with a reason of
    its own."""

    EPOCHS = "epochs"
    MAX_STEPS = "max_steps"
    EARLY_STOPPING = "early_stopping"
    SIGNAL = "signal"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class StepOutput:
    """One optimizer step, as ``on_step_end(trainer, taken, output)`` gets it (on every rank)."""

    taken: bool
    """False for a step skipped (non-finite gradients, or an fp16 overflow)."""
    step: int
    """Optimizer steps taken so far, this one included if taken."""
    epoch: int
    """Epochs completed before this step."""
    lr: float
    """The first param group's learning rate during this step."""
    grad_norm: float | None
    """The global gradient norm before clipping, where it was computed (``clip_grad_norm``, or
    fsdp); else None."""
    samples: float | torch.Tensor
    """This rank's samples in the step (with a ``count_fn``, its counted items: a tensor on an
    accelerator, not yet read)."""
    losses: Sequence[torch.Tensor | float]
    """This rank's micro-batch losses (each a mean over its samples); tensors on an accelerator, not
    yet read."""
    sizes: Sequence[float | torch.Tensor]
    """Their samples (or counted items)."""

    @property
    def loss(self) -> float:
        """This rank's mean loss over its samples in the step (read from the device when asked for:
        a host sync on an accelerator, nothing on the CPU). Not the mean over ranks."""
        samples = float(self.samples)
        if not samples:
            return float("nan")
        return (
            math.fsum(float(loss) * float(size) for loss, size in zip(self.losses, self.sizes))
            / samples
        )
