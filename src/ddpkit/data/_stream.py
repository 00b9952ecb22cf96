"""Streams: records read from files too big for memory, with the guarantees of map-style data.

A stream is ``N`` records in a natural order (its shards one after another), each readable by its
position in its shard. The order of epoch ``e`` is a permutation of the ``N`` records, a pure
function of ``(seed, e)``; :class:`StreamBatchSampler` cuts global positions ``0..N-1`` into global
batches of ``batch_size x world_size`` and rank ``r`` takes slice ``r`` of each, as
:class:`~ddpkit.data.ShardedBatchSampler` does with sample indices. So, as for map-style data:

- each record is trained on once per epoch over all ranks and loader workers;
- the Trainer's snapshot holds a global cursor, and a resume (after a SIGKILL, at any world size)
  reads the order from that cursor on: nothing repeated or skipped, bitwise at the same world size;
  the snapshot holds the files, their sizes and a digest of their contents, and the window too, and
  a resume over changed ones is refused (:mod:`ddpkit.data._fingerprint`);
- each record's ``transform`` runs with python, numpy and torch seeded from
  ``(seed, epoch, position)``.

Why no library. We tried the kept ones against the three guarantees (README, "Streams"). torchdata's
``StatefulDataLoader`` saves each worker's iterator state, restorable only with as many workers and
says nothing of ranks. webdataset splits shards by rank and worker and has no mid-epoch state.
litdata assigns chunks to ranks and workers from the world size, so a fresh epoch's order changes
with it, it needs its own chunk format, and its dependencies pull an unpinned torch.
mosaicml-streaming comes closest (the same global batches at 2 and 3 ranks, and a resume at 3 ranks
of a 2-rank state, in a probe with real processes: ``bench/stream_library_probe.py``), but it
repeats records whenever the count does not divide over the ranks, needs its own format (a converted
copy of every file), pins numpy below 2.2, imports transformers and torchvision, and coordinates a
node's ranks through shared memory. A global order with a cursor is what ddpkit's samplers already
do; a stream needs on top of it a positional read and an order that is not a list of all ``N``
records, which is what this module adds.

How a stream is ordered, sampled and loaded: :mod:`ddpkit.data._stream_loader`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ddpkit._errors import ConfigError
from ddpkit.data._fingerprint import shard_items
from ddpkit.distributed import Group

# numpy only in annotations: the core imports without it (a stream's loading needs it)
if TYPE_CHECKING:
    import numpy as np

DEFAULT_WINDOW = 8192
"""Records per shuffle block: the span of the reads of a global batch, and what
:class:`IterableStream` buffers in each reading process."""

OPEN_SHARDS = 64
"""Shard files a reading process keeps open at once."""

Transform = Callable[[Any], Any]


class Stream:
    """A finite sequence of records, readable by position: subclass it with :attr:`shard_sizes` and
    :meth:`read` for a source of your own.

    ``transform(record)`` turns a record into a sample (decoding, augmentation); it runs in the
    loader workers with python, numpy and torch seeded from ``(seed, epoch, position)``. ``window``:
    records per shuffle block.
    """

    random_access = True
    """False for a source read front to back only: the order then keeps its blocks in the source's
    order."""

    def __init__(self, *, transform: Transform | None = None, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ConfigError(f"window={window}: the shuffle window must hold at least one record")
        self.transform, self.window = transform, window
        self._local: dict[str, Any] = {}
        self._pid = os.getpid()

    @property
    def shard_sizes(self) -> Sequence[int]:
        """Records in each shard, known before reading: the order and the epoch's length depend on
        them."""
        raise NotImplementedError

    def read(self, shard: int, indices: np.ndarray) -> list[Any]:
        """The records at ``indices`` (positions in ``shard``, any order), in that order."""
        raise NotImplementedError

    def __len__(self) -> int:
        return int(sum(self.shard_sizes))

    def shard_descriptions(self) -> list[str]:
        """A line for each shard saying what decides where its records lie (a name, a size, a digest
        of where its records start); the default: its record count. Saved with every snapshot and
        compared on resume."""
        return [f"{n} records" for n in self.shard_sizes]

    def fingerprint(self) -> dict[str, Any]:
        """What decides which record comes at which position of an epoch, besides the seed and
        shuffling: the stream's kind, records, window and shards
        (:mod:`ddpkit.data._fingerprint`)."""
        return {
            "stream": type(self).__name__,
            "records": len(self),
            "window": self.window,
            **shard_items(self.shard_descriptions()),
        }

    def check_loading(self, num_workers: int, world_size: int, group: Group) -> None:
        """Refuse loading that cannot read every record in every process (``build_loader`` calls it
        on every rank, before the loader is made): nothing to refuse for a stream read by
        position."""

    def local(self) -> dict[Any, Any]:
        """Open files and iterators of this process: a forked loader worker opens its own."""
        if self._pid != os.getpid():
            self._local, self._pid = {}, os.getpid()
        return self._local

    def opened(
        self,
        shard: int,
        open_fn: Callable[[], Any],
        close_fn: Callable[[Any], None] = lambda h: None,
    ) -> Any:
        """This process's handle on ``shard``, opened by ``open_fn`` on first use; the least
        recently used is closed beyond :data:`OPEN_SHARDS` (thousands of shards would exhaust a
        process's file descriptors)."""
        handles = self.local()
        if shard in handles:
            handles[shard] = handles.pop(shard)  # most recently used last
        else:
            if len(handles) >= OPEN_SHARDS:
                oldest = next(iter(handles))
                close_fn(handles.pop(oldest))
            handles[shard] = open_fn()
        return handles[shard]

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__ | {"_local": {}}
