"""Loaders over a rank's shard: :func:`build_loader` for training and the loader it makes
(:class:`EpochLoader`, which knows where the loop stands), :func:`build_eval_loader` for exact
evaluation, and :class:`SeededSamples`, which makes each sample's random draws while loading
(augmentation) a function of ``(seed, epoch, index)``, whichever rank or loader worker loads it.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import random
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from itertools import repeat
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from ddpkit._errors import ConfigError, checked_arguments
from ddpkit.data._fingerprint import OnDataChange, changes, dataset_items, refusal
from ddpkit.data._sampler import EpochIndices, EvalShardSampler, ShardedBatchSampler
from ddpkit.distributed import Group
from ddpkit.distributed import _channels as channels
from ddpkit.distributed import _progress as progress
from ddpkit.distributed._progress import Phase
from ddpkit.distributed._runtime import get_runtime
from ddpkit.distributed._seeding import cuda_in_use, stream_seed
from ddpkit.platforms import _torchrun as torchrun
from ddpkit.platforms._cpus import cpu_count

try:  # numpy is optional: seeded only where it is installed
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


def check_map_style(dataset: Any) -> None:
    """Refuse a dataset the samplers cannot shard: an ``IterableDataset`` or one without a
    length."""
    if (
        isinstance(dataset, IterableDataset)
        or not hasattr(dataset, "__getitem__")
        or not hasattr(dataset, "__len__")
    ):
        raise ConfigError(
            f"a {type(dataset).__name__} is not a map-style dataset (with __len__ and "
            "__getitem__): build_loader and the Trainer shard, shuffle and resume by sample "
            "index, which a plain stream does not have. Wrap it in a stream of ddpkit.data "
            "(JsonlStream, TokenStream, IterableStream(dataset, num_records), which every rank "
            "and loader worker reads whole) or a ddpkit.data.Stream of your own with positional "
            "reads, or load it into a map-style Dataset"
        )


@checked_arguments
def default_num_workers(local_world_size: int | None = None) -> int:
    """Loader workers per rank: the cores of each rank minus one (for the rank itself)."""
    procs = local_world_size or get_runtime().local_world_size
    return max(0, cpu_count() // procs - 1)


def _loader_kwargs(num_workers: int | None, pin_memory: bool | None) -> dict[str, Any]:
    workers = default_num_workers() if num_workers is None else num_workers
    pin = get_runtime().device.type == "cuda" if pin_memory is None else pin_memory
    return {"num_workers": workers, "pin_memory": pin, "persistent_workers": workers > 0}


@checked_arguments
def build_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = True,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    group: Group = None,
    seed_samples: bool = True,
    on_data_change: OnDataChange = "error",
) -> EpochLoader:
    """A training loader over this rank's shard; ``batch_size`` is per rank. It has its own
    ``torch.Generator``, so an ``iter()`` draws nothing from the global RNG.
    ``seed_samples``: each sample is loaded with the generators seeded from ``(seed, epoch, index)``
    (:class:`SeededSamples`); False leaves the draws to each loading process's own stream.

    ``loader.state_dict()`` is where the loop stands with the data's fingerprint;
    ``loader.load_state_dict(state)`` resumes there and refuses data that changed since, naming each
    change, unless ``on_data_change="restart_epoch"``
    (:class:`EpochLoader`).
    """
    kwargs = _loader_kwargs(num_workers, pin_memory)
    # a Stream exists only once its module is imported (it needs numpy)
    streams = sys.modules.get("ddpkit.data._stream")
    stream: Any = dataset if streams and isinstance(dataset, streams.Stream) else None
    if stream is None:
        check_map_style(dataset)
    # a stream's sampler goes over global positions in order (the stream's order shuffles)
    sampler = ShardedBatchSampler(
        cast(Sized, dataset),  # check_map_style made sure it has a length; a stream has one
        batch_size,
        shuffle=shuffle and stream is None,
        seed=seed,
        drop_last=drop_last,
        group=group,
        keyed=seed_samples or stream is not None,
    )
    if stream is not None:
        stream.check_loading(kwargs["num_workers"], sampler.world_size, group)
        read = sys.modules["ddpkit.data._stream"].StreamSamples(stream, seed, shuffle, seed_samples)
    else:
        read = SeededSamples(dataset, seed) if seed_samples else dataset
    # its own generator, seeded per rank (its workers' base seeds: ranks augment differently where
    # samples are not seeded)
    generator = torch.Generator().manual_seed(stream_seed("loader", seed, sampler.rank))
    return EpochLoader(
        read,
        batch_sampler=sampler,
        generator=generator,
        collate_fn=collate_fn,
        on_data_change=on_data_change,
        **kwargs,
    )


@checked_arguments
def build_eval_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    num_workers: int | None = None,
    pin_memory: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    group: Group = None,
) -> DataLoader:
    """An evaluation loader over this rank's exact share: no padding, no sample on two ranks."""
    check_map_style(dataset)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        # check_map_style made sure it has a length
        sampler=EvalShardSampler(cast(Sized, dataset), group=group),
        collate_fn=collate_fn,
        generator=torch.Generator(),
        worker_init_fn=serve_stacks,
        **_loader_kwargs(num_workers, pin_memory),
    )


def batch_len(batch: Any) -> int:
    """The samples of a batch: the first dimension of its (first) tensor. What the Trainer divides a
    micro-batch's loss by, and what its speed counts, alike."""
    if isinstance(batch, (list, tuple)):
        return batch_len(batch[0])
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, Mapping):
        return batch_len(next(iter(batch.values())))
    raise TypeError(f"cannot tell the batch size of a {type(batch).__name__}; batches hold tensors")


def to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Move every tensor in a (nested) batch of tuples, lists and dicts to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking and device.type == "cuda")
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device, non_blocking) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


# -- seeded samples -------------------------------------------------------------------------------


class SeededSamples(Dataset):
    """``dataset`` read at ``(epoch, index)`` keys, each sample's random draws seeded from
    ``(seed, epoch, index)`` (:class:`SampleSeeder`): python's ``random``, numpy's global generator,
    torch's CPU generator and, in a process that uses CUDA, the current device's (a sample drawing
    on the GPU needs ``num_workers=0``: CUDA cannot be used in a forked loader worker).

    A sample is read as ``dataset[index]``, as a DataLoader reads it: through the class's
    ``__getitem__``, not one set on the instance. What it costs: docs/data.md, "Seeded samples".
    """

    @checked_arguments
    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.seeder = SampleSeeder(seed)

    def __len__(self) -> int:
        # torch's Dataset declares no __len__; this one has it
        return len(self.dataset)  # type: ignore[arg-type]

    def fingerprint(self) -> dict[str, Any]:
        """The dataset's layout (:func:`~ddpkit.data._fingerprint.dataset_items`)."""
        return dataset_items(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: EpochIndices | list[tuple[int, int]]) -> list[Any]:
        """The samples of a batch's keys: the :class:`~ddpkit.data.EpochIndices` a keyed
        :class:`~ddpkit.data.ShardedBatchSampler` yields, or ``(epoch, index)`` pairs."""
        if isinstance(keys, EpochIndices):
            items: list[int] = keys
        elif all(isinstance(key, (tuple, list)) and len(key) == 2 for key in keys):
            items = [index for _, index in keys]
        else:
            raise TypeError(
                f"SeededSamples reads a batch's keys with their epoch; got {keys!r}: pass the "
                "EpochIndices a keyed ShardedBatchSampler yields (a slice of one loses its epoch: "
                "EpochIndices(batch[a:b], batch.epoch)) or (epoch, index) pairs"
            )
        return self.seeder.load(keys, functools.partial(operator.getitem, self.dataset), items)


class SampleSeeder:
    """Loads a batch so that each sample's random draws depend on ``(seed, epoch, index)`` only.

    A batch is first read as it is, the generators held (:class:`Held`): if a sample drew, they are
    put back and the batch is read again with each sample seeded (:func:`seed_sample`), and from
    then on this process seeds every sample. ``read`` must give the same sample when called twice.
    The generators are put back after a seeded batch.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.draws = False
        """A sample drew in this process: seed each one before reading it."""

    def load(
        self,
        keys: EpochIndices | Sequence[tuple[int, int]],
        read: Callable[[Any], Any],
        items: Sequence[Any],
    ) -> list[Any]:
        """``[read(item) for item in items]``, where ``items[k]`` is the sample of key ``keys[k]``:
        ``keys`` a batch's :class:`~ddpkit.data.EpochIndices`, or ``(epoch, index)`` pairs."""
        held = Held()
        try:
            if not self.draws:
                out = [read(item) for item in items]
                if not held.drawn():
                    return out
                self.draws = True
                held.put_back()
            out = []
            pairs = zip(repeat(keys.epoch), keys) if isinstance(keys, EpochIndices) else keys
            for (epoch, index), item in zip(pairs, items):
                seed_sample(self.seed, epoch, index)
                out.append(read(item))
            return out
        finally:
            if self.draws:
                held.put_back()
            held.release_numpy()


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed python, numpy, torch's CPU generator and, where this process uses CUDA, the current CUDA
    device's generator for loading sample ``index`` of ``epoch`` (not ``torch.manual_seed``, which
    seeds every accelerator backend)."""
    s = stream_seed("sample", seed, epoch, index)
    random.seed(s)
    if np is not None:
        np.random.seed(s)
    torch.default_generator.manual_seed(s)
    if cuda_in_use():
        torch.cuda.manual_seed(s)  # the current device's: where a sample's draws on the GPU go


_WATCH_SEED = 20251127
"""The seed of numpy's stand-in generator while a batch is read unseeded."""


class _StandIn:
    """This process's stand-in for numpy's global bit generator while a batch is read, and its
    first words after ``seed(_WATCH_SEED)``."""

    def __init__(self, npr: Any) -> None:
        self.bitgen = npr.MT19937()
        npr.RandomState(self.bitgen).seed(_WATCH_SEED)  # legacy seeding, as numpy.random.seed
        self.fresh = self.bitgen.random_raw(16).tobytes()


_stand_in: list[_StandIn] = []


class Held:
    """The generators a sample may draw from, held while a batch is read: python's and torch's
    states (CPU and, where this process uses CUDA, the current device's) read, and numpy's global
    bit generator swapped for a stand-in (:class:`_StandIn`, freshly seeded), whose next 16 words
    show a draw or a seed (docs/data.md, "Seeded samples"). numpy < 1.25 has its state read.
    """

    def __init__(self) -> None:
        self.python = random.getstate()
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state() if cuda_in_use() else None
        self.numpy: Any = None
        """numpy's own bit generator while swapped out (its state, on numpy < 1.25)."""
        npr: Any = np.random if np is not None else None
        if npr is None:
            return
        if not hasattr(npr, "set_bit_generator"):
            self.numpy = npr.get_state()
            return
        if not _stand_in:
            _stand_in.append(_StandIn(npr))
        self.numpy = npr.get_bit_generator()
        npr.set_bit_generator(_stand_in[0].bitgen)
        npr.seed(_WATCH_SEED)

    def drawn(self) -> bool:
        """A generator drew, was seeded or was set to another state since."""
        py = random.getstate()
        # A draw moves python's index but for a whole twist of 624 words, which renews every word:
        # its index, cached normal and every 39th word tell (2**-512 for words that look random).
        return (
            py[1][-1] != self.python[1][-1]
            or py[2] != self.python[2]
            or py[1][::39] != self.python[1][::39]
            or not torch.equal(torch.get_rng_state(), self.torch)
            or (self.cuda is not None and not torch.equal(torch.cuda.get_rng_state(), self.cuda))
            or self._numpy_drawn()
        )

    def _numpy_drawn(self) -> bool:
        npr: Any = np.random if np is not None else None
        if npr is None:
            return False
        if isinstance(self.numpy, tuple):  # numpy < 1.25
            now = npr.get_state()
            return bool(now[2:] != self.numpy[2:] or (now[1] != self.numpy[1]).any())
        stand_in = _stand_in[0]
        return bool(
            npr.get_bit_generator() is not stand_in.bitgen
            or stand_in.bitgen.random_raw(16).tobytes() != stand_in.fresh
        )

    def put_back(self) -> None:
        """Python's and torch's states as they were."""
        random.setstate(self.python)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)

    def release_numpy(self) -> None:
        """numpy's own generator back in its place."""
        npr: Any = np.random if np is not None else None
        if isinstance(self.numpy, tuple):
            npr.set_state(self.numpy)
        elif self.numpy is not None:
            npr.set_bit_generator(self.numpy)
        self.numpy = None


# -- the training loader: where the loop stands ---------------------------------------------------


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
        user_init = kwargs.get("worker_init_fn")
        kwargs["worker_init_fn"] = functools.partial(serve_stacks, then=user_init)
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
