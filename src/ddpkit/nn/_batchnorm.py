"""Batch normalisation over the global batch on every backend: ``torch.nn.SyncBatchNorm`` runs on
CUDA only, so elsewhere each rank's count, mean and sum of squared deviations per channel, gathered
with their gradients, give the global mean and variance by Chan's combination, as torch's own
gathers and combines them (the backward all-reduces the statistics' gradients, so each rank's input
gradient holds every rank's terms)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit._errors import checked_arguments
from ddpkit._internals.modules import BatchNormBase, is_batchnorm
from ddpkit.distributed import Group
from ddpkit.distributed._runtime import is_live


class _AllGatherRows(torch.autograd.Function):
    """Every rank's row (one shape on every rank), stacked in rank order; the backward all-reduces
    the stack's gradient (every rank's terms of each row) and keeps this rank's row. One collective
    each way, as an all-reduce of sums would take."""

    @staticmethod
    def forward(ctx: Any, row: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group, ctx.rank = group, dist.get_rank(group)
        rows = row.new_empty((dist.get_world_size(group), row.numel()))
        dist.all_gather(list(rows.unbind(0)), row.contiguous(), group=group)  # rows of one buffer
        return rows

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = grad.contiguous().clone()
        dist.all_reduce(summed, group=ctx.group)
        return summed[ctx.rank], None


class CPUSyncBatchNorm(BatchNormBase):
    """``BatchNorm{1,2,3}d`` whose training statistics span all ranks of ``process_group``."""

    @checked_arguments
    def __init__(
        self, num_features: int, *args: Any, process_group: Group = None, **kwargs: Any
    ) -> None:
        super().__init__(num_features, *args, **kwargs)
        self.process_group = process_group

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self.check_input(input)
        # only training syncs: evaluation runs on uneven shares, without a collective per forward
        if (
            not self.training
            or not is_live(self.process_group)
            or dist.get_world_size(self.process_group) == 1
        ):
            return super().forward(input)
        dims = [0, *range(2, input.dim())]
        c, shape = self.num_features, (1, self.num_features) + (1,) * (input.dim() - 2)
        # In float64, and by squared deviations from each rank's own mean: E[x^2] - E[x]^2 loses
        # the digits of mean^2 / var, which float64 inputs have none of to spare.
        x64 = input.double()
        n = x64.new_full((1,), input.numel() / c)
        local_mean = x64.mean(dims)
        squares = (x64 - local_mean.reshape(shape)).square().sum(dims)
        every = _AllGatherRows.apply(torch.cat([n, local_mean, squares]), self.process_group)
        counts, means, squares = every[:, :1], every[:, 1 : c + 1], every[:, c + 1 :]
        count = counts.sum()
        mean = (counts * means).sum(0) / count
        # Chan et al.: the ranks' sums of squares, and each rank's mean's deviation from the mean
        var = (squares.sum(0) + (counts * (means - mean).square()).sum(0)) / count
        if self.track_running_stats:
            running_mean, running_var = self.running_mean, self.running_var
            tracked = self.num_batches_tracked
            # registered with track_running_stats
            assert running_mean is not None and running_var is not None and tracked is not None
            tracked.add_(1)
            factor = 1.0 / float(tracked) if self.momentum is None else self.momentum
            with torch.no_grad():
                unbiased = var * count / (count - 1).clamp(min=1)
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        inv_std = torch.rsqrt(var + self.eps).to(input.dtype).reshape(shape)
        out = (input - mean.to(input.dtype).reshape(shape)) * inv_std
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out


def convert_sync_batchnorm(
    module: nn.Module, device: torch.device, process_group: Group = None
) -> nn.Module:
    """Replace every BatchNorm layer by one that normalises over the global batch (in place where
    possible)."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(module, process_group)
    out = module
    if is_batchnorm(module) and not isinstance(module, CPUSyncBatchNorm):
        out = CPUSyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group=process_group,
        )
        if module.affine:
            out.weight = module.weight
            out.bias = module.bias
        # None where the statistics are not tracked, as out's own
        out.running_mean = module.running_mean
        out.running_var = module.running_var
        out.num_batches_tracked = module.num_batches_tracked
        out.train(module.training)
    for name, child in module.named_children():
        out.add_module(name, convert_sync_batchnorm(child, device, process_group))
    return out
