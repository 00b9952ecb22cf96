"""The known ways N ranks can train another model than one process does, each with the switch
``ddpkit check`` turns off to confirm it and the fix to tell the user."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

try:  # numpy is optional, as in ddpkit.distributed._seeding
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

from ddpkit.distributed._seeding import mix_seed


@dataclass(frozen=True)
class Cause:
    """A way N ranks can train another model than one process does, and the switch that removes
    it."""

    key: str
    what: str
    fix: str


CAUSES: tuple[Cause, ...] = (
    Cause(
        "batchnorm",
        "BatchNorm without global statistics: each rank normalises its own slice of the batch",
        "sync_batchnorm=True (prepare_model(model, sync_batchnorm=True) or "
        "TrainerConfig(sync_batchnorm=True))",
    ),
    Cause(
        "dropout",
        "dropout drawing per rank: each rank draws the masks of its own slice from its own RNG",
        "global_batch_dropout=True (TrainerConfig), or the forward inside "
        "`with ddpkit.nn.global_batch(loader):` in a hand-written loop",
    ),
    Cause(
        "augmentation",
        "augmentation drawing per rank: the dataset draws random numbers from the process's RNG, "
        "so a sample is augmented differently at another world size",
        "draw a sample's randomness from a generator seeded by the sample: "
        "torch.Generator().manual_seed(ddpkit.distributed._seeding.mix_seed(seed, epoch, index)) "
        "in __getitem__",
    ),
    Cause(
        "data_order",
        "a different data order: the ranks' batches are not the slices of the single process's "
        "global batch",
        "ddpkit.build_loader(dataset, batch_size, seed=...) (ShardedBatchSampler) with the same "
        "seed on every rank",
    ),
    Cause(
        "unused_parameters",
        "unused parameters: some parameters get no gradient, and DDP waits for them",
        "find_unused_parameters=True (prepare_model(model, find_unused_parameters=True) or "
        "TrainerConfig(strategy=DDPConfig(find_unused_parameters=True))), or remove the unused "
        "parameters",
    ),
    Cause(
        "initial_state",
        "initial weights that differ between ranks: tensors DDP does not broadcast (plain tensor "
        "attributes, not parameters or buffers) start different on each rank",
        "ddpkit.seed_everything(seed) with the same seed on every rank before building the model, "
        "and self.register_buffer(name, tensor) so DDP broadcasts it",
    ),
    Cause(
        "nondeterminism",
        "non-deterministic ops: one process run twice from the same seed does not repeat itself",
        "torch.use_deterministic_algorithms(True) (on CUDA also CUBLAS_WORKSPACE_CONFIG=:4096:8)",
    ),
    Cause(
        "uneven_mean",
        "a loss averaged per rank when samples (or the tokens a loss averages over) are uneven: "
        "DDP averages the ranks' means, which is not the mean over the global batch when ranks "
        "hold different numbers of them",
        "drop_last=True (build_loader, TrainerConfig: every rank gets batch_size samples), or "
        "weight each rank's mean loss by its share: loss * n_rank * world_size / n_global (per "
        "token: the Trainer's count_fn)",
    ),
)


# -- the switches ----------------------------------------------------------------------------------


class SampleSeeded(Dataset):
    """Fetches sample ``i`` of epoch ``e`` with every RNG seeded by ``(seed, e, i)``, then restores
    them: the draws of a dataset's augmentation then belong to the sample, not to the rank that
    fetches it."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def __len__(self) -> int:
        # torch's Dataset declares no __len__; this one has it
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        state = random.getstate(), np.random.get_state() if np is not None else None
        with torch.random.fork_rng(devices=[]):
            # The CPU generator, python's and numpy's: torch.manual_seed would also queue a seed for
            # every CUDA device, at a cost per sample.
            key = mix_seed(self.seed, self.epoch, index)
            torch.default_generator.manual_seed(key)
            random.seed(key)
            if np is not None:
                np.random.seed(key)
            try:
                return self.dataset[index]
            finally:
                random.setstate(state[0])
                if np is not None:
                    np.random.set_state(state[1])


def plain_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Tensors a model keeps as plain attributes: neither parameters nor buffers, so DDP does not
    broadcast them."""
    out = {}
    for prefix, module in model.named_modules():
        for name, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                out[f"{prefix}.{name}" if prefix else name] = value
    return out


@contextmanager
def deterministic(on: bool) -> Iterator[None]:
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on or before)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)
