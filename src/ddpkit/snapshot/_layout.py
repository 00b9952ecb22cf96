"""Where each value of a saved state goes: tensors to DCP's files, other values to ``values.pt``,
and each rank's own values (:data:`~ddpkit.strategies._base.PER_RANK`) under a name of their own.

DCP keeps one copy of a key that several ranks save (replicated parameters) and gives every rank
that copy on load, from whichever rank the planner picked to write it. Some values are the same key
on every rank but each rank's own: BatchNorm's running statistics without sync BatchNorm follow each
rank's own batches (DDP copies rank 0's into the others only at the next synchronised forward pass),
as do parameters DDP was told to ignore. A state's :data:`~ddpkit.strategies._base.PER_RANK` part
holds those: rank 0's copy is saved in the place of the shared key (so the shared part is one whole
state, rank 0's, as DDP would converge to), rank ``r``'s under ``per_rank.rank<r>``.
"""

from __future__ import annotations

import heapq
import pickle
from collections.abc import Iterator
from typing import Any

import torch

# the strategies say which part of their state is a rank's own
from ddpkit.strategies._base import PER_RANK

KeyPath = tuple[Any, ...]


def leaves(tree: dict[str, Any], prefix: KeyPath = ()) -> Iterator[tuple[KeyPath, Any]]:
    """(path, value) of every value of a nested dict that is not itself a dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def nest(items: list[tuple[KeyPath, Any]]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for path, value in items:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        if path[-1] in node:
            raise ValueError(
                f"two values are saved as {'.'.join(map(str, path))}: keep a rank's own values out "
                "of the shared part"
            )
        node[path[-1]] = value
    return root


def set_at(tree: dict[str, Any], path: KeyPath, value: Any) -> None:
    for key in path[:-1]:
        tree = tree[key]
    tree[path[-1]] = value


def stored_path(path: KeyPath, rank: int) -> KeyPath:
    """Where the value at ``path`` of a state is stored, for the copy of ``rank``: a value of the
    :data:`~ddpkit.strategies._base.PER_RANK` part goes under the name of its rank, except rank 0's,
    which takes the place of the same key in the shared part."""
    if path[0] != PER_RANK:
        return path
    return path[1:] if rank == 0 else (PER_RANK, f"rank{rank}", *path[1:])


def stored_parts(
    state: dict[str, Any], rank: int, replicated_over: int = 1
) -> tuple[dict[str, Any], dict[KeyPath, Any]]:
    """The tensors of ``state`` as DCP saves them (nested, at their :func:`stored_path`), and its
    other values by stored path (for ``values.pt``).

    ``replicated_over``: the number of ranks that hold the same shared tensors (every rank of a
    replicated strategy's group). Each then keeps only its :func:`writer_of_shared` share of them,
    so DCP's planner on the first rank gets every shared tensor once instead of once per rank (see
    that function)."""
    # (stored path, value, whether it is of the per-rank part: rank 0's takes a shared key's path)
    items = [(stored_path(p, rank), v, p[0] == PER_RANK) for p, v in leaves(state)]
    tensors = [(p, v, own) for p, v, own in items if isinstance(v, torch.Tensor)]
    if replicated_over > 1:
        writer = writer_of_shared(
            [(p, v.numel() * v.element_size()) for p, v, own in tensors if not own], replicated_over
        )
        tensors = [(p, v, own) for p, v, own in tensors if own or writer[p] == rank]
    return nest([(p, v) for p, v, _ in tensors]), {
        p: v for p, v, _ in items if not isinstance(v, torch.Tensor)
    }


def differences(values: dict[KeyPath, Any], common: dict[KeyPath, Any]) -> dict[KeyPath, Any]:
    """The values that ``common`` (rank 0's) lacks or holds otherwise, to the bit (-0.0 is not 0.0):
    the same type and the same pickle."""

    def same(a: Any, b: Any) -> bool:
        return type(a) is type(b) and (a is b or pickle.dumps(a) == pickle.dumps(b))

    return {k: v for k, v in values.items() if k not in common or not same(common[k], v)}


def writer_of_shared(sizes: list[tuple[KeyPath, int]], ranks: int) -> dict[KeyPath, int]:
    """Which rank writes each tensor that every one of ``ranks`` ranks holds alike: the largest
    first, each to the rank with the fewest bytes so far (ties to the lower rank), so that every
    rank writes about the same.

    DCP deduplicates such tensors itself, on its first rank, after gathering every rank's plan: that
    rank's planning then grows with ranks x tensors, and at scale it is what a save waits for (the
    reports of huggingface/accelerate#4086 and pytorch/pytorch#163548). Every rank computes the same
    answer from the same shapes with no communication, so each plans only its share and the first
    rank's work grows with the tensors alone. Sound only where the tensors really are the same on
    every rank (replicated DDP); a rank's own values are in the per-rank part and never shared
    out."""
    loads = [(0, r) for r in range(ranks)]  # a heap of (bytes so far, rank)
    writer = {}
    for path, nbytes in sorted(sizes, key=lambda item: (-item[1], str(item[0]))):
        written, r = heapq.heappop(loads)
        writer[path] = r
        heapq.heappush(loads, (written + nbytes, r))
    return writer
