"""An epoch as optimizer steps, each a few micro-batches: what the Trainer's loop iterates.

The loader yields this rank's micro-batches of the epoch (from where a resumed run left off); a step is
``grad_accum_steps`` of them, or fewer at the end of an epoch. Each micro-batch comes with what its backward
needs to know: whether it is the step's last (DDP synchronises only that one), what its mean loss is divided
by so that the step follows the mean over the step's samples (:func:`loss_divisor`), and its place in the step's
global batch (for :class:`~ddpkit.nn.dropout.GlobalBatchDropout`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ddpkit.data.loader import to_device
from ddpkit.data.sampler import ShardedBatchSampler
from ddpkit.distributed.seeding import stream_seed
from ddpkit.nn.dropout import BatchLayout


@dataclass(frozen=True)
class MicroBatch:
    batch: Any
    samples: int
    """This rank's samples in it (its items, such as tokens, under ``count_fn``: :mod:`.item_counts`)."""
    divisor: float
    """What its mean loss is divided by (:func:`loss_divisor`)."""
    last: bool
    """The step's last micro-batch: its backward synchronises the gradients."""
    index: int
    """Its global batch's number in the epoch."""


@dataclass(frozen=True)
class Step:
    """One optimizer step of an epoch; ``micro_batches`` reads them from the loader as the step trains."""

    micro_batches: Iterator[MicroBatch]
    first: int
    """The number, in the epoch, of its first global batch."""
    count: int
    """How many micro-batches it has."""
    cursor: int
    """The epoch's cursor once the step is taken: samples trained on, over all ranks."""
    last_in_epoch: bool


def epoch_steps(
    batches: Iterable[Any], sampler: ShardedBatchSampler, accum: int, first: int, device: torch.device | None = None
) -> Iterator[Step]:
    """The steps of the rest of an epoch whose first untrained global batch is number ``first``; ``batches`` is
    the loader's pass over them (moved to ``device`` when given). A step's micro-batches must be read before
    the next step is asked for."""
    it = iter(batches)
    end = sampler.steps_per_epoch
    world, micro_global = sampler.world_size, sampler.global_batch_size
    for start in range(first, end, accum):
        count = min(accum, end - start)
        step_samples = sampler.samples_in_step(start, accum)

        def micro_batches(
            start: int = start, count: int = count, step_samples: int = step_samples
        ) -> Iterator[MicroBatch]:
            for index in range(start, start + count):
                batch = next(it)
                if device is not None:
                    batch = to_device(batch, device)
                n = batch_len(batch)
                yield MicroBatch(
                    batch,
                    n,
                    loss_divisor(n, world, step_samples, count, micro_global),
                    last=index == start + count - 1,
                    index=index,
                )

        yield Step(
            micro_batches(),
            start,
            count,
            min((start + count) * micro_global, sampler.num_samples),
            last_in_epoch=start + count == end,
        )


def batch_len(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        return batch_len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return batch_len(batch[0])
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}; batches hold tensors")


def loss_divisor(samples: int, world_size: int, step_samples: int, micro_batches: int, micro_global: int) -> float:
    """What a rank divides its micro-batch's mean loss by, so that the step follows the mean over the step's
    ``step_samples`` samples on all ranks.

    DDP averages the ranks' gradients and micro-batch gradients add up, so the step's gradient is
    ``sum(grad_i / d_i) / world_size``. With ``d_i = step_samples / (samples_i * world_size)`` that sum weighs
    every sample alike: ``sum(samples_i * grad_i) / step_samples``. When every micro-batch is full this is the
    number of micro-batches; an epoch's last, smaller batch (``drop_last=False``) is split unevenly over the
    ranks, and averaging the ranks' means there would weigh the samples of a rank with fewer more.
    """
    if step_samples == micro_batches * micro_global:
        return float(micro_batches)  # the same division as before, bit for bit
    return step_samples / (samples * world_size)


def step_layout(sampler: ShardedBatchSampler, micro: int, accum: int, seed: int, epoch: int) -> BatchLayout:
    """This rank's place in the global batch of the optimizer step that micro-batch ``micro`` belongs to.

    Keyed by the step, not the micro-batch, so :class:`~ddpkit.nn.dropout.GlobalBatchDropout` draws the same
    masks with or without gradient accumulation: sample ``p`` of a step's global batch gets row ``p`` of its mask.
    """
    size, offset = sampler.place_in_step(micro, accum)
    return BatchLayout(size, offset, key=stream_seed("dropout", seed, epoch, micro // accum))
