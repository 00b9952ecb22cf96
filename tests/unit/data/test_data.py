"""Sharded training order independent of the world size, the samplers' arithmetic, and what the
loaders wrap."""

from __future__ import annotations

import os
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

import ddpkit
from ddpkit import ConfigError
from ddpkit.data import (
    ShardedBatchSampler,
    default_num_workers,
    epoch_permutation,
    shard_bounds,
)

GLOBAL_BATCH = 12


LAYOUTS = [(12, 1), (6, 2), (4, 3), (3, 4)]  # (per-rank batch, world size): the same global batch


def make_samplers(n: int, per_rank: int, world: int, **kwargs) -> list[ShardedBatchSampler]:
    return [
        ShardedBatchSampler(n, per_rank, rank=r, world_size=world, **kwargs) for r in range(world)
    ]


def one_epoch(samplers: list[ShardedBatchSampler]) -> list[list[int]]:
    """The global batches of the next epoch: each step's rank batches concatenated in rank order."""
    per_rank = [list(s) for s in samplers]
    steps = len(per_rank[0])
    assert all(len(batches) == steps for batches in per_rank), (
        "ranks must take the same number of steps"
    )
    return [[i for batches in per_rank for i in batches[step]] for step in range(steps)]


@pytest.mark.parametrize(
    "n, drop_last", [(54, True), (54, False), (48, True), (48, False), (50, True)]
)
def test_global_batches_do_not_depend_on_world_size(n, drop_last):
    per_layout = []
    for per_rank, world in LAYOUTS:
        samplers = make_samplers(n, per_rank, world, seed=7, drop_last=drop_last)
        per_layout.append([one_epoch(samplers) for _epoch in range(3)])
    for epochs in per_layout[1:]:
        assert epochs == per_layout[0]
    # And they are the epoch's permutation cut into global batches.
    for epoch, batches in enumerate(per_layout[0]):
        order = epoch_permutation(n, 7, epoch).tolist()
        kept = len(order) if not drop_last else n - n % GLOBAL_BATCH
        assert [i for b in batches for i in b] == order[:kept]
        assert all(len(b) == GLOBAL_BATCH for b in batches[: n // GLOBAL_BATCH])


def test_control_distributed_sampler_batches_depend_on_world_size():
    # Control for the test above: the usual DistributedSampler + per-rank batches reshuffles the
    # data differently for each world size, so a run cannot resume at another world size with the
    # same batches.
    def global_batches_of(per_rank: int, world: int) -> list[list[int]]:
        per = [
            list(DistributedSampler(range(48), num_replicas=world, rank=r, seed=7))
            for r in range(world)
        ]
        return [
            sum((p[s : s + per_rank] for p in per), []) for s in range(0, len(per[0]), per_rank)
        ]

    assert global_batches_of(6, 2) != global_batches_of(4, 3)


def test_full_batches_are_per_rank_size_and_tail_split_evenly():
    samplers = make_samplers(54, 3, 4, drop_last=False)  # tail of 6 samples over 4 ranks
    per_rank = [list(s) for s in samplers]
    assert all(len(batch) == 3 for batches in per_rank for batch in batches[:-1])
    assert [len(batches[-1]) for batches in per_rank] == [2, 2, 1, 1]


@pytest.mark.parametrize("per_rank, world", LAYOUTS)
def test_epoch_covers_every_sample_once_without_drop_last(per_rank, world):
    n = 12 * 4 + 5  # tail of 5 >= every world size here
    batches = one_epoch(make_samplers(n, per_rank, world, drop_last=False, seed=3))
    seen = [i for b in batches for i in b]
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("per_rank, world", LAYOUTS)
def test_drop_last_drops_only_the_tail(per_rank, world):
    n = 12 * 4 + 5
    batches = one_epoch(make_samplers(n, per_rank, world, drop_last=True, seed=3))
    seen = [i for b in batches for i in b]
    assert len(seen) == len(set(seen)) == 48
    order = epoch_permutation(n, 3, 0).tolist()
    assert set(range(n)) - set(seen) == set(order[48:])


def test_tail_smaller_than_world_is_dropped_even_without_drop_last():
    # Documented: a rank without a sample cannot take a DDP step.
    samplers = make_samplers(49, 3, 4, drop_last=False)  # tail of 1 sample, 4 ranks
    assert [len(s) for s in samplers] == [4] * 4
    assert sum(len(b) for b in one_epoch(samplers)) == 48


@pytest.mark.parametrize(
    "n, per_rank, world, drop_last, steps",
    [
        (48, 3, 4, True, 4),
        (53, 3, 4, True, 4),
        (53, 3, 4, False, 5),
        (49, 3, 4, False, 4),
        (13, 6, 2, False, 1),
        (14, 6, 2, False, 2),
    ],
)
def test_len_is_the_number_of_steps(n, per_rank, world, drop_last, steps):
    samplers = make_samplers(n, per_rank, world, drop_last=drop_last)
    assert [len(s) for s in samplers] == [steps] * world
    assert len(one_epoch(samplers)) == steps


def test_epochs_differ_and_same_seed_epoch_repeats():
    s = ShardedBatchSampler(40, 5, rank=1, world_size=2, seed=11)
    assert s.epoch == 0
    epochs = [list(s) for _ in range(3)]  # each iter() is the next epoch, with no set_epoch
    assert s.epoch == 3
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]
    for e, batches in enumerate(epochs):
        fresh = ShardedBatchSampler(40, 5, rank=1, world_size=2, seed=11)
        fresh.set_epoch(e)
        assert list(fresh) == batches


def test_seed_changes_the_order():
    # build_loader(seed=...) and ShardedBatchSampler(seed=...) promise an order that is a function
    # of (seed, epoch): two runs with different seeds must not see the same sample order.
    orders = {
        seed: list(ShardedBatchSampler(40, 5, rank=0, world_size=2, seed=seed))
        for seed in (0, 1, 11, 12)
    }
    assert len({str(o) for o in orders.values()}) == 4, orders
    perms = {seed: tuple(epoch_permutation(100, seed, 3).tolist()) for seed in (0, 1, -5, 2**40)}
    assert len(set(perms.values())) == 4


def test_no_shuffle_is_in_order_every_epoch():
    s = ShardedBatchSampler(10, 2, rank=0, world_size=2, shuffle=False, drop_last=False)
    assert list(s) == [[0, 1], [4, 5], [8]] == list(s)


def test_epoch_permutation_is_a_pure_function():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    perms = {
        (seed, e): epoch_permutation(100, seed, e) for seed in (0, -5, 2**40) for e in (0, 1, 2)
    }
    assert torch.equal(torch.rand(3), expected)  # the global RNG was not touched
    for (seed, e), p in perms.items():
        assert sorted(p.tolist()) == list(range(100))
        assert torch.equal(epoch_permutation(100, seed, e), p)
    for seed in (0, -5, 2**40):
        assert len({tuple(perms[seed, e].tolist()) for e in (0, 1, 2)}) == 3  # epochs differ


def _resume_cases():
    for drop_last in (True, False):
        for save_world, resume_world in ((2, 2), (2, 3), (3, 1), (1, 4)):
            yield drop_last, save_world, resume_world


@pytest.mark.parametrize("drop_last, save_world, resume_world", list(_resume_cases()))
def test_set_position_resumes_mid_epoch(drop_last, save_world, resume_world):
    n, epoch = 12 * 5 + 7, 3
    save = make_samplers(n, GLOBAL_BATCH // save_world, save_world, drop_last=drop_last, seed=5)
    for s in save:
        s.set_epoch(epoch)
    full = one_epoch(save)
    assert len(full) == (5 if drop_last else 6)
    # every cursor that is a whole number of global batches
    for done_steps in range(n // GLOBAL_BATCH + 1):
        cursor = done_steps * GLOBAL_BATCH
        resumed = make_samplers(
            n, GLOBAL_BATCH // resume_world, resume_world, drop_last=drop_last, seed=5
        )
        for s in resumed:
            s.set_position(epoch, cursor)
        # the length is the epoch's; the pass yields the steps left
        assert [len(s) for s in resumed] == [len(full)] * resume_world
        assert one_epoch(resumed) == full[done_steps:], (cursor, drop_last)
        # The epoch after the resumed one starts from its beginning.
        assert one_epoch(resumed) == one_epoch(_epoch_at(n, drop_last, epoch + 1))


def _epoch_at(n: int, drop_last: bool, epoch: int) -> list[ShardedBatchSampler]:
    s = ShardedBatchSampler(n, GLOBAL_BATCH, rank=0, world_size=1, drop_last=drop_last, seed=5)
    s.set_epoch(epoch)
    return [s]


@pytest.mark.parametrize("resume_world", [2, 3])
def test_resume_after_the_last_partial_batch_yields_nothing(resume_world):
    # drop_last=False: the last step trains the 7-sample tail, so a checkpoint after it saves
    # cursor == n, which set_position accepts. Resuming there must not train the tail a second time.
    n, epoch = 12 * 5 + 7, 2
    samplers = make_samplers(n, GLOBAL_BATCH // resume_world, resume_world, drop_last=False, seed=5)
    for s in samplers:
        s.set_position(epoch, n)
    assert [len(s) for s in samplers] == [6] * resume_world  # the epoch's length
    assert one_epoch(samplers) == []


def test_cursor_must_be_whole_global_batches():
    s = ShardedBatchSampler(100, 6, rank=0, world_size=2)
    with pytest.raises(
        ConfigError, match="cursor 18 is not a whole number of global batches of 12"
    ):
        s.set_position(1, 18)  # saved by a run with a global batch of 9 or 18
    s.set_position(1, 24)  # control: whole global batches are fine
    assert len(list(s)) == 100 // 12 - 2 and len(s) == 100 // 12


def test_too_few_samples_and_bad_batch_size():
    with pytest.raises(ConfigError, match="10 samples make no global batch of 12"):
        ShardedBatchSampler(10, 6, rank=0, world_size=2)
    with pytest.raises(ConfigError, match="10 samples make no global batch"):
        # a sized dataset works the same
        ShardedBatchSampler(list(range(10)), 3, rank=1, world_size=4)
    with pytest.raises(ConfigError, match="1 samples are fewer than the 2 ranks") as refused:
        ShardedBatchSampler(1, 4, rank=0, world_size=2, drop_last=False)  # 1 sample, 2 ranks
    # already passed: suggesting it again would not help
    assert "drop_last" not in str(refused.value)
    with pytest.raises(ConfigError, match="batch_size=0"):
        ShardedBatchSampler(100, 0, rank=0, world_size=1)
    # Control: without drop_last, fewer samples than a global batch still make one (smaller) step.
    assert len(ShardedBatchSampler(10, 6, rank=0, world_size=2, drop_last=False)) == 1


def test_default_num_workers(monkeypatch):
    monkeypatch.setenv("NSLOTS", "8")
    assert [default_num_workers(p) for p in (1, 2, 3, 4, 8, 16)] == [7, 3, 1, 1, 0, 0]
    assert default_num_workers() == 7  # no init: a world of one
    monkeypatch.delenv("NSLOTS")
    monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    assert default_num_workers(1) == max(0, len(os.sched_getaffinity(0)) - 1)


def test_to_device_keeps_structure():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": [torch.ones(2), (torch.zeros(1), "label")], "p": Pair(torch.arange(3), 5)}
    moved = ddpkit.to_device(batch, torch.device("cpu"))
    assert (
        isinstance(moved["a"], list)
        and isinstance(moved["a"][1], tuple)
        and isinstance(moved["p"], Pair)
    )
    assert moved["a"][1][1] == "label" and moved["p"].y == 5
    assert torch.equal(moved["p"].x, torch.arange(3)) and torch.equal(moved["a"][0], torch.ones(2))


class Noisy(torch.utils.data.Dataset):
    """Each read draws from torch, numpy and python's random, as an augmentation would."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        import random

        import numpy as np

        return i, torch.rand(()).item(), float(np.random.rand()), random.random()


class _Listed(torch.utils.data.Dataset):
    """pytorch/examples' dataset: samples in a list, read as they are."""

    def __init__(self, data) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class _DrawingList(list):
    def __getitem__(self, index):
        return super().__getitem__(index), __import__("random").random()


class _DrawsOnLookup(_Listed):
    def __getattribute__(self, name):
        __import__("random").random()
        return object.__getattribute__(self, name)


class _Index:
    """An index whose ``__index__`` draws."""

    def __init__(self, i: int) -> None:
        self.i = i

    def __index__(self) -> int:
        __import__("random").random()
        return self.i


def _drawing_under_a_torch_mode():
    from torch.overrides import TorchFunctionMode

    class Draws(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            __import__("random").random()
            return func(*args, **(kwargs or {}))

    return Draws()


HIDDEN_DRAWS = {  # name: (the dataset, the batch's indices, a context the batch is read in)
    "a TensorDataset": (lambda: TensorDataset(torch.arange(24)), [0, 1, 2], None),
    "the tutorial's list": (
        lambda: _Listed([torch.full((2,), float(i)) for i in range(24)]),
        [0, 1, 2],
        None,
    ),  # fmt: skip
    "a list subclass whose subscript draws": (
        lambda: _Listed(_DrawingList(range(24))),
        [0, 1, 2],
        None,
    ),  # fmt: skip
    "an attribute lookup that draws": (lambda: _DrawsOnLookup(list(range(24))), [0, 1, 2], None),
    "indices whose __index__ draws": (
        lambda: _Listed(list(range(24))),
        [_Index(0), _Index(1)],
        None,
    ),  # fmt: skip
    "a TensorDataset under a torch mode that draws": (
        lambda: TensorDataset(torch.arange(24)),
        [0, 1, 2],
        _drawing_under_a_torch_mode,
    ),
}


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "control-unseeded"])
@pytest.mark.parametrize("name", list(HIDDEN_DRAWS))
def test_every_dataset_is_watched_so_draws_hidden_in_its_reads_are_seeded(name, seeded):
    """No dataset is read unwatched: a draw wherever it hides in a read (a list subclass, an
    attribute lookup, an index, a torch mode) gives the seeded samples whatever the process's
    stream, and loading leaves python's and torch's streams where they were. Control: read as they
    are, the samples follow the process's stream."""
    import contextlib
    import random

    from ddpkit.data import SeededSamples
    from ddpkit.data._sampler import EpochIndices

    make, indices, context = HIDDEN_DRAWS[name]
    outs, moved = [], False
    for g in (11, 22):
        dataset = make()
        random.seed(g), torch.manual_seed(g)
        before = random.getstate(), torch.get_rng_state()
        with context() if context else contextlib.nullcontext():
            if seeded:
                out = SeededSamples(dataset, seed=3).__getitems__(EpochIndices(indices, 0))
            else:
                out = [dataset[i] for i in indices]
        after = random.getstate(), torch.get_rng_state()
        moved = moved or after[0] != before[0] or not torch.equal(after[1], before[1])
        outs.append(repr(out))
    draws = "draw" in name
    assert (outs[0] == outs[1] and not moved) is (seeded or not draws)


def test_a_batchs_epoch_indices_and_its_epoch_index_pairs_read_the_same_draws():
    """A keyed sampler yields one ``EpochIndices`` a batch (one object, not a pair a sample);
    ``SeededSamples`` reads it as the ``(epoch, index)`` pairs a DataLoader over another sampler
    gives, and it travels to a loader worker (pickled) with its epoch. Control: another epoch draws
    otherwise."""
    import pickle

    from ddpkit.data import SeededSamples, ShardedBatchSampler
    from ddpkit.data._sampler import EpochIndices

    sampler = ShardedBatchSampler(24, 3, keyed=True, rank=0, world_size=1)
    sampler.set_position(4, 0)
    keys = next(iter(sampler))
    assert isinstance(keys, EpochIndices) and keys.epoch == 4 and len(keys) == 3
    sent = pickle.loads(pickle.dumps(keys))
    assert type(sent) is EpochIndices and (list(sent), sent.epoch) == (list(keys), 4)
    pairs = [(4, i) for i in keys]
    read = [SeededSamples(Noisy(), seed=7).__getitems__(k) for k in (keys, sent, pairs)]
    assert read[0] == read[1] == read[2]
    # a drawing batch is read twice (the first time as it is): a new SeededSamples for each key form
    assert SeededSamples(Noisy(), seed=7).__getitems__(EpochIndices(keys, 5)) != read[0]
    # a slice is a plain list, without the epoch: refused, naming the way to keep it
    with pytest.raises(TypeError, match=r"EpochIndices\(batch\[a:b\], batch.epoch\)"):
        SeededSamples(Noisy(), seed=7).__getitems__(keys[:2])


class Plain(torch.utils.data.Dataset):
    """No ``__getitems__``: read one sample at a time."""

    def __len__(self) -> int:
        return 23

    def __getitem__(self, i: int):
        return {"x": torch.full((2,), float(i)), "i": i}


def _pairs(batch):
    return [(d["i"], d["x"].sum().item()) for d in batch]


@pytest.mark.parametrize(
    "dataset, kwargs",
    [(Noisy, {}), (Plain, {"seed_samples": False, "collate_fn": _pairs, "drop_last": False})],
)
def test_the_loaders_pass_gives_the_dataloaders_batches(dataset, kwargs):
    """The loader's pass hands over the very batches the DataLoader's own iterator gives, with and
    without per-sample seeding, ``__getitems__`` or a ``collate_fn``, over epochs."""
    from torch.utils.data import DataLoader

    own = ddpkit.build_loader(dataset(), 3, num_workers=0, pin_memory=False, **kwargs)
    theirs = ddpkit.build_loader(dataset(), 3, num_workers=0, pin_memory=False, **kwargs)
    for _ in range(2):
        mine = list(own)
        # the DataLoader's own iterator over the same dataset and sampler (which counts the epoch
        # itself, read outside the loader's pass)
        batches = list(DataLoader.__iter__(theirs))
        assert len(mine) == len(batches) == len(own.batch_sampler) > 0
        for a, b in zip(mine, batches):
            assert type(a) is type(b) and len(a) == len(b)
            for x, y in zip(a, b):
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (x, y)
    assert own.epoch == theirs.epoch == 2


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_places_of_a_steps_samples_cover_it_once(drop_last):
    # 235 samples, global batches of 12 (6 per rank on 2 ranks), two batches a step: the last batch
    # has 7 (4/3) and is kept, or dropped with drop_last, which leaves the last step one batch
    # of 12.
    ranks = make_samplers(235, 6, 2, drop_last=drop_last)
    last = ranks[0].steps_per_epoch - 1
    assert (last, ranks[0].samples_in_batch(last)) == ((19, 7) if not drop_last else (18, 12))
    for micro in range(0, last + 1, 2):
        size = ranks[0].samples_in_step(micro, 2)
        places = []
        for s in ranks:
            for m in range(micro, min(micro + 2, last + 1)):
                assert s.samples_in_step(m, 2) == size
                step_size, offset = s.place_in_step(m, 2)
                assert step_size == size
                lo, hi = shard_bounds(s.samples_in_batch(m), 2, s.rank)
                places += range(offset, offset + hi - lo)
        assert size == (24 if micro < 18 else 19 if not drop_last else 12)
        assert sorted(places) == list(range(size))


def test_a_steps_samples_are_the_sum_of_its_batches_for_every_shape_of_epoch():
    """samples_in_step is computed in closed form (once a step); it must be the sum of its
    batches' samples for every dataset size, batch, world size, drop_last and accumulation,
    including the epochs whose tail is too small to be a batch."""
    import itertools

    checked = short = 0
    for n, batch, world, drop, accum in itertools.product(
        range(1, 40), (1, 2, 3, 5), (1, 2, 3, 4), (False, True), (1, 2, 3)
    ):
        try:
            s = ShardedBatchSampler(n, batch, rank=0, world_size=world, drop_last=drop)
        except ConfigError:  # fewer samples than a global batch (or than ranks)
            continue
        for micro in range(s.steps_per_epoch):
            first = micro - micro % accum
            batches = range(first, min(first + accum, s.steps_per_epoch))
            total = sum(s.samples_in_batch(m) for m in batches)
            assert s.samples_in_step(micro, accum) == total
            checked += 1
            short += total != len(batches) * s.global_batch_size
    # Control: the cases include steps a full-batches count gets wrong (an epoch's short tail).
    assert checked > 15000 and short > 1000


def test_an_iteration_left_before_its_end_does_not_count_as_an_epoch():
    s = ShardedBatchSampler(40, 5, rank=1, world_size=2, seed=11)
    first = next(iter(s))
    assert s.epoch == 0 and list(s)[0] == first  # a peek leaves the epoch where it was
    assert s.epoch == 1
    s.set_position(3, 20)
    it = iter(s)
    next(it)
    s.set_position(5, 0)
    list(it)  # an iteration that ends after the position moved does not move it again
    assert (s.epoch, len(s)) == (5, 4)


def test_a_dataset_that_draws_nothing_is_not_seeded(monkeypatch):
    import ddpkit.data._loader as loader_module

    seeded = []
    real = loader_module.seed_sample
    monkeypatch.setattr(loader_module, "seed_sample", lambda *key: seeded.append(key) or real(*key))

    # pytorch/examples' dataset: tensors in a list, read as they are
    class Plain(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.data = [(torch.rand(4), torch.rand(1)) for _ in range(24)]

        def __len__(self) -> int:
            return len(self.data)

        def __getitem__(self, i: int):
            return self.data[i]

    batches = list(ddpkit.build_loader(Plain(), 3, num_workers=0))
    assert len(batches) == 8 and seeded == []

    class PutsBack(Plain):  # moves torch's generator and puts it back: its state is what it was
        def __getitem__(self, i: int):
            with torch.random.fork_rng():
                torch.rand(())
            return self.data[i]

    torch.randn(())
    # a normal sample cached and used: its stale value is in the generator, set_state's differs
    torch.randn(())
    list(ddpkit.build_loader(PutsBack(), 3, num_workers=0))
    assert seeded == []
    # Control: a dataset that draws is seeded, every sample once (its first batch, read unseeded,
    # drew: read again).
    list(ddpkit.build_loader(Noisy(), 3, num_workers=0))
    assert sorted(index for _, _, index in seeded) == list(range(24))


def _cache_normals() -> None:
    """Leave a normal sample cached in python's, numpy's and torch's generators: each draws normals
    in pairs and keeps the second apart from its words, so using it moves nothing but that cache."""
    import random

    import numpy as np

    while random.getstate()[2] is None:
        random.gauss(0, 1)
    while not np.random.get_state()[3]:
        np.random.standard_normal()
    # torch's cache has no public reader: seeding empties it, then one normal fills it
    torch.manual_seed(1234)
    torch.randn(())


def _another_numpy_state() -> tuple:
    """numpy's global state with the same position and cached normal, but other words: only the key
    differs."""
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return kind, np.roll(keys, 1), pos, has_gauss, gauss


@pytest.mark.parametrize(
    "draw",
    [
        lambda: __import__("random").random(),
        # a whole twist: the index comes back
        lambda: [__import__("random").getrandbits(32) for _ in range(624)],
        lambda: __import__("random").gauss(0, 1),
        lambda: __import__("numpy").random.rand(),
        lambda: __import__("numpy").random.randint(0, 2**31, size=624),
        lambda: torch.rand(()),
        lambda: torch.randn(()),  # only the normal sample torch cached before the batch
        lambda: torch.randn(3),
        lambda: torch.randint(0, 2**31, (624,)),
        # seeded again: the position moved back
        lambda: torch.manual_seed(torch.initial_seed()) and None,
        lambda: __import__("random").seed(7),  # a dataset seeding the generators itself
        lambda: __import__("numpy").random.seed(7),
        lambda: __import__("numpy").random.set_state(_another_numpy_state()),
        lambda: __import__("numpy").random.standard_normal(),
        lambda: __import__("numpy").random.set_bit_generator(__import__("numpy").random.PCG64(1)),
    ],
)
def test_a_held_batch_sees_every_draw_and_puts_the_generators_back(draw):
    """Every kind of draw, reseed or set state during a batch is seen, and the generators are put
    back as they were: python's and torch's states, numpy's own generator's words and position (its
    cached normal is dropped: the batch drew from a stand-in)."""
    import numpy as np

    from ddpkit.data._loader import Held
    from ddpkit.distributed._seeding import rng_state

    _cache_normals()
    full = rng_state()
    held = Held()
    assert not held.drawn()
    draw()
    assert held.drawn()
    held.put_back()
    held.release_numpy()
    after = rng_state()
    assert after["python"] == full["python"] and torch.equal(after["torch"], full["torch"])
    assert all(np.array_equal(a, b) for a, b in zip(after["numpy"][1:3], full["numpy"][1:3]))
    assert full["numpy"][3] == 1 and after["numpy"][3] == 0  # the cached normal, dropped


@pytest.mark.parametrize("twists", [1, 2, 3])
def test_whole_twists_of_python_words_from_many_states_are_draws(twists):
    """The comparison of python's state reads its index, its cached normal and 16 of its 624 words
    (every 39th): a draw of whole twists brings the index back and must show in those words, from
    any state. Control: the index alone misses every one of them."""
    import random

    from ddpkit.data._loader import Held

    for seed in range(200):
        random.seed(seed)
        random.getrandbits(32 * (seed % 624 + 1))  # any index
        held = Held()
        random.getrandbits(32 * 624 * twists)
        assert held.drawn(), seed
        held.release_numpy()
        assert held.python[1][-1] == random.getstate()[1][-1]  # control: the index came back


@pytest.mark.heavy
def test_numpy_random_is_imported_before_a_batch_so_its_draws_are_seen():
    """A batch that imports ``numpy.random`` to draw, in a process that had not imported it, draws
    from the stand-in: the holding imported it first."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from ddpkit.data._loader import Held\n"
        "assert 'numpy.random' not in sys.modules\n"
        "held = Held()\n"
        "import numpy.random\n"
        "assert not held.drawn()\n"
        "numpy.random.rand()\n"
        "assert held.drawn()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("kind", ["python", "numpy", "torch"])
def test_each_kind_of_draw_is_seen_by_its_own_part_of_the_comparison(kind):
    """Control: the comparison is what sees each kind of draw; the parts for the other generators
    see nothing of it."""
    import random

    import numpy as np

    from ddpkit.data._loader import Held

    held = Held()
    {"python": random.random, "numpy": np.random.rand, "torch": lambda: torch.rand(())}[kind]()
    assert held.drawn()
    seen = {
        "python": random.getstate() != held.python,
        "numpy": held._numpy_drawn(),
        "torch": not torch.equal(torch.get_rng_state(), held.torch),
    }
    held.put_back()
    held.release_numpy()
    assert seen == {k: k == kind for k in seen}


def test_another_bit_generator_is_set_aside_and_put_back():
    """A bit generator other than MT19937 behind numpy's global functions: swapped out for the
    batch and put back as it was."""
    import numpy as np

    from ddpkit.data._loader import Held

    if not hasattr(np.random, "set_bit_generator"):
        pytest.skip("numpy < 1.25 has no set_bit_generator")
    saved = np.random.get_bit_generator()
    own = np.random.PCG64(5)
    np.random.set_bit_generator(own)
    try:
        state = own.state
        held = Held()
        assert not held.drawn()
        np.random.rand()
        assert held.drawn()
        held.release_numpy()
        assert np.random.get_bit_generator() is own and own.state == state
    finally:
        np.random.set_bit_generator(saved)


def _nothing_drawn_in_fork_rng() -> None:
    with torch.random.fork_rng():
        pass


@pytest.mark.parametrize(
    "put_back",
    [
        lambda: torch.set_rng_state(torch.get_rng_state()),
        _nothing_drawn_in_fork_rng,
        lambda: __import__("random").setstate(__import__("random").getstate()),
        lambda: __import__("numpy").random.set_state(__import__("numpy").random.get_state()),
    ],
)
def test_a_state_set_to_itself_is_no_draw(put_back):
    from ddpkit.data._loader import Held

    # set_state writes its stack's bytes where no normal sample is cached: different each time
    for _ in range(20):
        torch.randn(())
        torch.randn(())  # a normal sample cached, then used: its stale value stays in the generator
        held = Held()
        put_back()
        assert not held.drawn()
        held.release_numpy()


# -- the loader's state and the data's fingerprint -------------------------------------------------


def test_the_fingerprint_holds_the_global_batch_not_the_world_size():
    two = ShardedBatchSampler(100, 8, rank=1, world_size=2, seed=3).fingerprint()
    one = ShardedBatchSampler(100, 16, rank=0, world_size=1, seed=3).fingerprint()
    assert one == two and two["global batch"] == 16
    from ddpkit.data._fingerprint import changes

    other = ShardedBatchSampler(
        90, 8, rank=0, world_size=1, seed=4, shuffle=False, drop_last=False
    ).fingerprint()
    assert changes(one, other) == [
        "dataset length: 100 -> 90",
        "seed: 3 -> 4",
        "shuffle: True -> False",
        "drop_last: True -> False",
        "global batch: 16 -> 8",
    ]


def test_the_loader_state_is_the_batches_handed_over_and_resumes_there():
    data = TensorDataset(torch.arange(40))
    loader = ddpkit.build_loader(data, 8, seed=1, num_workers=0)
    assert loader.state_dict()["epoch"] == 0 and loader.state_dict()["cursor"] == 0
    first = []
    for batch in loader:
        first.append(batch[0].tolist())
        if len(first) == 2:
            break
    state = loader.state_dict()
    assert (state["epoch"], state["cursor"]) == (0, 16)
    assert state["fingerprint"]["dataset length"] == 40
    resumed = ddpkit.build_loader(data, 8, seed=1, num_workers=0)
    resumed.load_state_dict(state)
    rest = [batch[0].tolist() for batch in resumed]
    assert sorted(sum(first + rest, [])) == list(range(40))  # each sample once in the epoch
    assert resumed.position() == (1, 0)  # an epoch handed over whole is the next one
    # the epoch's end without StopIteration (a loop that takes exactly its steps): the same
    for _ in loader:
        pass
    tail = iter(loader)
    for _ in range(len(tail)):
        next(tail)
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["cursor"] == 0


def test_a_resumed_loader_says_its_epoch_and_the_index_of_its_next_batch():
    data = TensorDataset(torch.arange(40))
    loader = ddpkit.build_loader(data, 8, seed=1, num_workers=0)  # 5 batches an epoch
    assert (loader.epoch, loader.batch_in_epoch, loader.finishing_epoch) == (0, 0, False)
    seen = []
    for i, _ in enumerate(loader, start=loader.batch_in_epoch):
        assert i == loader.batch_in_epoch - 1  # the batch just handed over
        seen.append((i, loader.finishing_epoch))
        if i == 2:
            break
    assert seen == [(0, False), (1, False), (2, False)]
    resumed = ddpkit.build_loader(data, 8, seed=1, num_workers=0)
    resumed.load_state_dict(loader.state_dict())
    # not 0: the index the uninterrupted loop is at
    assert (resumed.epoch, resumed.batch_in_epoch) == (0, 3)
    rest = [
        (i, resumed.finishing_epoch) for i, _ in enumerate(resumed, start=resumed.batch_in_epoch)
    ]
    # At the last batch the loader says the next epoch, while the code after the loop has not run
    # yet.
    assert rest == [(3, False), (4, True)]
    assert (resumed.epoch, resumed.batch_in_epoch, resumed.finishing_epoch) == (1, 0, False)


def _accumulating_loop(run_dir: str, stop_after: int | None = None) -> dict:
    """Hugging Face's accumulation idiom in a hand loop: 4 batches an optimizer step, the epoch's
    last partial step taken at ``i == len(loader) - 1``, the batches numbered from
    ``loader.batch_in_epoch``, a warm-up from lr 0, clipping; 10 batches an epoch, 2 epochs.
    Stopped after optimizer step ``stop_after`` (a snapshot every step), as a kill would stop it."""
    ddpkit.seed_everything(0)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 6, generator=g)
    data = TensorDataset(x, (x.sum(1) > 0).long())
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, step / 3))
    loader = ddpkit.build_loader(data, batch_size=4, num_workers=0)
    snapshots = ddpkit.Snapshots(run_dir, model=model, optimizer=optimizer, scheduler=scheduler,
                                 loader=loader, every_steps=1)  # fmt: skip
    snapshots.resume()
    accum, lengths = 4, []
    for _ in range(loader.epoch, 2):
        lengths.append(len(loader))
        for i, (xb, yb) in enumerate(loader, start=loader.batch_in_epoch):
            loss = torch.nn.functional.cross_entropy(model(xb), yb) / accum
            loss.backward()
            if (i + 1) % accum == 0 or i == len(loader) - 1:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                snapshots.step()
                if snapshots.steps == stop_after:
                    snapshots.close()
                    return {}
    snapshots.close()
    return {"model": model.state_dict(), "steps": snapshots.steps, "lengths": lengths}


@pytest.mark.parametrize("length", ["epoch", "control-batches-left"])
def test_an_accumulating_loop_resumed_mid_epoch_ends_bitwise_where_it_would_have(
    tmp_path, monkeypatch, length
):
    # Stopped after step 2 (batch 7 of 10): the resumed pass hands over batches 8 and 9, and the
    # epoch's last, partial step is taken at batch 9 = len(loader) - 1.
    if length != "epoch":  # the length as it was: the batches left to the pass
        monkeypatch.setattr(
            ShardedBatchSampler, "__len__", lambda s: max(0, s.steps_per_epoch - s._first_step())
        )
    whole = _accumulating_loop(str(tmp_path / "whole"))
    _accumulating_loop(str(tmp_path / "run"), stop_after=2)
    resumed = _accumulating_loop(str(tmp_path / "run"))
    assert whole["steps"] == 6 and whole["lengths"] == [10, 10]
    same = resumed["steps"] == 6 and all(
        torch.equal(resumed["model"][k], v) for k, v in whole["model"].items()
    )
    if length == "epoch":
        assert resumed["lengths"] == [10, 10] and same
    else:  # the partial step skipped: it steps mid-accumulation in the next epoch and ends short
        assert resumed["lengths"] == [2, 10] and resumed["steps"] == 5 and not same


def test_a_changed_length_is_refused_or_restarts_the_epoch():
    loader = ddpkit.build_loader(TensorDataset(torch.arange(40)), 8, seed=1, num_workers=0)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    longer = TensorDataset(torch.arange(48))
    with pytest.raises(
        ConfigError, match=r"dataset length: 40 -> 48\): resuming at sample 16 of epoch 0"
    ) as err:
        ddpkit.build_loader(longer, 8, seed=1, num_workers=0).load_state_dict(state)
    assert "\n" not in str(err.value) and "on_data_change='restart_epoch'" in str(err.value)
    restarted = ddpkit.build_loader(
        longer, 8, seed=1, num_workers=0, on_data_change="restart_epoch"
    )
    restarted.load_state_dict(state)
    assert restarted.data_changes == ["dataset length: 40 -> 48"]
    assert sorted(int(i) for (batch,) in restarted for i in batch) == list(range(48))
    with pytest.raises(ConfigError, match="on_data_change takes one of 'error', 'restart_epoch'"):
        ddpkit.build_loader(longer, 8, on_data_change="ignore")  # type: ignore[arg-type]


def test_many_shards_are_kept_as_one_digest():
    from ddpkit.data._fingerprint import LISTED_SHARDS, changes, shard_items

    few = shard_items(["a: 3 records", "b: 4 records"])
    assert few == {"shards": 2, "shard files": "a: 3 records\nb: 4 records"}
    assert changes(few, shard_items(["a: 3 records", "b: 5 records"])) == [
        "shard 1: b: 4 records -> b: 5 records"
    ]
    assert changes(few, shard_items(["a: 3 records"])) == [
        "shards: 2 -> 1",
        "shard 1: b: 4 records -> (none)",
    ]
    many = [f"part{k}: 10 records" for k in range(LISTED_SHARDS + 1)]
    items = shard_items(many)
    assert set(items) == {"shards", "shard list"}
    swapped = shard_items([many[1], many[0], *many[2:]])
    assert changes(items, swapped) == [
        f"shard list: {items['shard list']} -> {swapped['shard list']}"
    ]
