"""Where training stands: the counters a snapshot restores next to the model and optimizer, and the random
streams of every rank."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any

import torch

from ddpkit.distributed.collectives import gather_object
from ddpkit.distributed.runtime import Runtime
from ddpkit.distributed.seeding import rng_state, set_rng_state, stream_seed


class StopReason(str, Enum):
    """Why ``fit()`` ended (``trainer.stopped_by``); a callback may stop training with a reason of its own."""

    EPOCHS = "epochs"
    MAX_STEPS = "max_steps"
    EARLY_STOPPING = "early_stopping"
    SIGNAL = "signal"

    def __str__(self) -> str:
        return self.value


@dataclass
class TrainState:
    """The Trainer's counters."""

    epoch: int = 0
    """Epochs completed."""
    step: int = 0
    """Optimizer steps taken."""
    cursor: int = 0
    """Samples of the current epoch already trained on, over all ranks (a whole number of global batches)."""
    skipped_steps: int = 0
    """Steps skipped for a non-finite loss or non-finite gradients (not fp16 overflows)."""

    @property
    def position(self) -> tuple[int, int, int]:
        return self.epoch, self.step, self.cursor

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):
            setattr(self, f.name, int(state[f.name]))


class RankStreams:
    """Every rank's random streams (python, numpy, torch CPU and CUDA) and its loader's generator.

    ``state_dict()`` gathers them (a collective). At the same world size each rank gets its own back and the
    run continues bit for bit; at another, rank ``r``'s stream has no counterpart in the old run, so each is
    reseeded from ``(seed, step, rank)``: reproducible, and equal to the uninterrupted run only within tolerance.
    """

    def __init__(self, runtime: Runtime, generator: torch.Generator, seed: int, train: TrainState) -> None:
        self.runtime, self.generator, self.seed, self.train = runtime, generator, seed, train
        self.reseeded_from: int | None = None
        """The world size of the snapshot whose streams were reseeded rather than restored, if so."""

    def state_dict(self) -> dict[str, Any]:
        mine = {"rng": rng_state(), "loader_generator": self.generator.get_state()}
        return {"world_size": self.runtime.world_size, "ranks": gather_object(mine, group=self.runtime.group)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rt = self.runtime
        if state["world_size"] == rt.world_size:
            mine = state["ranks"][rt.rank]
            set_rng_state(mine["rng"])
            self.generator.set_state(mine["loader_generator"])
            return
        seed = stream_seed("reseed", self.seed, self.train.step, rt.rank)  # needs the counters loaded first
        torch.manual_seed(seed)
        self.generator.manual_seed(seed)
        self.reseeded_from = state["world_size"]
