"""What the main rank shows while a run trains: a progress bar (or plain lines), and the summary at
its end."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


class Progress:
    """A tqdm bar on the main rank when stdout is a terminal; otherwise a plain line each time there
    is news.

    ``update()`` is called once per optimizer step; ``postfix`` (loss, speed) comes only every so
    many steps, when the ranks have agreed on it, and a plain line is printed then.
    """

    def __init__(self, enabled: bool, total: int, desc: str, initial: int = 0) -> None:
        self.enabled, self.total, self.desc = enabled, total, desc
        self.count = initial
        self._bar = None
        if enabled and sys.stdout.isatty():
            try:
                from tqdm.auto import tqdm

                # Kept on screen when done: one line per epoch, with its time; tqdm shows the ETA
                # while running.
                self._bar = tqdm(
                    total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True
                )
            except ImportError:
                pass

    def update(self, postfix: dict[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        self.count += 1
        if self._bar is not None:
            self._bar.update(1)
        if not postfix:
            return
        text = " ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in postfix.items()
        )
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
        else:
            print(f"{self.desc} {self.count}/{self.total} {text}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def format_metrics(metrics: dict[str, Any]) -> str:
    return " ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()
    )


def run_summary(
    reason: str,
    state: Any,
    last: dict[str, Any],
    validation: Any,
    run_dir: Path,
    speed: str | None = None,
) -> str:
    """The end of a run in a few lines: why it stopped, the best epoch, the final metrics, where the
    weights are.

    ``state``: where training ended (``epoch``, ``step``, and ``cursor``, not 0 inside an epoch:
    ``max_steps``). ``validation``: the run's :class:`~ddpkit.training._validation.Validation`: its
    ``best_weights`` (read on the main rank, which prints this), and ``latest_step``, the step of
    the latest validation when the Trainer validates every N steps (its ``val/...`` metrics in
    ``last`` are shown with it: they may be older than the end). ``speed``: a line on the ranks'
    speed (:meth:`~ddpkit.tracking._timings.RunSpeed.summary`), if any.
    """
    best, validated_at = validation.best_weights, validation.latest_step
    epoch, step = state.epoch, state.step
    where = (
        f"{step} optimizer steps, in epoch {epoch + 1}"
        if state.cursor
        else f"{epoch} epoch(s), {step} optimizer steps"
    )
    lines = [f"ddpkit: done ({reason}) after {where}"]
    if best.enabled and best.value is not None:
        at = f"step {best.step}" if best.at_step else f"epoch {best.epoch}"
        lines.append(f"  best {best.metric} {best.value:.4g} at {at}: weights in {best.path}")
    if last:
        final = {k: v for k, v in last.items() if k not in ("epoch", "step")}
        validated = {
            k: final.pop(k)
            for k in list(final)
            if validated_at is not None and k.startswith("val/")
        }
        if final:
            lines.append(f"  final: {format_metrics(final)}")
        if validated:
            lines.append(
                f"  latest validation, at step {validated_at}: {format_metrics(validated)}"
            )
    if speed:
        lines.append(speed)
    lines.append(f"  run directory {run_dir}: snapshots/, metrics.jsonl, epochs.csv")
    return "\n".join(lines)
