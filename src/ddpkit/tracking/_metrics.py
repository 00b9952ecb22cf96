"""What the main rank writes and shows about a run: metrics as JSON lines and CSV (and TensorBoard
or a tracker if asked), a progress bar or plain lines, and the summary at its end."""

from __future__ import annotations

import csv
import json
import math
import multiprocessing.util
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from ddpkit import _fs as fs
from ddpkit.tracking._trackers import build, need


class MetricsWriter:
    """Appends records to ``run_dir/metrics.jsonl``, epoch summaries to ``run_dir/epochs.csv``, on
    the main rank (elsewhere it does nothing). Files are opened for appending at the first record,
    never through a link, and a file with a second name is first given a copy of its own.

    Its state (:meth:`state_dict`) is where the files end: a resume from a snapshot moves the loop's
    records written after it to ``metrics.rewound.jsonl``, so that ``metrics.jsonl`` reads as the
    uninterrupted run's.
    """

    FILES = ("metrics.jsonl", "epochs.csv")
    REWOUND = "metrics.rewound.jsonl"

    def __init__(
        self,
        run_dir: str | Path,
        enabled: bool,
        tensorboard: bool = False,
        loggers: Sequence[str] = (),
        params: dict[str, Any] | None = None,
    ) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self._tensorboard, self._logger_names = tensorboard, tuple(loggers)
        self._params = params or {}
        self._jsonl: IO[str] | None = None
        self._tb = None
        self._loggers: list[Any] = []
        self.rewound = 0
        """Records the last :meth:`load_state_dict` moved to ``metrics.rewound.jsonl``."""
        self.fault: tuple[str, int, str] | None = None
        """The first write of the run directory that failed: (file, errno, reason)."""
        if not enabled:
            return
        fs.make_dirs(self.run_dir)
        # a missing extra is named when the Trainer is built
        if tensorboard:
            _summary_writer()
        for name in self._logger_names:
            need(name)

    def _open(self) -> IO[str]:
        if self._jsonl is None:
            fs.make_dirs(self.run_dir)
            self._jsonl = fs.open_append(self.run_dir / "metrics.jsonl", linked="replace")
        if self._tensorboard and self._tb is None:  # also after a load_state_dict closed it
            self._tb = _summary_writer()(str(self.run_dir / "tensorboard"))
        if self._logger_names and not self._loggers:  # once: each is a run of its own
            self._loggers = build(self._logger_names, self.run_dir, self._params)
            # closed at exit, also under multiprocessing (no atexit there), or when collected
            multiprocessing.util.Finalize(self, _close_all, args=(self._loggers,), exitpriority=10)
        return self._jsonl

    def record_fault(self, path: Path, err: OSError) -> None:
        """A write of the run directory failed (the main rank's): the first is kept for the ranks'
        next agreement to stop every rank with (:attr:`fault`), and records stop."""
        if self.fault is None:
            self.fault = (str(path), err.errno or 0, err.strerror or str(err))
        self.enabled = False

    def log(self, kind: str, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"kind": kind, "step": step, "time": round(time.time(), 3), **values}
        try:
            self._open().write(json.dumps(record, default=float) + "\n")
        except OSError as err:
            self.record_fault(self.run_dir / "metrics.jsonl", err)
            return
        # events, and the per-rank lists of "ranks" records, are not curves
        if kind in ("event", "ranks") or not (self._tb is not None or self._loggers):
            return
        scalars = {  # epoch and step are the x-axes, not curves
            k: float(v)
            for k, v in values.items()
            if k not in ("epoch", "step") and isinstance(v, (int, float)) and math.isfinite(v)
        }
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
        for logger in self._loggers:
            logger.log(step, scalars)

    def flush(self) -> None:
        """Push TensorBoard's buffered events to disk (it writes every two minutes otherwise)."""
        if self._tb is not None:
            self._tb.flush()

    def epoch_end(self, step: int, values: dict[str, Any]) -> None:
        """An epoch's record, its row in the CSV, and everything pushed to disk."""
        self.log("epoch", step, values)
        self.epoch_row(values)
        self.flush()

    def epoch_row(self, values: dict[str, Any]) -> None:
        """One CSV row per epoch; the columns are those of the first row written to the file."""
        if not self.enabled:
            return
        try:
            self._open()
            with fs.open_append(self.run_dir / "epochs.csv", read=True, linked="replace") as f:
                f.seek(0)
                header = next(csv.reader(f), None)
                columns = header or list(values)
                writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
                if header is None:
                    writer.writeheader()
                writer.writerow(values)
        except OSError as err:
            self.record_fault(self.run_dir / "epochs.csv", err)

    def last_epoch(self) -> dict[str, Any]:
        """The values of the newest ``epoch`` record (the main rank's; empty elsewhere), as the
        epoch's end gave them to ``fit()``."""
        path, last = self.run_dir / "metrics.jsonl", {}
        for line in fs.read_bytes(path).splitlines() if self.enabled and path.exists() else ():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut short by a kill
            if isinstance(record, dict) and record.get("kind") == "epoch":
                last = record
        return {k: v for k, v in last.items() if k not in ("kind", "time", "epoch_seconds")}

    def state_dict(self) -> dict[str, int]:
        """The size of each file now (the main rank's; empty on the others)."""
        return {name: _size(self.run_dir / name) for name in self.FILES} if self.enabled else {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Cut each file back to its size in ``state``: the loop's records written past it (written
        again by the resumed run) move to ``metrics.rewound.jsonl`` (:attr:`rewound`: how many);
        the others (a stop, a notice, a script's own records) stay."""
        self.rewound = 0
        if not self.enabled or not state:
            return
        self.close()
        for name in self.FILES:
            path, size = self.run_dir / name, int(state.get(name, 0))
            if _size(path) <= size:  # none, or nothing past the snapshot
                continue
            kept = b""
            if name == "metrics.jsonl":
                tail = fs.read_bytes(path)[size:].splitlines(keepends=True)
                again = [line for line in tail if _written_again(line)]
                kept = b"".join(line for line in tail if not _written_again(line))
                self.rewound = len(again)
                with fs.open_append(self.run_dir / self.REWOUND, linked="replace") as f:
                    f.write(b"".join(again).decode("utf-8", "replace"))
            fs.truncate(path, size, linked="replace")
            if kept:
                with fs.open_append(path, linked="replace") as f:
                    f.write(kept.decode("utf-8", "replace"))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _size(path: Path) -> int:
    """The size of the file at ``path`` (not through a link); 0 when there is none."""
    try:
        return os.stat(path, follow_symlinks=False).st_size
    except FileNotFoundError:
        return 0


_LOOP_KINDS = ("train", "epoch", "val", "ranks", "event")
_KEPT_EVENTS = ("stop", "preemption_notice", "start", "resume")


def _written_again(line: bytes) -> bool:
    """Whether a record is the training loop's, which a run resumed before it writes again."""
    try:
        record = json.loads(line)
    except ValueError:
        return True  # a line cut short by the kill
    kind = record.get("kind") if isinstance(record, dict) else None
    if kind not in _LOOP_KINDS:
        return False
    return kind != "event" or record.get("event") not in _KEPT_EVENTS


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:  # pragma: no cover - depends on the optional extra
        raise ImportError("tensorboard=True needs `pip install 'ddpkit[tensorboard]'`") from err
    return SummaryWriter


def _close_all(loggers: list[Any]) -> None:
    for logger in loggers:
        logger.close()


class Progress:
    """A tqdm bar on the main rank when stdout is a terminal, otherwise a plain line each time
    there is news: ``update()`` once per optimizer step, with a ``postfix`` (loss, speed) every so
    many."""

    def __init__(self, enabled: bool, total: int, desc: str, initial: int = 0) -> None:
        self.enabled, self.total, self.desc = enabled, total, desc
        self.count = initial
        self._bar = None
        if enabled and sys.stdout.isatty():
            try:
                from tqdm.auto import tqdm

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
        text = format_metrics(postfix)
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
    weights are. ``state``: where training ended (``cursor`` not 0 inside an epoch).
    ``validation``: the run's :class:`~ddpkit.training._validation.Validation` (``best_weights``,
    and ``latest_step``, whose ``val/...`` metrics may be older than the end). ``speed``: the ranks'
    line (:meth:`~ddpkit.tracking._speed.RunSpeed.summary`), if any."""
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
