"""The best model of a run: the weights of the epoch where a validation metric was best, kept apart.

Snapshots are the newest ``SnapshotConfig.keep`` only, so the best epoch's weights are usually
pruned by the time early stopping ends a run. ``run_dir/best.pt`` holds them, whatever is pruned, in
a form that loads without ddpkit::

    model.load_state_dict(torch.load("runs/digits/best.pt", weights_only=True)["model"])

The file also records ``epoch``, ``step``, ``metric`` and ``value``. A resumed run reads the best
value from it, so nothing of this lives in the snapshots; an epoch retrained after a crash gives the
same value again, and an equal value does not replace the file. ``resume=False`` moves the previous
run's file aside with its snapshots; a run that starts afresh otherwise ignores a file left by an
earlier run and replaces it at its first epoch. With ``TrainerConfig.weights_format`` (the default),
the same weights also go to ``run_dir/best.safetensors`` (or ``best_weights.pt``): the state dict
alone (:mod:`ddpkit.snapshot._export`).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit.distributed import _progress as marks
from ddpkit.snapshot import _export as export


def is_better(value: float, best: float | None, mode: str) -> bool:
    """True if ``value`` improves on ``best`` (None: nothing yet) in direction ``mode`` (``min`` or
    ``max``). An equal value does not: an epoch retrained after a crash gives the same value
    again."""
    return best is None or (value < best if mode == "min" else value > best)


class BestWeights:
    """Writes ``path`` when ``metric`` improves (``mode`` ``min`` or ``max``); only where
    ``enabled`` (rank 0)."""

    def __init__(
        self,
        path: str | Path,
        metric: str | None,
        mode: str,
        enabled: bool,
        export_path: Path | None = None,
        export_format: str | None = None,
    ) -> None:
        """``export_path``: also write the weights alone there, in ``export_format`` (see
        :mod:`ddpkit.snapshot._export`)."""
        self.path, self.metric, self.mode = Path(path), metric, mode
        self.export_path, self.export_format = export_path, export_format
        # Every rank tracks the best value (the epoch's metrics are agreed, so every rank decides
        # alike and can join the gather of sharded weights); only an enabled rank writes the file.
        self.tracking = metric is not None
        self.enabled = enabled and self.tracking
        self.value: float | None = None
        self.epoch: int | None = None
        self.step: int | None = None
        self.at_step = False
        """The best is a step's rather than an epoch's (validation every N steps): the summary says
        so."""

    def load(self) -> None:
        """Take the best so far from the file: for a resumed run only (a fresh one replaces a stale
        file)."""
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
        rank calls it: ``weights()`` may be a collective (the whole model gathered from its
        shards)."""
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
            # rank 0 alone writes (the others wait in the next collective): the stall watch's long
            # allowance
            with marks.phase(marks.Phase.EXPORT):
                self._write(state, metric, value, epoch, step)
        return True

    def _write(
        self, state: Mapping[str, Any], metric: str, value: float, epoch: int, step: int
    ) -> None:
        state = {k: v.detach().cpu() for k, v in state.items()}
        # The weights file first, best.pt last: a resume reads the best value from best.pt, so a
        # crash between the two leaves the old value there, and the step that beats it writes both
        # again.
        if self.export_path is not None and self.export_format is not None:
            info = {"epoch": epoch, "step": step, "metric": metric, "value": value}
            export.save_weights(self.export_path, state, self.export_format, info)
        buffer = io.BytesIO()
        torch.save(
            {"model": state, "epoch": epoch, "step": step, "metric": metric, "value": value}, buffer
        )
        # replaces a link at the name, never follows it
        fs.write_atomic(self.path, buffer.getvalue())
