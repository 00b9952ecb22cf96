"""When to validate, and what a validation decides: early stopping and the best weights, from
metrics agreed over ranks, so every rank decides alike (docs/trainer.md, "Validation every N
steps"). Only rank 0 writes the best weights, but every rank joins gathering them (a collective
under ``fsdp``). The weights files for use outside ddpkit (docs/snapshots.md, "Weights for use
outside ddpkit"): ``final.safetensors`` (or ``final_weights.pt``), and the best epoch's in
``best.pt`` and ``best.safetensors``, each the plain model's state dict written whole on one rank.
``best.pt`` also holds the best ``epoch``, ``step``, ``metric`` and ``value``, which a resumed run
reads back."""

from __future__ import annotations

import functools
import importlib.util
import inspect
import io
import json
import warnings
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit.data import build_eval_loader
from ddpkit.distributed import Group
from ddpkit.distributed import _progress as marks
from ddpkit.distributed._collectives import broadcast_object
from ddpkit.distributed._runtime import Runtime, print0
from ddpkit.snapshot._codec import DTYPES, alone
from ddpkit.strategies._base import Strategy
from ddpkit.tracking._metrics import format_metrics
from ddpkit.training._config import EarlyStoppingConfig, TrainerConfig
from ddpkit.training._evaluation import evaluate
from ddpkit.training._step import StopReason


def evaluate_with(
    strategy: Strategy,
    metrics: Callable[[nn.Module, Any], Mapping[str, Any]],
    autocast: Callable[[], Any],
    config: TrainerConfig,
    group: Group,
    data: Dataset,
    prefix: str = "test",
) -> dict[str, float]:
    """Exact metrics of a Trainer's model over ``data`` (every sample counted once), named
    ``prefix/metric``: its own evaluation loader, the strategy's evaluation mode, the run's metrics
    and precision. Bound to the Trainer's parts, never the Trainer: a reference cycle would leave a
    finished Trainer's loader workers to a garbage collection, in whatever thread it runs."""
    loader = build_eval_loader(
        data, config.eval_batch_size, num_workers=config.num_workers,
        collate_fn=config.collate_fn, group=group,
    )  # fmt: skip
    # fsdp: no collective per forward, as ranks' batch counts may differ
    with strategy.evaluation():
        results = evaluate(strategy.model, loader, metrics, group=group, autocast=autocast)
    return {f"{prefix}/{k}": v for k, v in results.items()}


class Validation:
    """Takes each validation's metrics to early stopping and the best weights; says when to validate
    and when training must stop."""

    def __init__(
        self,
        config: TrainerConfig,
        runtime: Runtime,
        val_data: Any,
        *,
        strategy: Strategy,
        metrics: Callable[[nn.Module, Any], Mapping[str, Any]] | None,
        autocast: Callable[[], Any],
        log: Callable[[str, int, dict[str, Any]], None],
        plateau: Any = None,
    ) -> None:
        """A Trainer's validation and weights files as ``config`` asks: early stopping, ``best.pt``
        and, in ``config.weights_format``, ``best.safetensors`` (or ``best_weights.pt``) and the
        final weights. :attr:`evaluator` evaluates ``strategy``'s model with ``metrics`` under
        ``autocast`` (:func:`evaluate_with`; None without ``metrics``); a validation is
        ``evaluator(val_data, "val")``.
        ``plateau``: a metric-driven LR scheduler (``ReduceLROnPlateau``), stepped at each
        validation with ``early_stopping.metric``'s value (before any snapshot of the step)."""
        # safetensors, or .pt without it
        self.weights_format, notice = resolve_format(config.weights_format)
        if notice is not None:
            print0(notice, group=runtime.group)
        if config.val_every_steps is not None and val_data is None:
            raise ConfigError(
                f"val_every_steps={config.val_every_steps} needs validation data: pass "
                "Trainer(..., val_data=...), or leave val_every_steps at None"
            )
        self.run_dir, self.is_main, self.group = config.phase_dir, runtime.is_main, runtime.group
        es = config.early_stopping
        self.early_stopping = EarlyStopping(es)
        self.best_weights = BestWeights(
            self.run_dir / "best.pt",
            es.metric,
            es.mode,
            enabled=runtime.is_main,
            export_path=weights_path(self.run_dir, "best", self.weights_format)
            if self.weights_format
            else None,
            export_format=self.weights_format,
        )
        self.best_weights.at_step = config.val_every_steps is not None
        self.val_data, self.model_weights, self.log = val_data, strategy.model_weights, log
        self.plateau = plateau
        self.every_steps = config.val_every_steps
        self.evaluator = (
            None
            if metrics is None
            else partial(evaluate_with, strategy, metrics, autocast, config, runtime.group)
        )
        """``evaluator(data, prefix)``: exact metrics over ``data``, named ``prefix/metric``."""
        self.evaluate = (
            partial(self.evaluator, val_data, "val")
            if val_data is not None and self.evaluator is not None
            else None
        )
        self.latest: dict[str, Any] = {}
        """The latest step-wise validation's metrics (``val/...``), which ``fit()`` returns with the
        epoch's."""
        self.latest_step: int | None = None

    @property
    def at_epoch_end(self) -> bool:
        """Validate at epoch ends (the default) rather than every ``every_steps`` optimizer
        steps."""
        return self.every_steps is None

    def due(self, step: int, taken: bool) -> bool:
        """True after an optimizer step that a step-wise validation follows. A skipped step leaves
        the step count where it was: the validation of that count followed the step that reached
        it."""
        return self.every_steps is not None and taken and step % self.every_steps == 0

    def state_dict(self) -> dict[str, Any]:
        """The latest step-wise validation, which ``fit()`` returns: kept by snapshots, so that a
        run resumed after it (and before the next) returns it too."""
        return {"latest": dict(self.latest), "latest_step": self.latest_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.latest, self.latest_step = dict(state["latest"]), state["latest_step"]

    def resume(self, group: Group) -> None:
        """Read the best so far: the file is on rank 0's disk, and every rank must know it to decide
        alike."""
        best = self.best_weights
        best.load()
        best.value, best.epoch, best.step = broadcast_object(
            (best.value, best.epoch, best.step), group=group
        )

    def update(self, metrics: Mapping[str, Any], epoch: int, step: int) -> None:
        """Count the metrics towards early stopping, keep the weights if best."""
        self.early_stopping.update(metrics)
        metric = self.early_stopping.config.metric
        if self.plateau is not None and metric is not None:
            # the same value on every rank: the same lr everywhere
            self.plateau.step(float(metrics[metric]))
        best = self.best_weights
        if best.update(metrics, self.model_weights, epoch, step) and best.metric is not None:
            event: dict[str, Any] = {
                "event": "best",
                "file": best.path.name,
                best.metric: best.value,
            }
            if best.export_path is not None and best.export_format is not None:
                event["weights"] = best.export_path.name
            self.log("event", step, event)

    def inside_epoch(self, epoch: int, step: int) -> dict[str, Any]:
        """``max_steps`` stopped the run inside an epoch: validate there, and count it towards the
        best weights and early stopping as an epoch's end would (else a short run ends with no val
        metrics and no best.pt). Nothing to do when validating every N steps (a run validates where
        those fall) or without validation data: {} then."""
        if not self.at_epoch_end or self.evaluate is None:
            return {}
        metrics = {"epoch": epoch, "step": step} | self.evaluate()
        self.update(metrics, epoch, step)
        self.log("val", step, metrics)
        return metrics

    def after_step(self, epoch: int, step: int) -> None:
        """Validate now (the step is due): record the metrics as a ``val`` record at ``step`` and
        count them (``early_stopping.should_stop`` then says whether training must stop)."""
        assert self.evaluate is not None  # __init__ refuses every_steps without validation data
        metrics = self.evaluate()
        self.latest, self.latest_step = dict(metrics), step
        self.log("val", step, {"epoch": epoch, **metrics})
        print0(f"step {step} {format_metrics(metrics)}", group=self.group)
        self.update(metrics, epoch, step)

    def save_final_weights(self, epoch: int, step: int, stopped_by: str | None) -> None:
        """``final.safetensors`` (or ``final_weights.pt``) in the run directory, when training ends:
        not after a stop signal, which is not an end. Every rank calls it (gathering the weights is
        a collective under fsdp)."""
        if stopped_by != StopReason.SIGNAL:
            save_final_weights(
                self.model_weights,
                self.run_dir,
                self.weights_format,
                is_main=self.is_main,
                epoch=epoch,
                step=step,
            )


def metric_driven(scheduler: Any) -> bool:
    """Whether ``scheduler.step()`` needs a metric (``ReduceLROnPlateau``, or one like it)."""
    if scheduler is None:
        return False
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        return True
    try:
        params = inspect.signature(scheduler.step).parameters
    except (TypeError, ValueError):
        return False
    metrics = params.get("metrics")
    return metrics is not None and metrics.default is inspect.Parameter.empty


def check_metric_driven(config: TrainerConfig, scheduler: Any, val_data: Any) -> None:
    name = type(scheduler).__name__
    if val_data is None:
        raise ConfigError(
            f"scheduler={name} steps on a validation metric: pass Trainer(..., val_data=...), or "
            "use a scheduler that steps without one"
        )
    if config.early_stopping.metric is None:
        raise ConfigError(
            f"scheduler={name} steps on a validation metric: name it with "
            "EarlyStoppingConfig(metric='val/loss', patience=None) (patience=None: no early "
            "stopping)"
        )


# -- Early stopping: ends training once the validation metric the best weights follow has not
# improved for `patience` validations.


class EarlyStopping:
    """Counts validations without improvement of ``config.metric`` (one per epoch, unless
    ``val_every_steps``); its state is part of every snapshot."""

    def __init__(self, config: EarlyStoppingConfig) -> None:
        self.config = config
        self.best: float | None = None
        """The best value of the metric so far."""
        self.bad_epochs = 0
        """Validations (epochs, by default) since it last improved; the name is kept for snapshots'
        sake."""

    @property
    def should_stop(self) -> bool:
        patience = self.config.patience
        return (
            self.config.metric is not None and patience is not None and self.bad_epochs >= patience
        )

    def update(self, metrics: Mapping[str, Any]) -> None:
        """Take an epoch's metrics (the same on every rank, so every rank decides alike)."""
        metric = self.config.metric
        if metric is None:
            return
        if metric not in metrics:
            raise ConfigError(
                f"early_stopping.metric={metric!r} is not among the epoch's metrics "
                f"{sorted(metrics)}: give the Trainer val_data, or name one of these"
            )
        value = float(metrics[metric])
        if is_better(value, self.best, self.config.mode):
            self.best, self.bad_epochs = value, 0
        else:
            self.bad_epochs += 1

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.bad_epochs = state["best"], int(state["bad_epochs"])


# -- The weights files for use outside ddpkit.

FORMATS = ("safetensors", "pt")


def weights_path(run_dir: Path, which: str, fmt: str) -> Path:
    """Where a run writes its ``final`` or ``best`` weights: ``final.safetensors``,
    ``best.safetensors``, or ``final_weights.pt``, ``best_weights.pt``."""
    return run_dir / (f"{which}.safetensors" if fmt == "safetensors" else f"{which}_weights.pt")


def safetensors_available() -> bool:
    return importlib.util.find_spec("safetensors") is not None


def resolve_format(requested: str | None) -> tuple[str | None, str | None]:
    """The format a run writes its weights in, and a notice when it is not the one asked for
    (``safetensors`` without the package falls back to ``pt``)."""
    if requested == "safetensors" and not safetensors_available():
        return "pt", (
            "ddpkit: the safetensors package is not installed, so the weights files are written "
            "with torch.save (.pt); pip install 'ddpkit[safetensors]' for .safetensors, or set "
            "weights_format='pt' to silence this"
        )
    return requested, None


def plain_tensors(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``state``'s tensors on the CPU, each owning its bytes, and ``{copied name: the name it shared
    memory with}``: a tensor sharing memory with an earlier one (a tied weight) is copied."""
    out: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    owners: dict[int, str] = {}  # a storage's address -> the first name that used it
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise ConfigError(
                f"the weights hold {name!r}, a {type(value).__name__}: only tensors can be written"
            )
        tensor = value.detach().to("cpu")
        address = tensor.untyped_storage().data_ptr() if tensor.numel() else 0
        if address and address in owners:
            tied[name] = owners[address]
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        elif address:
            owners[address] = name
        out[name] = alone(tensor)  # a view gets a copy of its own
    return out, tied


@functools.cache
def _safetensors_dtypes() -> frozenset[torch.dtype]:
    """The dtypes that the installed safetensors writes and reads back as they were (not
    float8_e8m0fnu, complex128)."""
    from safetensors.torch import load, save

    found = set()
    for dtype in DTYPES.values():
        try:
            with warnings.catch_warnings():  # torch warns on making a complex32 tensor: a probe's
                warnings.simplefilter("ignore")  # noise, not the user's
                probe = torch.zeros(2, dtype=dtype)
            if load(save({"x": probe}))["x"].dtype == dtype:
                found.add(dtype)
        except Exception:  # noqa: BLE001 - whatever safetensors raises for a dtype it lacks
            continue
    return frozenset(found)


def save_weights(
    path: Path, state: Mapping[str, Any], fmt: str, metadata: Mapping[str, Any] | None = None
) -> None:
    """Write ``state`` (a plain state dict) to ``path`` in format ``fmt``, whole or not at all, with
    ``metadata`` (JSON values) in a safetensors file's header (not in a ``pt`` file). One rank."""
    tensors, tied = plain_tensors(state)
    if fmt == "pt":
        buffer = io.BytesIO()
        torch.save(tensors, buffer)
        fs.write_atomic(path, buffer.getvalue())
        return
    if fmt != "safetensors":
        raise ConfigError(f"weights_format={fmt!r} is not valid: give one of {FORMATS} (or None)")
    from safetensors.torch import save

    for name, tensor in tensors.items():
        if tensor.dtype not in _safetensors_dtypes():
            raise ConfigError(
                f"the weights hold {name!r}, a tensor of dtype {tensor.dtype}, which a safetensors "
                "file cannot hold (or not read back): set weights_format='pt', or convert it to "
                "another dtype"
            )
    header = {"format": "pt"} | {k: json.dumps(v) for k, v in (metadata or {}).items()}
    if tied:
        header["tied"] = json.dumps(tied)
    fs.write_atomic(path, save(tensors, metadata=header))


def save_final_weights(
    weights: Callable[[], Mapping[str, Any]],
    run_dir: Path,
    fmt: str | None,
    *,
    is_main: bool,
    epoch: int,
    step: int,
) -> None:
    """``run_dir/final.safetensors`` (or ``final_weights.pt``) when training ends; nothing when
    ``fmt`` is None. Every rank calls it: ``weights()`` may be a collective (fsdp)."""
    if fmt is not None:
        state = weights()
        if is_main:  # alone, while the others go on to fit()'s last agreement
            with marks.phase(marks.Phase.EXPORT):
                save_weights(
                    weights_path(run_dir, "final", fmt), state, fmt, {"epoch": epoch, "step": step}
                )


def is_better(value: float, best: float | None, mode: str) -> bool:
    """True if ``value`` improves on ``best`` (None: nothing yet) in direction ``mode`` (``min`` or
    ``max``); an equal value does not (an epoch retrained after a crash gives it again)."""
    return best is None or (value < best if mode == "min" else value > best)


class BestWeights:
    """Writes ``path`` when ``metric`` improves (``mode`` ``min`` or ``max``), where ``enabled``."""

    def __init__(
        self,
        path: str | Path,
        metric: str | None,
        mode: str,
        enabled: bool,
        export_path: Path | None = None,
        export_format: str | None = None,
    ) -> None:
        # export_path: also write the weights alone there, in export_format
        self.path, self.metric, self.mode = Path(path), metric, mode
        self.export_path, self.export_format = export_path, export_format
        # Every rank tracks the best value (the epoch's metrics are agreed, so every rank decides
        # alike and can join the gather of sharded weights); only an enabled rank writes the file.
        self.enabled = enabled and metric is not None
        self.value: float | None = None
        self.epoch: int | None = None
        self.step: int | None = None
        self.at_step = False  # the best is a step's (validation every N steps): the summary says so

    def load(self) -> None:
        """Take the best so far from the file (for a resumed run only)."""
        if self.enabled and self.path.exists():
            saved = torch.load(self.path, weights_only=True)
            if saved.get("metric") == self.metric:
                self.value, self.epoch, self.step = (
                    saved["value"],
                    saved["epoch"],
                    saved.get("step"),
                )

    def update(
        self,
        metrics: Mapping[str, Any],
        weights: Callable[[], Mapping[str, torch.Tensor]],
        epoch: int,
        step: int,
    ) -> bool:
        """Save ``weights()`` if ``metrics[metric]`` beats the best so far; True if it did. Every
        rank calls it: ``weights()`` may be a collective (fsdp)."""
        metric = self.metric
        if metric is None:  # not tracking
            return False
        if metric not in metrics:
            raise ConfigError(
                f"early_stopping.metric={metric!r} is not among the epoch's metrics "
                f"{sorted(metrics)}"
            )
        value = float(metrics[metric])
        if not is_better(value, self.value, self.mode):
            return False
        self.value, self.epoch, self.step = value, epoch, step
        state = weights()
        if self.enabled:
            # rank 0 alone writes while the others wait: the stall watch's long allowance
            with marks.phase(marks.Phase.EXPORT):
                self._write(state, metric, value, epoch, step)
        return True

    def _write(
        self, state: Mapping[str, Any], metric: str, value: float, epoch: int, step: int
    ) -> None:
        state = {k: v.detach().cpu() for k, v in state.items()}
        info = {"epoch": epoch, "step": step, "metric": metric, "value": value}
        # best.pt last: a crash between the two leaves the old best value, whose beater writes both
        if self.export_path is not None and self.export_format is not None:
            save_weights(self.export_path, state, self.export_format, info)
        buffer = io.BytesIO()
        torch.save({"model": state, **info}, buffer)
        fs.write_atomic(self.path, buffer.getvalue())
