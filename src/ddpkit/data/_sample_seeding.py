"""A sample's random draws as a function of ``(seed, epoch, index)``: what ``build_loader`` and
streams load through (:class:`SampleSeeder`), the seeding of one sample, the watch for draws that
tells which batches need it, and the proof that spares the watch a ``__getitem__`` that cannot
draw.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
import random
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

from ddpkit._internals.rng import MT19937Words, tensor_bytes, words_position
from ddpkit.data._held_reads import held_reads
from ddpkit.data._sampler import EpochIndices
from ddpkit.distributed._seeding import cuda_in_use, stream_seed

try:  # numpy is optional: seeded only where it is installed
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]


class SampleSeeder:
    """Loads a batch so that each sample's random draws depend on ``(seed, epoch, index)`` only, and
    pays for seeding only where samples draw.

    Seeding python, numpy and torch before every sample costs ~15 to 40 us a sample, and most
    datasets draw nothing (a list of tensors, a decoded file without augmentation). So a batch is
    first read as it is, with the generators' states read through their public APIs and compared
    around it (:func:`draw_marks`, each read the cheapest exact one there is). In the main process
    that is two reads a batch, ~30 us on the CPU CI machine, most of it python's ``getstate`` (there
    is no cheaper view of its state); in a loader worker one read, beside the training step rather
    than in it. If nothing drew, that is the batch. If a sample drew, the generators are put back
    and the batch is read again with each sample seeded from ``(seed, epoch, index)``, and from then
    on this process seeds every sample (a dataset that draws once draws again). Either way each draw
    a sample makes is the seeded one: a sample that draws nothing has nothing to seed. ``read`` must
    give the same sample when called twice (as any map-style dataset does; a dataset that counts its
    reads sees the first drawing batch of each process twice).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.draws = False
        """A sample drew in this process: seed each one before reading it."""
        self._after: tuple[int, tuple[Any, ...]] | None = None

    def load(
        self,
        keys: EpochIndices | Sequence[tuple[int, int]],
        read: Callable[[Any], Any],
        items: Sequence[Any],
    ) -> list[Any]:
        """``[read(item) for item in items]``, where ``items[k]`` is the sample of key ``keys[k]``:
        ``keys`` a batch's :class:`~ddpkit.data.EpochIndices`, or ``(epoch, index)``
        pairs."""
        if not self.draws:
            worker = get_worker_info() is not None
            # In a loader worker nothing draws between two batches (a collate_fn that draws is taken
            # as the dataset drawing): the state after one is the marks of the next, one read a
            # batch, not two. Kept with the process id: a worker starts from a copy of the dataset,
            # and of what it held.
            kept = (
                self._after
                if worker and self._after is not None and self._after[0] == os.getpid()
                else None
            )
            marks = kept[1] if kept is not None else draw_marks()
            out = [read(item) for item in items]
            after = draw_marks()
            if not changed(marks, after):
                self._after = (os.getpid(), after) if worker else None
                return out
            if not worker:
                set_draw_marks(marks)
            self.draws = True
        # In a worker the generators' own stream is of no use to anyone once samples are
        # seeded: nothing to put back there. In the main process it is the training stream
        # (dropout), which loading must not move.
        main = get_worker_info() is None
        saved = loading_rng_state() if main else None
        try:
            out = []
            for (epoch, index), item in zip(epoch_index_pairs(keys), items):
                seed_sample(self.seed, epoch, index)
                out.append(read(item))
            return out
        finally:
            if saved is not None:
                set_loading_rng_state(saved)


def epoch_index_pairs(
    keys: EpochIndices | Iterable[tuple[int, int]],
) -> Iterable[tuple[int, int]]:
    """Each sample's ``(epoch, index)``."""
    return zip(itertools.repeat(keys.epoch), keys) if isinstance(keys, EpochIndices) else keys


class SeededSamples(Dataset):
    """``dataset`` read at ``(epoch, index)`` keys, each sample's random draws seeded from
    ``(seed, epoch, index)`` (:class:`SampleSeeder`).

    Python's ``random``, numpy's global generator and torch's CPU generator are seeded before a
    sample that draws, and so is the current CUDA device's generator in a process that uses CUDA: a
    sample drawing on the GPU (``torch.randn(..., device="cuda")``) draws the same too. That process
    is the main one (``num_workers=0``): CUDA cannot be used in a loader worker forked from a
    process that uses it. In the main process the generators' states are put back after a batch, so
    loading leaves the training stream (dropout, on the CPU or the GPU) where it was.

    A ``__getitem__`` that only subscripts, with the index, lists, tuples, tensors or numpy arrays
    the dataset holds (pytorch/examples' ``return self.data[index]``) is read as it is, with no
    watch at all: its code is proven to draw nothing (``ddpkit.data._held_reads``). Any other is
    watched (:class:`SampleSeeder`). Either way a sample is read as ``dataset[index]``, as a
    DataLoader reads it: through the class's ``__getitem__``, not one set on the instance. Cost in
    the main process: see ``bench/loader_overhead.py`` (datasets that draw nothing, read both ways)
    and ``bench/sample_seeding.py`` (one that draws).
    """

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.seeder = SampleSeeder(seed)
        self._proof: Any = None
        """The proof that ``dataset[index]`` draws nothing (``ddpkit.data._held_reads``); None
        where it may draw."""
        self._proof_made = False
        """``_proof`` was made in this process (at its first batch)."""

    def __getstate__(self) -> dict[str, Any]:
        # To a loader worker: the proof holds the dataset's class and function, which need not be
        # importable by name; the worker reads the code again.
        return {**vars(self), "_proof": None, "_proof_made": False}

    def __len__(self) -> int:
        # torch's Dataset declares no __len__; this one has it
        return len(self.dataset)  # type: ignore[arg-type]

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
        if not self._proof_made:
            self._proof, self._proof_made = held_reads(self.dataset), True
        # dataset[index], as a DataLoader reads it: through the class's __getitem__ (an instance's
        # own is not looked up), with no attribute lookup on the dataset before the watch
        dataset = self.dataset
        if self._proof is not None and self._proof.hold(dataset, items):
            return [dataset[item] for item in items]  # nothing to watch: the read runs no code
        return self.seeder.load(keys, functools.partial(operator.getitem, dataset), items)


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed python, numpy, torch's CPU generator and, where this process uses CUDA, the current CUDA
    device's generator for loading sample ``index`` of ``epoch``.

    ``torch.default_generator.manual_seed``, not ``torch.manual_seed``: the latter also seeds every
    accelerator backend and costs ~200 us, against ~1 us (measured on the CPU CI machine). The CUDA
    generator is seeded only once CUDA is initialised in this process (a sample drawing on the GPU,
    in the main process or a worker that initialised CUDA before its first sample): seeding it
    before would queue a call per sample.
    """
    s = stream_seed("sample", seed, epoch, index)
    random.seed(s)
    if np is not None:
        np.random.seed(s)
    torch.default_generator.manual_seed(s)
    if cuda_in_use():
        # the current device's generator only: where a sample's draws on the GPU go
        torch.cuda.manual_seed(s)


def loading_rng_state() -> tuple[Any, ...]:
    """The states of the generators :func:`seed_sample` seeds, for ``set_loading_rng_state``:
    python's, numpy's, torch's CPU generator and, where this process uses CUDA, the current device's
    generator."""
    cuda = torch.cuda.get_rng_state() if cuda_in_use() else None
    return (
        random.getstate(),
        np.random.get_state() if np is not None else None,
        torch.get_rng_state(),
        cuda,
    )


def set_loading_rng_state(state: tuple[Any, ...]) -> None:
    py, npy, cpu, cuda = state
    random.setstate(py)
    if npy is not None:
        np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)


# -- watching for draws ----------------------------------------------------------------------------
# A loader seeds a sample's generators only when the sample draws, and finds out by comparing the
# generators' states around each batch; in the main process that is two reads a batch on the path of
# every step, so each read is the cheapest exact one a public API gives (measured on the CPU CI
# machine):
# - python: ``random.getstate()`` (~12 us: a tuple of 625 ints; there is no cheaper view of the
#   state);
# - torch's CPU generator: ``get_state()``, its bytes read at its ``data_ptr()`` (~3 us);
# - numpy's global generator, where ``numpy.random`` is imported (torch's compiler stack, and so
#   DDP, imports it; a batch that imports it to draw is taken as drawing): the bit generator's words
#   read through its documented ctypes interface (``BitGenerator.ctypes.state_address``, <1 us),
#   where the public ``state`` property copies them one by one (~65 us). The layout (624 words, then
#   the position) is checked against that property once per bit generator; where it differs (another
#   bit generator, another numpy) the property is read. The legacy generator keeps the second of a
#   pair of normal samples apart from its words, and using it moves no word: that flag is read with
#   ``get_state`` (the slow read) unless the words are those at which it was last read clear, as
#   only a draw that moves the words sets it. (Not seen: ``np.random.set_state`` of a state with a
#   cached normal and the very words the generator holds, when a batch then uses that normal.)
# A loader worker, where nothing draws between batches, takes the state after one batch as the marks
# of the next (:class:`SampleSeeder`). Every comparison is exact (two states are equal only if
# nothing drew, or the generator was set back to the state it had) but python's, which reads 16 of
# its 624 words besides its index: see :func:`changed`.


class _NumpyWords:
    """numpy's global generator, read as its words where that is exact (see above)."""

    def __init__(self) -> None:
        self.words = MT19937Words()
        self.clear_at: bytes | None = None
        """Words at which ``get_state`` last found no normal sample kept apart."""

    def _words(self, npr: Any) -> bytes | None:
        get_bit_generator = getattr(npr, "get_bit_generator", None)  # numpy >= 1.25
        return None if get_bit_generator is None else self.words(get_bit_generator())

    def mark(self) -> tuple[Any, ...] | None:
        npr = _numpy_random()
        if npr is None:
            return None
        words = self._words(npr)
        if words is not None and words == self.clear_at:
            return ("words", words)
        state = npr.get_state(legacy=False)
        if words is None:
            return ("state", state)
        self.clear_at = None if state["has_gauss"] else words
        return (
            ("words", words) if not state["has_gauss"] else ("words+normal", words, state["gauss"])
        )


_numpy_words = _NumpyWords()


def _numpy_random() -> Any:
    """numpy's random module where it is imported already (None otherwise): never imported here."""
    return sys.modules.get("numpy.random")


def draw_marks() -> tuple[Any, ...]:
    """The states of the generators :func:`seed_sample` seeds, to compare with :func:`drawn_since`
    or :func:`changed`, and restorable with :func:`set_draw_marks`: python's, numpy's (None where
    ``numpy.random`` is not imported), torch's CPU generator's and, where this process uses CUDA,
    the current device's."""
    cuda = torch.cuda.get_rng_state() if cuda_in_use() else None
    cpu = tensor_bytes(torch.default_generator.get_state())
    return random.getstate(), _numpy_words.mark(), cpu, cuda


def _same_state(a: Any, b: Any) -> bool:
    """Equality of two numpy generator states: nested dicts of ints, floats, strings and arrays
    (MT19937's key, PCG64's integers, any other bit generator's)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if np is not None and isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    return type(a) is type(b) and bool(a == b)


def _same_numpy(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    if a[0] != b[0]:  # read two ways: the bit generator or its layout changed in between
        return False
    return a == b if a[0] != "state" else _same_state(a[1], b[1])


def changed(before: tuple[Any, ...], after: tuple[Any, ...]) -> bool:
    """True when a generator drew (or was seeded or set to another state) between two
    :func:`draw_marks`."""
    py0, npy0, cpu0, cuda0 = before
    py1, npy1, cpu1, cuda1 = after
    # Python's state is (version, 624 words and the index, a cached normal). A draw moves the index,
    # but for a whole multiple of 624 words, which regenerates every word (MT19937's twist: a linear
    # map of period 2**19937 - 1, so the state never comes back). Comparing the whole tuple costs
    # ~15 us (625 ints); the index, the cached normal and every 39th word (16 words) cost <1 us and
    # miss a change only where a batch drew a whole number of twists and those 16 words all came
    # back equal (2**-512 for words that look random), or where a sample set a state differing only
    # in the other words.
    if py0[1][-1] != py1[1][-1] or py0[2] != py1[2] or py0[1][::39] != py1[1][::39]:
        return True
    if cpu0 != cpu1:
        return True
    if (cuda0 is None) != (cuda1 is None) or (cuda0 is not None and not torch.equal(cuda0, cuda1)):
        return True
    if npy0 is None:
        return npy1 is not None  # numpy.random imported meanwhile, to draw
    return npy1 is None or not _same_numpy(npy0, npy1)


def drawn_since(marks: tuple[Any, ...]) -> bool:
    """True when a generator :func:`draw_marks` covers has drawn since ``marks`` were taken."""
    return changed(marks, draw_marks())


def set_draw_marks(marks: tuple[Any, ...]) -> None:
    """Put the generators back as :func:`draw_marks` found them."""
    py, npy, cpu, cuda = marks
    random.setstate(py)
    npr = _numpy_random()
    if npy is not None and npr is not None:
        if npy[0] == "state":
            npr.set_state(npy[1])
        else:
            words = npy[1]
            key, pos = words_position(words)
            has_gauss, gauss = (1, npy[2]) if npy[0] == "words+normal" else (0, 0.0)
            npr.set_state(("MT19937", key, pos, has_gauss, gauss))
            _numpy_words.clear_at = None if has_gauss else words
    torch.default_generator.set_state(torch.frombuffer(bytearray(cpu), dtype=torch.uint8))
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
