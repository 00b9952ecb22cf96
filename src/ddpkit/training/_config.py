"""The Trainer's configuration: what to train for, how, and where to write; checked where it is
given.

One typed config per concern, nested the way the run directory and the docs group them::

    TrainerConfig(
        run_dir="runs/digits", epochs=8, batch_size=32,
        strategy=DDPConfig(bucket_cap_mb=50),  # or "ddp", ZeroConfig(), FSDPConfig()
        snapshot=SnapshotConfig(every_steps=100),
        early_stopping=EarlyStoppingConfig(metric="val/loss", patience=5),
        logging=LoggingConfig(every_steps=20, tensorboard=True),
    )
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from ddpkit._errors import ConfigError, check_types
from ddpkit._errors import check_fields as _check
from ddpkit.data._fingerprint import OnDataChange
from ddpkit.snapshot._run_dir import RUN_FILES
from ddpkit.snapshot._state import NewRankState, SnapshotConfig
from ddpkit.strategies import StrategyConfig, strategy_config


@dataclass(kw_only=True)
class EarlyStoppingConfig:
    """The validation metric that says which epoch is best: ``run_dir/best.pt`` keeps that epoch's
    weights, and training stops once it has not improved for ``patience`` epochs. With
    ``TrainerConfig.val_every_steps``, read "validation" for "epoch": the best is a step, and
    patience counts validations."""

    metric: str | None = None
    """A validation metric such as ``val/loss`` (None: no best weights, no early stopping)."""
    mode: Literal["min", "max"] = "min"
    """``min`` or ``max``: the direction in which ``metric`` improves."""
    patience: int | None = 5
    """Epochs (or validations, with ``val_every_steps``) without improvement before training stops;
    None keeps the best weights without stopping."""

    def __post_init__(self) -> None:
        check_types(self)
        _check(self, {"patience": self.patience is None or self.patience >= 1})


@dataclass(kw_only=True)
class LoggingConfig:
    """What the main rank records and shows while training."""

    every_steps: int = 20
    """How often ranks agree (one small all-gather) on the mean training loss, which is then logged,
    and on a SIGTERM/SIGUSR1 received by any rank: a stop signal is acted on within this many
    steps."""
    progress: bool = True
    """A progress bar on a terminal (plain lines otherwise), on the main rank."""
    tensorboard: bool = False
    """Also write TensorBoard events to ``run_dir/tensorboard``."""
    trackers: tuple[str, ...] = ()
    """Also send the records to ``"mlflow"`` and/or ``"wandb"`` (optional extras; local file store /
    offline without a server or an account): see :mod:`ddpkit.tracking._trackers`."""
    step_timings: bool = True
    """Time each rank's steps (data, compute, communication wait, optimizer, snapshot) and gather
    them at each log window (one all-gather of a few numbers per rank, beside the loss's
    all-reduce): a ``ranks`` record naming the slowest rank, samples (and tokens) a second, MFU
    where the device's peak is known. See docs/speed.md."""
    peak_flops: float | None = None
    """One device's peak FLOP/s, for MFU on a device not in :mod:`ddpkit.tracking._speed`' table."""

    def __post_init__(self) -> None:
        check_types(self)
        self.trackers = (self.trackers,) if isinstance(self.trackers, str) else tuple(self.trackers)
        _check(
            self,
            {
                "every_steps": self.every_steps >= 1,
                "trackers": set(self.trackers) <= {"mlflow", "wandb"},
                "peak_flops": self.peak_flops is None or self.peak_flops > 0,
            },
        )


@dataclass(kw_only=True)
class TrainerConfig:
    """How to train. Written to ``run_dir/config.json`` with the run's world size and versions."""

    run_dir: str = "runs/default"
    """Folder for snapshots, metrics and the resolved config; a run resumes from the snapshots found
    here."""
    phase: str | None = None
    """One of several trainings in one script (a teacher, then students distilled from it): its
    snapshots, records and files go to ``run_dir/<phase>/``, a plain folder name. ``fit()`` of a
    phase that finished (the script run again after a restart) trains nothing: it restores the
    phase's final state into the models and returns its final metrics."""
    epochs: int = 1
    max_steps: int | None = None
    """Stop after this many optimizer steps in all (a snapshot is taken first)."""
    batch_size: int | None = None
    """Samples per rank per micro-batch. Give this or ``global_batch_size``."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all ranks; fixed across world sizes, so a resume at another
    world size sees the same batches. Must divide by world size x ``grad_accum_steps``."""
    eval_batch_size: int = 256
    seed: int = 0
    """Seeds the sample order; the model's initial weights are the script's business (seed before
    building)."""
    shuffle: bool = True
    drop_last: bool = True
    num_workers: int | None = None
    """Loader workers per rank; default: cores per rank minus one."""
    collate_fn: Callable[[list[Any]], Any] | None = None
    """Merges a list of samples into a batch (a ``DataLoader``'s ``collate_fn``: padding
    variable-length sequences) in the Trainer's loaders: training, validation and
    ``trainer.evaluate()``; None: torch's default collate. Recorded by its ``__qualname__``, which a
    resume compares."""
    on_data_change: OnDataChange = "error"
    """A resume over data changed in what decides which sample comes at which step (the dataset's
    length, a stream's files, their sizes and order, the window, seed, shuffle, drop_last, the
    global batch): ``error`` refuses it before any step, naming each change; ``restart_epoch``
    trains the snapshot's epoch again from its first step on the new data
    (:mod:`ddpkit.data._fingerprint`)."""
    new_rank_state: NewRankState = "refuse"
    """What a rank beyond the snapshot's world size gets, on a resume at more ranks, for each part a
    rank keeps its own of (a stateful callback, an ``extra_state`` entry): ``refuse`` the resume,
    naming the parts; ``copy`` rank 0's state (for state that is the same on every rank, such as a
    model kept in ``extra_state``); or start it ``fresh``, with a warning naming the parts. A part's
    own ``new_rank_state`` attribute overrides it; a part with ``load_rank_states(states, rank)``
    (the loss window) decides for itself."""
    seed_samples: bool = True
    """Each sample's random draws while loading (augmentation) depend on ``(seed, epoch, index)``
    only, whichever rank or worker loads it (:class:`~ddpkit.data.SeededSamples`). False leaves the
    draws to each loading process's own stream, as a plain DataLoader does."""
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """``fp32``, ``bf16`` (autocast), or ``fp16`` (autocast with a GradScaler; meant for CUDA, and
    runs on the CPU too, where bf16 is the better choice). A step whose fp16 gradients overflow is
    skipped by the scaler, which lowers its scale; it is logged as ``fp16_overflow`` and is not
    counted as a non-finite loss."""
    compile: bool = False
    """``torch.compile`` the training forward, after the strategy wrapped the model
    (docs/language-models.md); on the CPU inductor needs a C++ compiler."""
    sync_batchnorm: bool = False
    global_batch_dropout: bool = False
    """Replace ``nn.Dropout`` by :class:`~ddpkit.nn._dropout.GlobalBatchDropout`, whose masks do not
    depend on the world size (every model's under ``step_fn``): with ``sync_batchnorm``, N ranks
    then train the same model as one process, and a resume at another world size too."""
    val_every_steps: int | None = None
    """Validate on ``val_data`` after every this many optimizer steps (counted over the run) instead
    of at epoch ends; early stopping then counts validations, and the best weights are a step's.
    Recorded as ``val`` records in ``metrics.jsonl``."""
    weights_format: Literal["safetensors", "pt"] | None = "safetensors"
    """Also write the plain model's weights, whole (gathered from the shards under fsdp), for use
    outside ddpkit: ``run_dir/final.safetensors`` when training ends (not on a stop signal) and
    ``best.safetensors`` with ``best.pt``. ``pt``: ``final_weights.pt`` and ``best_weights.pt``
    (torch.save of the state dict); None: neither. ``safetensors`` without the package installed
    falls back to ``pt``, saying so."""
    scheduler_interval: Literal["epoch", "step"] = "epoch"
    """Step the LR scheduler every ``epoch`` (after validation) or every optimizer ``step``."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """A NaN/inf loss on any rank, or NaN/inf gradients: ``stop`` (every rank raises at that step)
    or ``skip`` the step everywhere."""
    resume: bool = True
    """Resume from the newest whole snapshot in ``run_dir``; False moves the previous run aside and
    starts afresh."""
    raise_on_stop_signal: bool = True
    """After a SIGTERM/SIGUSR1 stopped training and the snapshot is saved, ``fit()`` raises
    :class:`ddpkit.Preempted` (uncaught: exit code 75, "pre-empted, requeue me"). False: ``fit()``
    returns, with ``trainer.stopped_by == "signal"``."""
    strategy: str | StrategyConfig = "ddp"
    """How the model is spread over ranks: ``ddp`` (replicated), ``zero`` (DDP with optimizer state
    sharded), ``fsdp`` (parameters, gradients and optimizer state sharded), by name or as its config
    with options (:class:`~ddpkit.strategies.DDPConfig`, :class:`~ddpkit.strategies.ZeroConfig`,
    :class:`~ddpkit.strategies.FSDPConfig`). A name becomes its config with the defaults."""
    snapshot: SnapshotConfig = field(default_factory=SnapshotConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        check_types(self)
        if self.phase is not None and (
            not re.fullmatch(r"[\w-][\w.-]*", self.phase, re.ASCII) or self.phase in RUN_FILES
        ):
            raise ConfigError(
                f"phase={self.phase!r}: give a plain folder name for run_dir/<phase>/ (letters, "
                "digits, _ . -, not starting with a dot, not a name the run writes: "
                f"{', '.join(RUN_FILES[:3])}, ...)"
            )
        if (self.batch_size is None) == (self.global_batch_size is None):
            raise ConfigError("give exactly one of batch_size (per rank) and global_batch_size")
        self.strategy = strategy_config(self.strategy)  # names a bad strategy
        if self.strategy.name == "fsdp" and self.precision == "fp16":
            raise ConfigError(
                "precision='fp16' (a GradScaler) is not supported with strategy 'fsdp': use "
                "precision='bf16', or FSDPConfig(param_dtype='bf16')"
            )
        _check(
            self,
            {
                "epochs": self.epochs >= 1,
                "grad_accum_steps": self.grad_accum_steps >= 1,
                "max_steps": self.max_steps is None or self.max_steps >= 1,
                "batch_size": self.batch_size is None or self.batch_size >= 1,
                "global_batch_size": self.global_batch_size is None or self.global_batch_size >= 1,
                "eval_batch_size": self.eval_batch_size >= 1,
                "num_workers": self.num_workers is None or self.num_workers >= 0,
                "val_every_steps": self.val_every_steps is None or self.val_every_steps >= 1,
            },
        )
        # (the world size is known only when the Trainer is built)
        if self.global_batch_size is not None and self.global_batch_size % self.grad_accum_steps:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} does not divide into "
                f"grad_accum_steps={self.grad_accum_steps} micro-batches: pick a multiple of "
                f"{self.grad_accum_steps} (times the world size)"
            )

    @property
    def phase_dir(self) -> Path:
        """Where this training writes: ``run_dir/<phase>``, or ``run_dir`` without a phase."""
        return Path(self.run_dir, self.phase or "")

    def per_rank_batch(self, world_size: int) -> int:
        if self.batch_size is not None:
            return self.batch_size
        assert self.global_batch_size is not None
        parts = world_size * self.grad_accum_steps
        if self.global_batch_size % parts:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} does not divide over {world_size} "
                f"ranks x {self.grad_accum_steps} accumulation steps: pick a multiple of {parts}"
            )
        return self.global_batch_size // parts

    def loader_args(self, world_size: int) -> dict[str, Any]:
        """:func:`~ddpkit.build_loader`'s arguments for the training data on ``world_size``
        ranks."""
        return {
            "batch_size": self.per_rank_batch(world_size), "shuffle": self.shuffle,
            "seed": self.seed, "drop_last": self.drop_last, "num_workers": self.num_workers,
            "collate_fn": self.collate_fn, "seed_samples": self.seed_samples,
            "on_data_change": self.on_data_change,
        }  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        """The config as JSON values, nested as it is; the strategy as its name and options."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.collate_fn is not None:
            # its name: repr() holds an address, which differs from process to process
            out["collate_fn"] = getattr(
                self.collate_fn, "__qualname__", type(self.collate_fn).__qualname__
            )
        # the config __post_init__ made of a name: returned as it is
        strategy = strategy_config(self.strategy)
        out["strategy"] = {"name": strategy.name, **asdict(strategy)}
        for name in ("snapshot", "early_stopping", "logging"):
            out[name] = asdict(out[name])
        return json.loads(json.dumps(out, default=str))
