"""One optimizer step after the micro-batches' backward: the strategy's verdict, clipping, the step, the scheduler.

Every rank reaches the same decision: the verdict comes from the synchronised gradients (and, under ``fsdp``,
one all-reduce over the shards), so a step is taken, skipped or stops training on every rank alike.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ddpkit.distributed.collectives import all_reduce
from ddpkit.errors import ConfigError
from ddpkit.snapshot.state import TrainState
from ddpkit.strategies import Strategy
from ddpkit.training.config import TrainerConfig
from ddpkit.training.loss_window import LossWindow


class OptimizerStep:
    """Clip and step when the synchronised gradients are finite; skip or stop everywhere alike when not.

    ``grad_norm`` is the global norm of the last step taken, before clipping (known only when clipping);
    ``step_norm`` that of the step just done, where the strategy computed it (clipping, or fsdp), and ``lr`` the
    learning rate it used (before a per-step scheduler moved it).
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
        group: Any,
    ) -> None:
        self.config, self.strategy, self.scheduler, self.scaler = config, strategy, scheduler, scaler
        self.state, self.log, self.group = state, log, group
        self.grad_norm: torch.Tensor | None = None
        self.step_norm: torch.Tensor | None = None
        self.lr = 0.0

    def begin(self) -> None:
        """Before the step's first forward: the gradients set to None.

        Here rather than after the previous step: what reached the gradients in between (a callback's backward
        through the model, as a GAN's generator step through its discriminator; a script's backward before
        ``fit()``) was otherwise added to this step's, silently. The forward still runs without them (peak memory
        lower by their size), and ``on_step_end`` callbacks see the step's own gradients. A check refusing
        leftover gradients instead would refuse that GAN step, and cost the same pass over the parameters.
        """
        self.strategy.optimizer.zero_grad(set_to_none=True)

    def __call__(self, window: LossWindow) -> bool:
        """True if the step was taken. The verdict costs a host sync per step (as a GradScaler's does)."""
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
            self.scaler.update()
        else:
            optimizer.step()
        # The gradients stay, for on_step_end callbacks to read, until the next step's begin().
        if self.scheduler is not None and cfg.scheduler_interval == "step":
            self.scheduler.step()
        self.state.step += 1
        return True

    def _nonfinite(self, window: LossWindow) -> bool:
        """Every rank is here at the same step (the gradients said so); find out why, then skip or stop."""
        state = self.state
        self.strategy.optimizer.zero_grad(set_to_none=True)
        self.strategy.model.zero_grad(set_to_none=True)  # parameters outside the optimizer too: no NaN stays
        # Rare, and entered by every rank together, so a collective is safe: how many ranks had a bad loss?
        bad_ranks = int(all_reduce(float(not window.step_is_finite()), group=self.group))
        if self.scaler is not None:
            self.scaler.update()  # the scaler saw the inf/NaN in unscale_: it lowers its scale
            if not bad_ranks:  # fp16 overflow with finite losses: routine, the scaler's business
                self.log("event", state.step, {"event": "fp16_overflow", "scale": self.scaler.get_scale()})
                return False
        what = f"non-finite loss on {bad_ranks} rank(s)" if bad_ranks else "non-finite gradients (losses finite)"
        if self.config.on_nonfinite == "stop":
            raise FloatingPointError(
                f"{what} at optimizer step {state.step} (epoch {state.epoch}); every rank stops here. Lower the "
                "learning rate, clip gradients (clip_grad_norm), or pass on_nonfinite='skip'"
            )
        state.skipped_steps += 1
        self.log("event", state.step, {"event": "skipped_nonfinite", "reason": what, "skipped": state.skipped_steps})
        return False


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
            f"scheduler={name} steps on a validation metric: pass Trainer(..., val_data=...), or use a scheduler "
            "that steps without one"
        )
    if config.early_stopping.metric is None:
        raise ConfigError(
            f"scheduler={name} steps on a validation metric: name it with "
            "EarlyStoppingConfig(metric='val/loss', patience=None) (patience=None: no early stopping)"
        )
