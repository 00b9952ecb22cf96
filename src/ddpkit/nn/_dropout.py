"""Dropout whose masks do not depend on how the global batch is split over ranks.

``nn.Dropout`` draws each rank's mask from that rank's RNG, so a run at 2 ranks and one at 1 rank
drop different units of the same sample: they cannot match, and a run resumed at another world size
continues with other masks. :class:`GlobalBatchDropout` draws the mask of the whole global
micro-batch from a key that every rank shares (seed, epoch, micro-step, layer, call) and keeps its
own rows, so sample ``i`` of a global batch gets the same mask at any world size. The price: every
rank draws ``world_size`` times the random numbers of its own mask. Outside a :func:`batch_layout`
context (e.g. a hand-written loop) it is plain dropout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddpkit._errors import ConfigError
from ddpkit.distributed._seeding import mix_seed


@dataclass(frozen=True)
class BatchLayout:
    """Where this rank's micro-batch sits in the global one."""

    global_size: int
    offset: int
    key: int
    """Identical on every rank for the same global micro-batch, different for every other."""
    size: int | None = None
    """This rank's samples in the micro-batch, when known: the size an input must have at its batch
    dimension."""


_layout: BatchLayout | None = None
_calls: dict[int, int] = {}


@contextmanager
def batch_layout(layout: BatchLayout) -> Iterator[None]:
    """Make :class:`GlobalBatchDropout` layers draw the masks of ``layout``'s global batch inside
    the block."""
    global _layout
    previous, _layout = _layout, layout
    _calls.clear()
    try:
        yield
    finally:
        _layout = previous


class GlobalBatchDropout(nn.Dropout):
    """``nn.Dropout`` with masks that are a function of the sample's place in the global batch.

    ``batch_dim``: the input's dimension that holds the samples: 0 for batch-first tensors (the
    default), 1 for sequence-first ones (``nn.LSTM`` / ``nn.GRU`` / ``nn.Transformer`` without
    ``batch_first=True``). Its size must be this rank's number of samples in the micro-batch; any
    other is refused, naming both. A tensor whose sequence length happens to equal that number
    cannot be told from a batch-first one: ``batch_dim`` says which it is, and masks drawn along the
    wrong dimension would be silently wrong (another sample's row).
    """

    def __init__(self, p: float = 0.5, layer_id: int = 0, batch_dim: int = 0) -> None:
        super().__init__(p)
        self.layer_id, self.batch_dim = layer_id, batch_dim

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        layout = _layout
        if not self.training or self.p == 0 or layout is None:
            return F.dropout(input, self.p, self.training)
        dim = self.batch_dim
        if not -input.dim() <= dim < input.dim():
            raise ConfigError(
                f"GlobalBatchDropout(layer_id={self.layer_id}, batch_dim={dim}) got an input of "
                f"shape {tuple(input.shape)}, which has no dimension {dim}: give the batch's "
                "dimension as batch_dim"
            )
        n = input.shape[dim]
        if (
            n != (layout.size if layout.size is not None else n)
            or layout.offset + n > layout.global_size
        ):
            expected = (
                layout.size
                if layout.size is not None
                else f"at most {layout.global_size - layout.offset}"
            )
            raise ConfigError(
                f"GlobalBatchDropout(layer_id={self.layer_id}) got an input of shape "
                f"{tuple(input.shape)} whose size at batch_dim={dim} is {n}, where this rank's "
                f"micro-batch has {expected} samples: for sequence-first tensors (seq, batch, ...) "
                "pass batch_dim=1 (convert_dropout(model, batch_dim=1), or build "
                "GlobalBatchDropout(p, layer_id, batch_dim=1) in the model)"
            )
        call = _calls.get(self.layer_id, 0)  # a layer applied twice in one forward draws two masks
        _calls[self.layer_id] = call + 1
        g = torch.Generator(device=input.device)
        g.manual_seed(mix_seed(layout.key, self.layer_id, call))  # the same on every rank
        shape = list(input.shape)
        shape[dim] = layout.global_size
        keep = torch.rand(shape, generator=g, device=input.device).narrow(dim, layout.offset, n)
        return input * (keep >= self.p).to(input.dtype) / (1 - self.p)


def convert_dropout(module: nn.Module, batch_dim: int = 0) -> nn.Module:
    """Replace every ``nn.Dropout`` in ``module`` by a :class:`GlobalBatchDropout` whose inputs hold
    the samples at ``batch_dim`` (in place; returns it). A :class:`GlobalBatchDropout` already there
    is kept as it is."""
    taken = [m.layer_id for m in module.modules() if isinstance(m, GlobalBatchDropout)]
    counter = iter(range(max(taken, default=-1) + 1, 1 << 30))  # a layer id of its own for each

    def swap(m: nn.Module) -> nn.Module:
        if type(m) is nn.Dropout:
            new = GlobalBatchDropout(m.p, next(counter), batch_dim)
            new.train(m.training)
            return new
        for name, child in m.named_children():
            setattr(m, name, swap(child))
        return m

    return swap(module)
