"""Loaders and evaluation shards on real ranks (``ddpkit.spawn``): every sample once, the global RNG
left alone, and each sample's draws the same whatever the world size and the loader workers."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit
from ddpkit.data import (
    EvalShardSampler,
    ShardedBatchSampler,
    default_num_workers,
)
from ddpkit.testing import run_on_ranks


def _loader_worker(n: int, per_rank: int) -> dict:
    rt = ddpkit.init()
    dataset = TensorDataset(torch.arange(n))
    loader = ddpkit.build_loader(dataset, per_rank, drop_last=False, seed=4, num_workers=0)
    out = {"len": len(loader), "epochs": []}
    for _ in range(2):
        mine = [batch[0].tolist() for batch in loader]
        out["epochs"].append(ddpkit.all_gather_object(mine))

    # The loader has its own generator: iterating it leaves the global RNG where it was.
    torch.manual_seed(123)
    for _ in loader:
        pass
    after_loader = torch.rand(4)
    torch.manual_seed(123)
    untouched = torch.rand(4)
    # Control: a plain shuffling DataLoader without a generator draws from the global RNG.
    plain = DataLoader(dataset, batch_size=per_rank, shuffle=True)
    torch.manual_seed(123)
    for _ in plain:
        pass
    after_plain = torch.rand(4)
    out["rng"] = (torch.equal(after_loader, untouched), torch.equal(after_plain, untouched))

    os.environ["NSLOTS"] = "8"
    out["default_workers"] = (default_num_workers(), rt.local_world_size)
    return out


def test_build_loader_covers_each_epoch_once_and_keeps_global_rng():
    n, per_rank, world = 26, 4, 2  # global batch 8, tail of 2 samples
    results = run_on_ranks(_loader_worker, world, (n, per_rank))
    reference = ShardedBatchSampler(
        n, per_rank * world, rank=0, world_size=1, drop_last=False, seed=4
    )
    for out in results:
        assert out["len"] == 4
        assert out["rng"] == (True, False)
        assert out["default_workers"] == (8 // 2 - 1, 2)
    epochs = results[0]["epochs"]
    # all_gather_object gives every rank the same view
    assert all(out["epochs"] == epochs for out in results)
    for ranks_batches in epochs:
        seen = [i for batches in ranks_batches for b in batches for i in b]
        # every sample exactly once per epoch, over both ranks
        assert sorted(seen) == list(range(n))
        steps = zip(*ranks_batches)
        # same as one process
        assert [[i for b in step for i in b] for step in steps] == list(reference)
    assert epochs[0] != epochs[1]


def _eval_shard_worker(sizes: list[int]) -> dict:
    ddpkit.init()
    out = {}
    for n in sizes:
        sampler = EvalShardSampler(n)
        loader = ddpkit.build_eval_loader(
            TensorDataset(torch.arange(n)), batch_size=2, num_workers=0
        )
        out[n] = (list(sampler), len(sampler), [i for (batch,) in loader for i in batch.tolist()])
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_eval_shards_cover_every_sample_exactly_once(world):
    sizes = list(range(11))
    results = run_on_ranks(_eval_shard_worker, world, (sizes,))
    for n in sizes:
        shares = [out[n][0] for out in results]
        assert [i for share in shares for i in share] == list(range(n)), n
        assert [out[n][1] for out in results] == [len(s) for s in shares]
        assert max(map(len, shares)) - min(map(len, shares)) <= 1
        assert [out[n][2] for out in results] == shares  # the eval loader reads exactly that share
        # Control: DistributedSampler pads to a multiple of the world size by repeating samples.
        padded = [
            list(DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=False))
            for r in range(world)
        ]
        total = sum(map(len, padded))
        if n % world:
            assert total > n and len({i for p in padded for i in p}) == n
        else:
            assert total == n


class Noisy(torch.utils.data.Dataset):
    """Each read draws from torch, numpy and python's random, as an augmentation would."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        import random

        import numpy as np

        return i, torch.rand(()).item(), float(np.random.rand()), random.random()


class Sometimes(Noisy):
    """Draws for one sample in six only: most batches draw nothing, and which one first does depends
    on the order and the rank."""

    def __getitem__(self, i: int):
        return super().__getitem__(i) if i % 6 == 5 else (i, 0.0, 0.0, 0.0)


def _draws(num_workers: int, seed_samples: bool, dataset: type = Noisy) -> dict:
    ddpkit.init()
    loader = ddpkit.build_loader(
        dataset(), 3, seed=5, num_workers=num_workers, seed_samples=seed_samples
    )
    torch.manual_seed(123)
    draws = {}
    for epoch in range(2):
        for idx, *values in loader:
            for k, i in enumerate(idx.tolist()):
                draws[(epoch, i)] = tuple(v[k].item() for v in values)
    main_rng_kept = torch.equal(torch.rand(4), torch.manual_seed(123) and torch.rand(4))
    merged = {k: v for part in ddpkit.all_gather_object(draws) for k, v in part.items()}
    return {"draws": merged, "main_rng_kept": main_rng_kept}


def test_each_sample_draws_the_same_whatever_the_world_size_and_workers():
    one = run_on_ranks(_draws, 1, (0, True))[0]
    # loading left the training stream alone
    assert len(one["draws"]) == 48 and one["main_rng_kept"]
    two = run_on_ranks(_draws, 2, (2, True))[0]  # 2 ranks x 2 workers
    assert two["draws"] == one["draws"]
    epochs = [[one["draws"][(e, i)] for i in range(24)] for e in (0, 1)]
    assert epochs[0] != epochs[1]  # a new epoch, new draws
    # Controls: left to each process's own stream, the draws depend on the workers, and without
    # workers loading moves the training stream (dropout masks would shift).
    plain_main = run_on_ranks(_draws, 1, (0, False))[0]
    plain_workers = run_on_ranks(_draws, 1, (2, False))[0]
    assert plain_main["draws"] != plain_workers["draws"] and not plain_main["main_rng_kept"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_peek_at_the_loader_does_not_skip_an_epoch(num_workers):
    # pytorch/examples reads the batch size with next(iter(loader)) at the start of each epoch, then
    # trains.
    from ddpkit.data import epoch_permutation

    n, per_rank, seed = 16, 4, 3
    loader = ddpkit.build_loader(
        TensorDataset(torch.arange(n)), per_rank, seed=seed, num_workers=num_workers
    )
    for epoch in range(3):
        peek = next(iter(loader))[0].tolist()
        trained = [batch[0].tolist() for batch in loader]
        order = epoch_permutation(n, seed, epoch).tolist()
        assert trained == [order[i : i + per_rank] for i in range(0, n, per_rank)], epoch
        assert peek == trained[0]
    # A loop left with break does not count either: the next one yields the same epoch from its
    # start.
    for _ in loader:
        break
    assert [batch[0].tolist() for batch in loader][0] == epoch_permutation(n, seed, 3).tolist()[
        :per_rank
    ]
    assert loader.batch_sampler.epoch == 4
    # Control: the sampler counting the end of its own reads. The two workers read 4 batches ahead,
    # the whole epoch, so the sampler is read to its end by the time the peeked batch is out, and
    # the peek skips it.
    if num_workers:
        sampler = ShardedBatchSampler(n, per_rank, seed=seed, rank=0, world_size=1)
        plain = DataLoader(
            TensorDataset(torch.arange(n)), batch_sampler=sampler, num_workers=num_workers
        )
        next(iter(plain))
        assert sampler.epoch == 1


def test_a_sample_that_draws_among_many_that_do_not_draws_the_same_everywhere():
    # Seeding is paid only where a sample draws: a batch read unseeded that turns out to have drawn
    # is read again.
    one = run_on_ranks(_draws, 1, (0, True, Sometimes))[0]
    assert one["main_rng_kept"]
    two = run_on_ranks(_draws, 2, (2, True, Sometimes))[0]
    assert two["draws"] == one["draws"]
    drawn = {k: v for k, v in one["draws"].items() if k[1] % 6 == 5}
    assert len(drawn) == 8 and len(set(drawn.values())) == 8  # they drew, each its own values
    # Control: left to each process's own stream, the same samples draw otherwise.
    assert run_on_ranks(_draws, 1, (2, False, Sometimes))[0]["draws"] != one["draws"]
