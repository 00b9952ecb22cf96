"""The known ways N ranks can train another model than one process does, each with the switch ``ddpkit check``
turns off to confirm it and the fix to tell the user."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cause:
    """A way N ranks can train another model than one process does, and the switch that removes it."""

    key: str
    what: str
    fix: str


CAUSES: tuple[Cause, ...] = (
    Cause(
        "batchnorm",
        "BatchNorm without global statistics: each rank normalises its own slice of the batch",
        "sync_batchnorm=True (prepare_model(model, sync_batchnorm=True) or TrainerConfig(sync_batchnorm=True))",
    ),
    Cause(
        "dropout",
        "dropout drawing per rank: each rank draws the masks of its own slice from its own RNG",
        "global_batch_dropout=True (TrainerConfig), or ddpkit.nn.dropout.convert_dropout(model) inside "
        "ddpkit.nn.dropout.batch_layout(...) in a hand-written loop",
    ),
    Cause(
        "augmentation",
        "augmentation drawing per rank: the dataset draws random numbers from the process's RNG, so a sample is "
        "augmented differently at another world size",
        "draw a sample's randomness from a generator seeded by the sample: "
        "torch.Generator().manual_seed(ddpkit.distributed.seeding.mix_seed(seed, epoch, index)) in __getitem__",
    ),
    Cause(
        "data_order",
        "a different data order: the ranks' batches are not the slices of the single process's global batch",
        "ddpkit.build_loader(dataset, batch_size, seed=...) (ShardedBatchSampler) with the same seed on every rank",
    ),
    Cause(
        "unused_parameters",
        "unused parameters: some parameters get no gradient, and DDP waits for them",
        "find_unused_parameters=True (prepare_model(model, find_unused_parameters=True) or "
        "TrainerConfig(strategy=DDPConfig(find_unused_parameters=True))), or remove the unused parameters",
    ),
    Cause(
        "initial_state",
        "initial weights that differ between ranks: tensors DDP does not broadcast (plain tensor attributes, "
        "not parameters or buffers) start different on each rank",
        "ddpkit.seed_everything(seed) with the same seed on every rank before building the model, and "
        "self.register_buffer(name, tensor) so DDP broadcasts it",
    ),
    Cause(
        "nondeterminism",
        "non-deterministic ops: one process run twice from the same seed does not repeat itself",
        "torch.use_deterministic_algorithms(True) (on CUDA also CUBLAS_WORKSPACE_CONFIG=:4096:8)",
    ),
    Cause(
        "uneven_mean",
        "a loss averaged per rank when samples (or the tokens a loss averages over) are uneven: DDP averages the "
        "ranks' means, which is not the mean over the global batch when ranks hold different numbers of them",
        "drop_last=True (build_loader, TrainerConfig: every rank gets batch_size samples), or weight each "
        "rank's mean loss by its share: loss * n_rank * world_size / n_global (per token: the Trainer's count_fn)",
    ),
)
