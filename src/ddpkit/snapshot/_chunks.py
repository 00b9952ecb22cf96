"""The chunks of a tensor in a DCP index cover it exactly once: checked in O(n log n), for any
number of chunks.

An index whose chunks leave part of a tensor uncovered would have DCP load nothing there and leave
it as it was (the fresh model's), without a word; one whose chunks overlap loads whichever comes
last.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata


class BadIndex(ValueError):
    """The JSON index is not one :mod:`ddpkit.snapshot._storage` wrote: what is wrong with it."""


_NUMEL_LIMIT = 2**63 - 1  # a tensor's number of elements is an int64 in torch
# Chunks split a tensor along one dimension (FSDP's dim 0) or, under torch's DTensor, along one per
# dimension of a device mesh that shards it (data, tensor and expert parallel: three at most in the
# layouts known). The check below costs 2**(dimensions split) per chunk: 4 keeps it within 4x a 2-D
# split's.
_SPLIT_DIMS = 4


def _numel(sizes: torch.Size) -> int:
    """The product of ``sizes``, or ``_NUMEL_LIMIT + 1`` once past it: a product of thousands of
    large sizes would cost time quadratic in their number."""
    if 0 in sizes:
        return 0
    n = 1
    for s in sizes:
        n *= s
        if n > _NUMEL_LIMIT:
            return _NUMEL_LIMIT + 1
    return n


def _corners(
    chunk: ChunkStorageMetadata, split: list[int], sign: int
) -> Iterator[tuple[tuple[int, ...], int]]:
    """(corner, weight) of the box ``chunk`` in the dimensions ``split`` (see
    :func:`_check_chunks`)."""
    ends = [((chunk.offsets[k], 1), (chunk.offsets[k] + chunk.sizes[k], -1)) for k in split]
    for combo in itertools.product(*ends):
        weight = sign
        for _, w in combo:
            weight *= w
        yield tuple(p for p, _ in combo), weight


def check_chunks(
    fqn: str, size: torch.Size, chunks: list[ChunkStorageMetadata]
) -> list[ChunkStorageMetadata]:
    """The chunks of a tensor cover it exactly once: each inside its shape, none overlapping
    another, their volumes adding up to its number of elements. An index whose chunks leave a part
    uncovered would have DCP load nothing there and leave the tensor as it was (the fresh model's),
    without a word. Returns the chunks that hold elements (an empty one loads nothing).

    In O(m log m) for m = n * 2**k corners (n chunks, k <= _SPLIT_DIMS dimensions split), where
    comparing every pair took O(n**2) (65,536 one-element chunks of a 256x256 weight: 40 minutes).
    Why it is exact: the indicator of a box prod_j [a_j, b_j) is prod_j (H(x_j - a_j) - H(x_j -
    b_j)), H the step at 0: expanded, a sum over its 2**k corners c of +-1 (the sign: -1 per
    coordinate taken from b) times the orthant Q_c(x) = [x >= c componentwise]. Orthants of distinct
    corners are linearly independent (in a combination sum_c w_c Q_c with some w_c != 0, take c* the
    lexicographically smallest such corner: every other c <= c* componentwise is lexicographically
    smaller, so its w_c is 0, and the sum at x = c* is w_c* != 0). So the chunks' indicators add up
    to the tensor's, every element covered exactly once and none outside, if and only if the weights
    of equal corners, the tensor's counted negatively, cancel at every corner: one sort and one
    sweep. Where they do not, the residual coverage at c*, the first corner left with a weight, is
    that weight: c* is an element covered twice (weight > 0) or never (< 0). Dimensions that every
    chunk spans whole are a common factor of every indicator, left out; they are 0 in c*.
    """
    numel = _numel(size)
    if numel > _NUMEL_LIMIT:
        raise BadIndex(f"tensor {fqn!r} of shape {list(size)[:8]} has more than 2**63 - 1 elements")
    full, total = [], 0
    for chunk in chunks:
        if len(chunk.offsets) != len(size) or len(chunk.sizes) != len(size):
            raise BadIndex(
                f"tensor {fqn!r} of shape {list(size)} has a chunk of another number of dimensions"
            )
        if any(o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, size)):
            raise BadIndex(
                f"tensor {fqn!r} of shape {list(size)} has a chunk at {list(chunk.offsets)} of "
                f"{list(chunk.sizes)} that lies outside it"
            )
        volume = _numel(chunk.sizes)  # inside the tensor: at most its number of elements
        if volume:
            full.append(chunk)
            total += volume
    if total != numel:
        raise BadIndex(
            f"tensor {fqn!r} of shape {list(size)} has chunks covering {total} of its {numel} "
            "elements"
        )
    if not numel:
        return full
    split = [k for k, s in enumerate(size) if any(c.offsets[k] or c.sizes[k] != s for c in full)]
    if len(split) > _SPLIT_DIMS:
        raise BadIndex(
            f"tensor {fqn!r} of shape {list(size)} is split along {len(split)} dimensions, more "
            f"than the {_SPLIT_DIMS} a snapshot's chunks split a tensor along"
        )
    whole = ChunkStorageMetadata(torch.Size([0] * len(size)), size)
    corners = [c for chunk in full for c in _corners(chunk, split, 1)] + list(
        _corners(whole, split, -1)
    )
    corners.sort(key=lambda c: c[0])
    i = 0
    while i < len(corners):
        point, weight, i = corners[i][0], corners[i][1], i + 1
        while i < len(corners) and corners[i][0] == point:
            weight, i = weight + corners[i][1], i + 1
        if weight:
            element = [0] * len(size)
            for k, p in zip(split, point):
                element[k] = p
            if weight > 0:
                raise BadIndex(f"tensor {fqn!r} has two chunks that overlap, at element {element}")
            raise BadIndex(
                f"tensor {fqn!r} has chunks that leave element {element} uncovered (and overlap "
                f"elsewhere: their sizes add up to its {numel} elements)"
            )
    return full
