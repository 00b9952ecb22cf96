"""The data's fingerprint: everything that decides which sample comes at which step (the dataset's
length or a stream's files and window, the seed, shuffle, drop_last and global batch, the dataset's
own layout), kept in a loader's state and compared when a run resumes; a resume over changed data is
refused, naming each change, unless it restarts the epoch (docs/data.md, "Resuming on the same
data"). Each part is a short value or a digest: the fingerprint is saved after every step. The
world size is not in it: the global order does not depend on it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from ddpkit._errors import ConfigError

OnDataChange = Literal["error", "restart_epoch"]
"""What a resume does when the data's fingerprint differs from the snapshot's: refuse (``"error"``),
or train the snapshot's epoch again from its first step on the new data (``"restart_epoch"``)."""

LISTED_SHARDS = 64
"""Shards described one by one in a fingerprint; beyond that, the list is kept as one digest."""

LISTED_CHANGES = 6
"""Changes named in a refusal; the rest are counted."""


def digest(data: bytes | memoryview) -> str:
    """A short hex digest (16 characters) of ``data``."""
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def shard_items(descriptions: Sequence[str]) -> dict[str, Any]:
    """The fingerprint's items for a list of shards, each described by one line (its name, records,
    bytes...): the lines joined (one string is cheap to save after every step), or, past
    :data:`LISTED_SHARDS`, one digest of the whole list."""
    if len(descriptions) <= LISTED_SHARDS:
        return {"shards": len(descriptions), "shard files": "\n".join(descriptions)}
    return {"shards": len(descriptions), "shard list": digest("\n".join(descriptions).encode())}


def index_digest(indices: Any) -> str:
    """A digest of a sequence of indices (a list, range, tuple, tensor or array) as int64s: one pass
    of numpy's conversion and one of the hash, no Python loop over them."""
    import numpy as np  # only where a layout is described: the core imports without it
    import torch

    if isinstance(indices, range):
        return f"range({indices.start}, {indices.stop}, {indices.step})"
    if isinstance(indices, torch.Tensor):
        indices = indices.detach().cpu().numpy()
    array = np.ascontiguousarray(np.asarray(indices), dtype=np.int64)
    return digest(array.view(np.uint8).data)


def dataset_items(dataset: Any) -> dict[str, Any]:
    """What decides which item sits at each index of a map-style dataset, beyond its length, as
    fingerprint items: for a ``Subset``, its indices and its parent's length, for a
    ``ConcatDataset``, each part's length, and each part described in turn
    (``dataset.datasets[1].dataset``...), and whatever a dataset's own ``fingerprint()`` returns.
    The dataset itself (at the top) keeps the names its ``fingerprint()`` gives (a stream's). Past
    :data:`LISTED_SHARDS` items, one digest of them all."""
    own = getattr(dataset, "fingerprint", None)
    if callable(own):
        return dict(own())
    found: dict[str, Any] = {}
    _describe(dataset, "dataset", found)
    if len(found) <= LISTED_SHARDS:
        return found
    listed = "\n".join(f"{key}: {value}" for key, value in found.items())
    return {"dataset parts": len(found), "dataset layout": digest(listed.encode())}


def _describe(dataset: Any, path: str, found: dict[str, Any]) -> None:
    from torch.utils.data import ConcatDataset, Subset

    own = getattr(dataset, "fingerprint", None)
    if callable(own):
        found |= {f"{path} {key}": value for key, value in own().items()}
    elif isinstance(dataset, Subset):
        parent = len(dataset.dataset) if hasattr(dataset.dataset, "__len__") else "?"
        found[path] = (
            f"Subset of {len(dataset.indices)} of {parent} items, indices "
            f"{index_digest(dataset.indices)}"
        )
        _describe(dataset.dataset, f"{path}.dataset", found)
    elif isinstance(dataset, ConcatDataset):
        ends = dataset.cumulative_sizes
        lengths = [end - start for start, end in zip([0, *ends], ends)]
        shown = (
            ", ".join(map(str, lengths)) if len(lengths) <= 8 else f"digest {index_digest(lengths)}"
        )
        found[path] = f"ConcatDataset of {len(lengths)} parts of lengths {shown}"
        for k, part in enumerate(dataset.datasets):
            _describe(part, f"{path}.datasets[{k}]", found)


def _items(fingerprint: Mapping[str, Any]) -> dict[str, Any]:
    """The fingerprint with its shards one item each (``"shard k"``), to name the one that
    changed."""
    out: dict[str, Any] = {}
    for key, value in fingerprint.items():
        if key == "shard files":
            out |= {f"shard {k}": line for k, line in enumerate(str(value).split("\n")) if value}
        else:
            out[key] = value
    return out


def changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Each item that differs, as ``"item: saved -> current"``, in the saved fingerprint's order."""
    saved, current = _items(saved), _items(current)
    keys = list(saved) + [k for k in current if k not in saved]
    missing = "(none)"
    return [
        f"{key}: {saved.get(key, missing)} -> {current.get(key, missing)}"
        for key in keys
        if saved.get(key, missing) != current.get(key, missing)
    ]


def refusal(found: list[str], epoch: int, cursor: int) -> ConfigError:
    """The error of a resume over changed data: each change, and the two ways out."""
    listed = "; ".join(found[:LISTED_CHANGES])
    if len(found) > LISTED_CHANGES:
        listed += f"; and {len(found) - LISTED_CHANGES} more"
    return ConfigError(
        f"the data changed since the snapshot was taken ({listed}): resuming at sample {cursor} of "
        f"epoch {epoch} (counted from 0) would train some samples of that epoch twice and others "
        "never. Resume with the data, seed and batch size as they were, or pass "
        "on_data_change='restart_epoch' (to build_loader, or in TrainerConfig) to train that "
        "epoch again from its first step on the new data"
    )
