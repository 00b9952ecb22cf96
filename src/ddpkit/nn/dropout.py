"""Dropout whose masks do not depend on how the global batch is split over ranks.

``nn.Dropout`` draws each rank's mask from that rank's RNG, so a run at 2 ranks and one at 1 rank drop
different units of the same sample: they cannot match, and a run resumed at another world size continues with
other masks. :class:`GlobalBatchDropout` draws the mask of the whole global micro-batch from a key that every
rank shares (seed, epoch, micro-step, layer, call) and keeps its own rows, so sample ``i`` of a global batch
gets the same mask at any world size. The price: every rank draws ``world_size`` times the random numbers of its
own mask. Outside a :func:`batch_layout` context (e.g. a hand-written loop) it is plain dropout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ddpkit.distributed.seeding import mix_seed


@dataclass(frozen=True)
class BatchLayout:
    """Where this rank's micro-batch sits in the global one."""

    global_size: int
    offset: int
    key: int
    """Identical on every rank for the same global micro-batch, different for every other."""


_layout: BatchLayout | None = None
_calls: dict[int, int] = {}


@contextmanager
def batch_layout(layout: BatchLayout) -> Iterator[None]:
    """Make :class:`GlobalBatchDropout` layers draw the masks of ``layout``'s global batch inside the block."""
    global _layout
    previous, _layout = _layout, layout
    _calls.clear()
    try:
        yield
    finally:
        _layout = previous


class GlobalBatchDropout(nn.Dropout):
    """``nn.Dropout`` with masks that are a function of the sample's place in the global batch."""

    def __init__(self, p: float = 0.5, layer_id: int = 0) -> None:
        super().__init__(p)
        self.layer_id = layer_id

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        layout = _layout
        if not self.training or self.p == 0 or layout is None:
            return F.dropout(input, self.p, self.training)
        call = _calls.get(self.layer_id, 0)  # a layer applied twice in one forward draws two masks
        _calls[self.layer_id] = call + 1
        g = torch.Generator(device=input.device)
        g.manual_seed(mix_seed(layout.key, self.layer_id, call))  # the same on every rank
        shape = (layout.global_size, *input.shape[1:])
        keep = torch.rand(shape, generator=g, device=input.device)[layout.offset : layout.offset + input.shape[0]]
        return input * (keep >= self.p).to(input.dtype) / (1 - self.p)


def convert_dropout(module: nn.Module) -> nn.Module:
    """Replace every ``nn.Dropout`` in ``module`` by a :class:`GlobalBatchDropout` (in place; returns it)."""
    counter = iter(range(1 << 30))

    def swap(m: nn.Module) -> nn.Module:
        if type(m) is nn.Dropout:
            new = GlobalBatchDropout(m.p, next(counter))
            new.train(m.training)
            return new
        for name, child in m.named_children():
            setattr(m, name, swap(child))
        return m

    return swap(module)
