"""The resume tests' job (:mod:`tests.jobs.scripts.train_job`) with the values real runs keep:
Adam's learning rate from ``np.logspace`` (a numpy float64, which the scheduler keeps multiplying)
and a callback whose state holds a ``deque``, a ``Path``, a ``datetime`` and a numpy array. Rank
``--kill-rank`` SIGKILLs itself at ``--kill-step`` on the first attempt (once the snapshot in flight
is whole); with ``--out``, the final state is written there and each rank's callback state, with the
types it was loaded back as, to ``out.callback<r>``.

    python tests/jobs/scripts/codec_job.py RUN_DIR --out FILE
        [--kill-rank R --kill-step S --log DIR] [--before-codec]
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import io
import pathlib
from typing import Any

import numpy as np
import torch

import ddpkit
from tests.jobs.scripts.train_job import train

LR = np.logspace(-3, -1, 5)[3]  # what a sweep hands a trial: numpy.float64


class KeepsThings:
    """A callback that keeps, per rank, what callbacks keep: a window of recent numbers, a folder, a
    time and a running mean, each changed by every step, so that a state not restored shows in the
    final one."""

    def __init__(self) -> None:
        self.history: collections.deque[float] = collections.deque(maxlen=4)
        self.folder = pathlib.Path("/data/shards")
        self.when = dt.datetime(2026, 1, 1, 12, 0)
        self.mean = np.zeros(3)
        self.loaded_types: list[str] = []

    def on_step_end(self, trainer: Any, taken: bool, output: Any) -> None:
        rank = trainer.runtime.rank
        self.history.append(output.lr * trainer.step + rank)
        self.folder = self.folder.parent / f"shard-{trainer.step}-{rank}"
        self.when += dt.timedelta(seconds=trainer.step + rank)
        self.mean = 0.9 * self.mean + 0.1 * np.array(
            [output.lr, trainer.step, rank], dtype=np.float64
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "folder": self.folder,
            "when": self.when,
            "mean": self.mean,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded_types = [
            f"{k}: {type(v).__module__}.{type(v).__qualname__}" for k, v in state.items()
        ]
        self.history, self.folder, self.when, self.mean = (
            state[k] for k in ("history", "folder", "when", "mean")
        )


def before_the_codec() -> None:
    """The control: a snapshot's values written with ``torch.save`` (anything pickles) and read with
    ``torch.load(weights_only=True)``, as the disk snapshots did before
    :mod:`ddpkit.snapshot._codec`."""
    from ddpkit.snapshot import _codec as codec

    def file_bytes(value: Any, tensors: Any) -> bytes:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        return buffer.getvalue()

    codec.encode = lambda value, tensors, where="": value  # type: ignore[assignment]
    # a rank's own parts were kept as they were, and the run's settings compared as text
    codec.copied = lambda value, where="": value  # type: ignore[assignment]
    codec.fingerprint = lambda value: str(value)  # type: ignore[assignment]
    codec.file_bytes = file_bytes  # type: ignore[assignment]
    codec.read_file = lambda file, map_location=None: torch.load(
        file, map_location=map_location, weights_only=True
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("run_dir")
    p.add_argument("--out", required=True)
    p.add_argument("--kill-rank", type=int, default=None)
    p.add_argument("--kill-step", type=int, default=None)
    p.add_argument("--log", default=None)
    p.add_argument("--before-codec", action="store_true")
    a = p.parse_args()
    if a.before_codec:
        before_the_codec()
    callback = KeepsThings()
    train(
        a.run_dir,
        epochs=2,
        lr=LR,
        kill_rank=a.kill_rank,
        kill_step=a.kill_step,
        # the snapshot in flight is whole: the restart resumes from it, on disk
        kill_after_write=True,
        sample_log=a.log,
        callbacks=(callback,),
        out=a.out,
        weights_format=None,
    )
    rank = ddpkit.init().rank
    state = callback.state_dict() | {"loaded_types": callback.loaded_types}
    # read by the test with weights_only=False: its own file
    torch.save(state, f"{a.out}.callback{rank}")
    ddpkit.shutdown()
