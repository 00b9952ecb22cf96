"""Dropout whose masks do not depend on how the global batch is split over ranks: inside
:func:`batch_layout` every dropout (a :class:`GlobalBatchDropout`, each functional dropout the
forward calls, and ``scaled_dot_product_attention(dropout_p=...)``'s attention dropout, through a
:class:`~torch.overrides.TorchFunctionMode`) keeps an element by a hash of a key every rank shares,
the sample's place in the global batch and the element's coordinates in the sample. A sample gets
the same mask at any world size, whatever length its rank's batch is padded to (padding at the end
of a dimension, as a collate function pads). Dropout out of reach (``nn.MultiheadAttention``'s,
alpha dropout) is refused, naming it (:class:`DropoutRefused`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ddpkit._errors import ConfigError, checked_arguments
from ddpkit.data._sampler import ShardedBatchSampler, shard_bounds
from ddpkit.distributed._seeding import mix_seed, stream_seed


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


class DropoutRefused(ConfigError):
    """A dropout global-batch dropout cannot draw for the global batch (the module, the call and
    the way out named)."""


FUNCTIONAL = -1
"""The layer id of the dropouts a forward calls through ``torch.nn.functional``."""
ATTENTION = -2
"""The layer id of ``scaled_dot_product_attention``'s attention dropout."""
_CHANNELS = {F.dropout1d: 2, F.dropout2d: 3, F.dropout3d: 4}  # the input's dims with a batch
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@contextmanager
def batch_layout(layout: BatchLayout) -> Iterator[None]:
    """Make every dropout of the block draw the masks of ``layout``'s global batch."""
    global _layout
    previous, _layout = _layout, layout
    _calls.clear()
    try:
        with _Dropouts():
            yield
    finally:
        _layout = previous


def step_layout(
    place: tuple[int, int], micro: int, accum: int, seed: int, epoch: int
) -> BatchLayout:
    """This rank's ``place`` in the global batch of the optimizer step that global batch ``micro``
    of ``epoch`` belongs to, ``accum`` batches a step (the step's samples and this rank's offset
    among them: :meth:`~ddpkit.data.ShardedBatchSampler.place_in_step`): keyed by the step, so the
    masks are the same with or without gradient accumulation."""
    size, offset = place
    return BatchLayout(size, offset, key=stream_seed("dropout", seed, epoch, micro // accum))


@checked_arguments
@contextmanager
def global_batch(loader: Any, accum_steps: int = 1) -> Iterator[None]:
    """Every dropout of the block (a hand loop's forward) draws the masks of the global batch the
    ``build_loader`` loader handed over last, as the Trainer's ``global_batch_dropout`` does::

        for x, y in loader:
            with ddpkit.nn.global_batch(loader):
                loss = F.cross_entropy(model(x), y)

    ``accum_steps``: batches an optimizer step. Refused before any batch of the epoch was handed
    over."""
    sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(sampler, ShardedBatchSampler) or not hasattr(loader, "position"):
        raise ConfigError(
            "global_batch(loader) takes a ddpkit.build_loader loader: its sampler knows each "
            "rank's place in the global batch"
        )
    epoch, cursor = loader.position()
    if loader.finishing_epoch:  # position() already says the next epoch
        epoch, index = epoch - 1, sampler.steps_per_epoch - 1
    else:
        index = cursor // sampler.global_batch_size - 1
    if index < 0:
        raise ConfigError(
            "global_batch(loader): the loader has handed over no batch of this epoch yet: enter "
            "it inside `for batch in loader:`"
        )
    place = sampler.place_in_step(index, accum_steps)
    layout = step_layout(place, index, accum_steps, sampler.seed, epoch)
    start, end = shard_bounds(sampler.samples_in_batch(index), sampler.world_size, sampler.rank)
    with batch_layout(replace(layout, size=end - start)):
        yield


class _Dropouts(TorchFunctionMode):
    """Functional dropout and attention dropout inside :func:`batch_layout` follow the layout; what
    draws its own mask out of reach is refused."""

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if _layout is None:  # left on the stack by a block never left (a fork inherits it)
            return func(*args, **kwargs)
        if func is F.dropout or func in _CHANNELS:
            got = dict(zip(("input", "p", "training", "inplace"), args)) | kwargs
            p, training = float(got.get("p", 0.5)), bool(got.get("training", True))
            if training and p > 0:
                out = _masked(got["input"], p, FUNCTIONAL, 0, channels=func in _CHANNELS)
                return got["input"].copy_(out) if got.get("inplace") else out
        elif func is F.scaled_dot_product_attention:
            got = dict(zip(_SDPA_ARGS, args)) | kwargs
            if float(got.get("dropout_p") or 0.0) > 0:
                return _attention(**got)
        elif func in (F.alpha_dropout, F.feature_alpha_dropout):
            got = dict(zip(("input", "p", "training"), args)) | kwargs
            if got.get("training", False) and float(got.get("p", 0.5)) > 0:
                raise DropoutRefused(
                    f"{func.__name__} is not covered by global-batch dropout: use dropout, or turn "
                    "global_batch_dropout off"
                )
        return func(*args, **kwargs)


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` as torch's reference computes it (softmax of the scaled
    scores, masked, times the values), its attention weights dropped by the layout's masks: the
    sample's (head, query, key) elements, wherever its rank's batch pads."""
    if enable_gqa:  # grouped-query attention: each key and value head serves a group of queries
        repeat = query.size(-3) // key.size(-3)
        key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
    scale = query.size(-1) ** -0.5 if scale is None else scale
    scores = query @ key.transpose(-2, -1) * scale
    masked = None
    if is_causal:  # aligned at the top left, as torch's reference aligns it
        upper = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        masked = upper
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        masked = ~attn_mask if masked is None else masked | ~attn_mask
    elif attn_mask is not None:
        scores = scores + attn_mask
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    if masked is not None or attn_mask is not None:
        # a query that sees no key attends to nothing (torch's: 0, where softmax gives NaN)
        weights = weights.masked_fill(scores.isneginf().all(-1, keepdim=True), 0.0)
    return _masked(weights, dropout_p, ATTENTION, 0) @ value


_M32 = 0xFFFFFFFF


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h *= c`` modulo 2**32 for ``h`` in [0, 2**32) and ``c`` < 2**32, in int64 without overflow:
    ``h``'s low and high 16 bits multiplied apart. In place (a mask's size in a few passes)."""
    high = (h >> 16).mul_(c).bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return h.bitwise_and_(0xFFFF).mul_(c).add_(high).bitwise_and_(_M32)


def _mix(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser, in place: a bijection of [0, 2**32) whose every output bit
    depends on every input bit."""
    h.bitwise_xor_(h >> 16)
    _mul32(h, 0x85EBCA6B)
    h.bitwise_xor_(h >> 13)
    _mul32(h, 0xC2B2AE35)
    return h.bitwise_xor_(h >> 16)


def _keep(shape: list[int], dim: int, first_row: int, seed: int, p: float, device: Any) -> Any:
    """Which elements of a tensor of ``shape`` dropout keeps (probability ``1 - p``): a hash of
    ``seed``, each element's sample (its row at ``dim``, counted from the global batch's
    ``first_row``) and its coordinates at the other dimensions, one dimension after another, so that
    an element's draw does not depend on the sizes of the dimensions (a padded length)."""
    h = torch.tensor(seed & _M32, dtype=torch.int64, device=device)
    for d, size in enumerate(shape):
        at = torch.arange(size, dtype=torch.int64, device=device) + (first_row if d == dim else 0)
        at = at.view([size if e == d else 1 for e in range(len(shape))])
        h = _mix(h ^ (at & _M32))  # a new tensor, broadcast: full size at the last dimension only
    return h >= round(p * 2**32)


def _masked(
    input: torch.Tensor, p: float, layer_id: int, dim: int, channels: bool = False
) -> torch.Tensor:
    """``input`` with the global batch's mask for this rank's rows at ``dim`` (with ``channels``,
    whole channels), scaled by ``1 / (1 - p)``."""
    layout = _layout
    assert layout is not None
    if not -input.dim() <= dim < input.dim():
        raise DropoutRefused(
            f"dropout (layer_id={layer_id}, batch_dim={dim}) got an input of shape "
            f"{tuple(input.shape)}, which has no dimension {dim}: give the batch's dimension as "
            "batch_dim"
        )
    n, room = input.shape[dim], layout.global_size - layout.offset
    if n > room or layout.size not in (None, n):
        expected = layout.size if layout.size is not None else f"at most {room}"
        where = f"GlobalBatchDropout(layer_id={layer_id})"
        if layer_id == FUNCTIONAL:
            where = "a functional dropout"
        elif layer_id == ATTENTION:
            where = "scaled_dot_product_attention's attention dropout"
        raise DropoutRefused(
            f"{where} got an input of shape {tuple(input.shape)} whose size at batch_dim={dim} is "
            f"{n}, where this rank's micro-batch has {expected} samples: for sequence-first "
            "tensors (seq, batch, ...) pass batch_dim=1 (convert_dropout(model, batch_dim=1), or "
            "build GlobalBatchDropout(p, layer_id, batch_dim=1) in the model); the samples must "
            "have a dimension of their own (not flattened with the tokens, nor with the heads)"
        )
    call = _calls.get(layer_id, 0)  # a layer applied twice in one forward draws two masks
    _calls[layer_id] = call + 1
    shape = list(input.shape[:2] if channels else input.shape)
    dim = dim % input.dim()
    keep = _keep(shape, dim, layout.offset, mix_seed(layout.key, layer_id, call), p, input.device)
    if channels:
        keep = keep.reshape(*keep.shape, *([1] * (input.dim() - 2)))
    return input * keep.to(input.dtype) / (1 - p)


class GlobalBatchDropout(nn.Dropout):
    """``nn.Dropout`` with masks that are a function of the sample's place in the global batch.
    ``batch_dim``: the input's dimension holding the samples (1 for sequence-first tensors); its
    size must be this rank's samples in the micro-batch."""

    @checked_arguments
    def __init__(self, p: float = 0.5, layer_id: int = 0, batch_dim: int = 0) -> None:
        super().__init__(p)
        self.layer_id, self.batch_dim = layer_id, batch_dim

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or _layout is None:
            return F.dropout(input, self.p, self.training)
        return _masked(input, self.p, self.layer_id, self.batch_dim)


@checked_arguments
def convert_dropout(module: nn.Module, batch_dim: int = 0) -> nn.Module:
    """Replace every ``nn.Dropout`` in ``module`` by a :class:`GlobalBatchDropout` whose inputs hold
    the samples at ``batch_dim`` (in place; returns it). Refused, naming each, where the module
    holds a dropout global-batch dropout cannot reach."""
    missed = []
    for name, m in module.named_modules():
        where = name or type(module).__name__
        if isinstance(m, nn.MultiheadAttention) and m.dropout > 0:
            missed.append(
                f"{where} (nn.MultiheadAttention, dropout={m.dropout}: its attention dropout is "
                f"drawn inside torch's attention kernel, per rank; set {where}.dropout = 0.0, the "
                "layer's other dropouts are covered)"
            )
        elif isinstance(m, (nn.AlphaDropout, nn.FeatureAlphaDropout)) and m.p > 0:
            missed.append(f"{where} ({type(m).__name__}: use nn.Dropout)")
    if missed:
        raise DropoutRefused(
            "global-batch dropout cannot cover the dropout of " + "; ".join(missed) + "; or turn "
            "global_batch_dropout off"
        )
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
