"""Batch normalisation over the global batch on every backend: ``torch.nn.SyncBatchNorm`` runs on
CUDA only, so elsewhere one differentiable all-reduce of each channel's sum, sum of squares and
count gives the global mean and variance (its backward all-reduces the statistics' gradients, so
each rank's input gradient holds every rank's terms)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddpkit._errors import checked_arguments
from ddpkit._internals.modules import BatchNormBase, is_batchnorm
from ddpkit.distributed import Group
from ddpkit.distributed._runtime import is_live


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


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
        x64 = input.double()  # E[x^2] - E[x]^2 loses digits in float32 when the mean is large
        local = torch.cat(
            [x64.sum(dims), (x64 * x64).sum(dims), x64.new_tensor([input.numel() / input.shape[1]])]
        )
        total = _AllReduceSum.apply(local, self.process_group)
        c = self.num_features
        count = total[-1]
        mean = total[:c] / count
        var = total[c : 2 * c] / count - mean * mean
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
        shape = (1, c) + (1,) * (input.dim() - 2)
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
