"""The Trainer's configuration: what to train for, how, and where to write; checked where it is given."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ddpkit.errors import ConfigError
from ddpkit.strategies import strategy_config


@dataclass(kw_only=True)
class TrainerConfig:
    """How to train. Written to ``run_dir/config.json`` with the run's world size and versions."""

    run_dir: str = "runs/default"
    """Folder for snapshots, metrics and the resolved config; a run resumes from the snapshots found here."""
    epochs: int = 1
    max_steps: int | None = None
    """Stop after this many optimizer steps in all (a snapshot is taken first)."""
    batch_size: int | None = None
    """Samples per rank per micro-batch. Give this or ``global_batch_size``."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all ranks; fixed across world sizes, so a resume at another world size
    sees the same batches. Must divide by world size x ``grad_accum_steps``."""
    eval_batch_size: int = 256
    seed: int = 0
    """Seeds the sample order; the model's initial weights are the script's business (seed before building)."""
    shuffle: bool = True
    drop_last: bool = True
    num_workers: int | None = None
    """Loader workers per rank; default: cores per rank minus one."""
    grad_accum_steps: int = 1
    clip_grad_norm: float | None = None
    precision: str = "fp32"
    """``fp32``, ``bf16`` (autocast), or ``fp16`` (autocast with a GradScaler; meant for CUDA, and runs on the
    CPU too, where bf16 is the better choice). A step whose fp16 gradients overflow is skipped by the scaler,
    which lowers its scale; it is logged as ``fp16_overflow`` and is not counted as a non-finite loss."""
    sync_batchnorm: bool = False
    global_batch_dropout: bool = False
    """Replace ``nn.Dropout`` by :class:`~ddpkit.nn.dropout.GlobalBatchDropout`, whose masks do not depend on the
    world size: with ``sync_batchnorm``, N ranks then train the same model as one process, and a resume at
    another world size continues with the same masks."""
    scheduler_interval: str = "epoch"
    """Step the LR scheduler every ``epoch`` (after validation) or every optimizer ``step``."""
    on_nonfinite: str = "stop"
    """A NaN/inf loss on any rank, or NaN/inf gradients: ``stop`` (every rank raises at that step) or ``skip``
    the step everywhere."""
    snapshot_every_steps: int | None = None
    snapshot_every_epochs: int = 1
    """0 turns epoch-end snapshots off."""
    keep_snapshots: int = 2
    resume: bool = True
    early_stopping_metric: str | None = None
    """A validation metric such as ``val/loss``; training stops when it has not improved for ``patience`` epochs."""
    early_stopping_mode: str = "min"
    """``min`` or ``max``: the direction in which ``early_stopping_metric`` and ``best_metric`` improve."""
    early_stopping_patience: int = 5
    best_metric: str | None = None
    """Keep the weights of the epoch where this validation metric was best in ``run_dir/best.pt``, apart from
    the snapshots (which keep only the newest). Default: ``early_stopping_metric``."""
    log_every_steps: int = 20
    """How often ranks agree (one small all-reduce) on the mean training loss, which is then logged, and on a
    SIGTERM/SIGUSR1 received by any rank: a stop signal is acted on within this many steps."""
    progress: bool = True
    tensorboard: bool = False
    loggers: tuple[str, ...] = ()
    """Also send the records to ``"mlflow"`` and/or ``"wandb"`` (optional extras; local file store / offline
    without a server or an account): see :mod:`ddpkit.tracking.trackers`."""
    raise_on_stop_signal: bool = True
    """After a SIGTERM/SIGUSR1 stopped training and the snapshot is saved, ``fit()`` raises
    :class:`ddpkit.Preempted` (uncaught: exit code 75, "pre-empted, requeue me"), so a script cannot go on as if
    training were complete. False: ``fit()`` returns, with ``trainer.stopped_by == "signal"``."""
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    strategy: str = "ddp"
    """How the model is spread over ranks: ``ddp`` (replicated), ``zero`` (DDP with optimizer state sharded),
    ``fsdp`` (parameters, gradients and optimizer state sharded); see :mod:`ddpkit.strategies`."""
    strategy_options: dict[str, Any] = field(default_factory=dict)
    """Options of the strategy, by name: the fields of ``DDPConfig``, ``ZeroConfig`` or ``FSDPConfig``
    (e.g. ``{"bucket_cap_mb": 50, "comm_hook": "bf16"}`` or ``{"shard_blocks": ["Block"]}``)."""
    snapshot_async: bool = True
    """Write snapshots in a background thread: the step waits only while the state is copied to host memory."""

    def __post_init__(self) -> None:
        if (self.batch_size is None) == (self.global_batch_size is None):
            raise ConfigError("give exactly one of batch_size (per rank) and global_batch_size")
        if "process_group" in self.ddp_kwargs:
            # A process group cannot be copied into config.json or a snapshot, and the sampler, evaluation and
            # metrics must follow it too, not only DDP.
            raise ConfigError("pass the process group as Trainer(..., group=...), not in ddp_kwargs")
        strategy_config(self.strategy, self.strategy_options)  # names a bad strategy or option
        if self.strategy == "fsdp" and self.precision == "fp16":
            raise ConfigError("precision='fp16' (a GradScaler) is not supported with strategy 'fsdp': use "
                              "precision='bf16', or strategy_options={'param_dtype': 'bf16'}")
        checks = {
            "epochs": self.epochs >= 1,
            "grad_accum_steps": self.grad_accum_steps >= 1,
            "keep_snapshots": self.keep_snapshots >= 1,
            "precision": self.precision in ("fp32", "bf16", "fp16"),
            "scheduler_interval": self.scheduler_interval in ("epoch", "step"),
            "on_nonfinite": self.on_nonfinite in ("stop", "skip"),
            "early_stopping_mode": self.early_stopping_mode in ("min", "max"),
            "snapshot_every_steps": self.snapshot_every_steps is None or self.snapshot_every_steps >= 1,
            "max_steps": self.max_steps is None or self.max_steps >= 1,
            "batch_size": self.batch_size is None or self.batch_size >= 1,
            "global_batch_size": self.global_batch_size is None or self.global_batch_size >= 1,
            "eval_batch_size": self.eval_batch_size >= 1,
            "num_workers": self.num_workers is None or self.num_workers >= 0,
            "log_every_steps": self.log_every_steps >= 1,
            "snapshot_every_epochs": self.snapshot_every_epochs >= 0,
            "early_stopping_patience": self.early_stopping_patience >= 1,
            "loggers": set(self.loggers) <= {"mlflow", "wandb"} and not isinstance(self.loggers, str),
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not valid: see TrainerConfig.{name}")
        # The world size is known only when the Trainer is built; the accumulation steps are known now.
        if self.global_batch_size is not None and self.global_batch_size % self.grad_accum_steps:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} does not divide into grad_accum_steps="
                f"{self.grad_accum_steps} micro-batches: pick a multiple of {self.grad_accum_steps} (times the "
                "world size)"
            )

    def per_rank_batch(self, world_size: int) -> int:
        if self.batch_size is not None:
            return self.batch_size
        assert self.global_batch_size is not None
        parts = world_size * self.grad_accum_steps
        if self.global_batch_size % parts:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} does not divide over {world_size} ranks x "
                f"{self.grad_accum_steps} accumulation steps: pick a multiple of {parts}"
            )
        return self.global_batch_size // parts
