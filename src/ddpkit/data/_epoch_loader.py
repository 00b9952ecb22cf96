"""The training loader: a DataLoader that counts an epoch only once its last batch is handed over,
and whose state is where the loop stands, with the data's fingerprint."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, cast

from torch.utils.data import DataLoader

from ddpkit.data._fingerprint import (
    OnDataChange,
    changes,
    dataset_items,
    refusal,
)
from ddpkit.data._sampler import ShardedBatchSampler
from ddpkit.distributed import _channels as channels
from ddpkit.distributed import _progress as progress
from ddpkit.distributed._progress import Phase
from ddpkit.platforms import _torchrun as torchrun


def serve_stacks(worker_id: int, then: Callable[[int], None] | None = None) -> None:
    """A loader's ``worker_init_fn``: under ``ddpkit run`` the loader worker answers stack requests
    (its inbox: :func:`ddpkit.distributed._channels.serve`, as ``rank<RANK>-loader<ID>``), then
    ``then`` (the user's own ``worker_init_fn``, if any) runs."""
    # the worker loads its data all the same; asked, it does not answer
    with contextlib.suppress(Exception):
        channels.serve(f"rank{torchrun.rank_text(os.environ) or 0}-loader{worker_id}")
    if then is not None:
        then(worker_id)


class EpochLoader(DataLoader):
    """A DataLoader over a :class:`~ddpkit.data.ShardedBatchSampler` that counts an epoch when an
    iteration has handed over its last batch (the workers read the sampler ahead of the batches):
    an iterator left before (a peek, a ``break``) leaves the sampler where it was. Each ``next()``
    marks the stall watch's phases. :meth:`state_dict`: where the loop stands, with the data's
    fingerprint (:mod:`ddpkit.data._fingerprint`). ``len(loader)``: the epoch's batches, also where
    a pass starts inside the epoch (:attr:`batch_in_epoch`).
    """

    def __init__(self, *args: Any, on_data_change: OnDataChange = "error", **kwargs: Any) -> None:
        """``DataLoader``'s arguments, with a :class:`~ddpkit.data.ShardedBatchSampler` as
        ``batch_sampler``; made by :func:`~ddpkit.build_loader`, which checks them."""
        kwargs["worker_init_fn"] = partial(serve_stacks, then=kwargs.get("worker_init_fn"))
        super().__init__(*args, **kwargs)
        self.on_data_change = on_data_change
        self.data_changes: list[str] = []
        """What :meth:`load_state_dict` found changed and accepted
        (``on_data_change="restart_epoch"``)."""
        self._pass: _CountedIterator | None = None
        self._fingerprint: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.batch_sampler
        assert isinstance(sampler, ShardedBatchSampler)  # build_loader's
        sampler.counts_epochs = False
        # before the DataLoader reads the sampler, which it starts on now
        token = sampler.position_token()
        self._pass = _CountedIterator(super().__iter__(), sampler, token)
        return self._pass

    def fingerprint(self) -> dict[str, Any]:
        """What decides which sample comes at which step: the sampler's settings and the dataset's
        layout, the world size aside. Computed once, at the first snapshot or resume."""
        if self._fingerprint is None:
            sampler = cast(ShardedBatchSampler, self.batch_sampler)
            self._fingerprint = sampler.fingerprint() | dataset_items(self.dataset)
        return self._fingerprint

    def _live(self) -> _CountedIterator | None:
        """The iteration under way over the sampler's current position, if any."""
        live = self._pass
        token = cast(ShardedBatchSampler, self.batch_sampler).position_token()
        return live if live is not None and live.token == token else None

    def _steps_handed(self) -> int:
        """Global batches of the sampler's epoch handed over: by the iteration under way, or before
        the next ``iter()``."""
        live = self._live()
        if live is not None:
            return live.first + live.handed
        return cast(ShardedBatchSampler, self.batch_sampler)._first_step()

    def position(self) -> tuple[int, int]:
        """``(epoch, cursor)``: the epoch of the batches being handed over (or the next one), and
        its samples handed over so far on all ranks; an epoch handed over whole is the next epoch at
        cursor 0."""
        sampler = cast(ShardedBatchSampler, self.batch_sampler)
        steps = self._steps_handed()
        if steps >= sampler.steps_per_epoch:
            return sampler.epoch + 1, 0
        return sampler.epoch, steps * sampler.global_batch_size

    @property
    def epoch(self) -> int:
        """The epoch of the batches being handed over, or of the next ``iter()``: after a resume,
        the epoch the snapshot was taken in (``for epoch in range(loader.epoch, epochs)``)."""
        return self.position()[0]

    @property
    def batch_in_epoch(self) -> int:
        """The index in its epoch of the batch handed over next: 0 at an epoch's start, ``k`` after
        a resume from a snapshot taken after ``k`` batches of it. A loop keyed on the index in the
        epoch counts from it: ``for i, batch in enumerate(loader, start=loader.batch_in_epoch)``."""
        cursor = self.position()[1]
        return -(-cursor // cast(ShardedBatchSampler, self.batch_sampler).global_batch_size)

    @property
    def finishing_epoch(self) -> bool:
        """The iteration under way has handed over its epoch's last batch and not yet ended: the
        code after the loop over the batches (an epoch scheduler, an evaluation) has not run, though
        :meth:`position` already says the next epoch."""
        steps = cast(ShardedBatchSampler, self.batch_sampler).steps_per_epoch
        return self._live() is not None and self._steps_handed() >= steps

    def state_dict(self) -> dict[str, Any]:
        """Where the loop stands (:meth:`position`) and the data's fingerprint: save it with the
        model."""
        epoch, cursor = self.position()
        return {"epoch": epoch, "cursor": cursor, "fingerprint": self.fingerprint()}

    def changes_since(self, state: dict[str, Any]) -> list[str]:
        """What differs between the data of :meth:`state_dict`'s ``state`` and this loader's, item
        by item (``"window: 32 -> 64"``): empty when a resume from it sees the same samples in the
        same steps. A check to run before anything else is loaded; :meth:`load_state_dict` runs it
        too."""
        return changes(state["fingerprint"], self.fingerprint())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue where :meth:`state_dict` was taken (on any rank, at any
        world size with the same global batch). Refused, naming each change, if the data's
        fingerprint differs; with ``on_data_change="restart_epoch"`` the epoch starts again from its
        first step instead (:attr:`data_changes` says why)."""
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        self.data_changes = self.changes_since(state)
        sampler = cast(ShardedBatchSampler, self.batch_sampler)
        if self.data_changes:
            if self.on_data_change != "restart_epoch":
                raise refusal(self.data_changes, epoch, cursor)
            cursor = 0
        sampler.set_position(epoch, cursor)


class _CountedIterator:
    """A pass over the loader: the DataLoader's iterator, its batches counted and marked."""

    def __init__(
        self, batches: Iterator[Any], sampler: ShardedBatchSampler, token: tuple[int, int]
    ) -> None:
        self.batches, self.sampler, self.token = batches, sampler, token
        self.first = sampler._first_step()
        self.handed = 0
        """Batches handed over."""

    def __iter__(self) -> _CountedIterator:
        return self

    def __len__(self) -> int:
        """The batches this pass hands over in all (the loader's own length is its epoch's)."""
        return self.sampler.steps_per_epoch - self.first

    def __next__(self) -> Any:
        progress.mark(Phase.DATA)  # for the launcher's stall watch
        try:
            batch = next(self.batches)
        except StopIteration:
            self.sampler.end_epoch(self.token)
            progress.mark(Phase.USER)
            raise
        self.handed += 1
        progress.batch_taken()
        return batch
