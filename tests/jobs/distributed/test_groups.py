"""ddpkit on groups of ranks: a Trainer per group trains exactly what it trains alone, metrics stay
exact."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ddpkit
from ddpkit._errors import ConfigError
from ddpkit.distributed._groups import split_world
from ddpkit.testing import run_on_ranks
from ddpkit.training._config import LoggingConfig, SnapshotConfig
from ddpkit.training._trainer import Trainer, TrainerConfig
from tests.jobs.scripts.search_job import Data
from tests.trainer_checks import bitwise_equal

# Each group's candidate: its learning rate and epoch count (unequal, so one group finishes first).
CANDIDATES = [(0.05, 2), (0.2, 3)]


def _train(run_root: str, candidate: int, group=None) -> dict:
    lr, epochs = CANDIDATES[candidate]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2))
    config = TrainerConfig(
        run_dir=f"{run_root}/candidate{candidate}",
        epochs=epochs,
        global_batch_size=12,
        snapshot=SnapshotConfig(every_steps=4),
        logging=LoggingConfig(progress=False, every_steps=3),
    )
    trainer = Trainer(
        model,
        torch.optim.Adam(model.parameters(), lr=lr),
        Data(120, 7),
        config,
        val_data=Data(37, 8),
        group=group,
    )
    metrics = trainer.fit()
    return {
        "model": {k: v.clone() for k, v in ddpkit.unwrap(trainer.model).state_dict().items()},
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": None,
        "metrics": metrics,
        "rank": trainer.runtime.rank,
        "world_size": trainer.runtime.world_size,
    }


def _in_groups(run_root: str) -> dict:
    ddpkit.init()
    grt = split_world(2)
    out = _train(run_root, grt.group_index, group=grt.group)
    out["group_index"] = grt.group_index
    return out


def _alone(run_root: str, candidate: int) -> dict:
    ddpkit.init()
    return _train(run_root, candidate)


@pytest.mark.torch_at_least(2, 7, "snapshots of a group of ranks without the job's rank 0")
def test_a_trainer_per_group_equals_each_trainer_alone(tmp_path):
    results = run_on_ranks(functools.partial(_in_groups, str(tmp_path / "groups")), 4)
    assert [(r["group_index"], r["rank"], r["world_size"]) for r in results] == [
        (0, 0, 2),
        (0, 1, 2),
        (1, 0, 2),
        (1, 1, 2),
    ]
    for candidate in (0, 1):
        alone = run_on_ranks(functools.partial(_alone, str(tmp_path / "alone"), candidate), 2)[0]
        grouped = results[2 * candidate]
        assert bitwise_equal(grouped, alone), (
            f"candidate {candidate} trained differently inside a group"
        )
        assert grouped["metrics"] == alone["metrics"]
        # Each group wrote its own run directory, once: one "start" event, its own epochs.
        log = (tmp_path / "groups" / f"candidate{candidate}" / "metrics.jsonl").read_text()
        assert log.count('"event": "start"') == 1
        assert (tmp_path / "groups" / f"candidate{candidate}" / "config.json").exists()
    # The two groups trained different models, and neither group's ranks disagree.
    assert not bitwise_equal(results[0], results[2])
    assert bitwise_equal(results[0], results[1]) and bitwise_equal(results[2], results[3])


def _group_metrics() -> dict:
    ddpkit.init()
    grt = split_world(2)
    torch.manual_seed(grt.group_index)  # a different model per group
    model = ddpkit.prepare_model(nn.Linear(6, 2), runtime=grt)
    data = Data(37, 8)
    exact = ddpkit.evaluate(model, data, group=grt.group)
    # The tutorial's way: each rank divides its shard's summed loss by the whole data set's size,
    # the sums are all-reduced, and the result is divided by the world size once more.
    loader = ddpkit.build_eval_loader(data, 16, num_workers=0, group=grt.group)
    local = sum(
        nn.functional.cross_entropy(ddpkit.unwrap(model)(x), y, reduction="sum").item()
        for x, y in loader
    )
    tutorial = ddpkit.all_reduce(local / len(data), group=grt.group) / grt.world_size
    # The same model evaluated by one process on all the data.
    x, y = data.x, data.y
    reference = nn.functional.cross_entropy(ddpkit.unwrap(model)(x), y).item()
    return {
        "exact": exact["loss"],
        "tutorial": tutorial,
        "reference": reference,
        "group": grt.group_index,
    }


def test_group_metrics_are_exact_and_the_tutorials_are_off_by_the_world_size():
    results = run_on_ranks(_group_metrics, 4)
    for r in results:
        assert r["exact"] == pytest.approx(r["reference"], rel=1e-6)
        # Control: the tutorial's reduction is world_size (2) times too small.
        assert r["tutorial"] == pytest.approx(r["reference"] / 2, rel=1e-6)
    # groups differ
    assert results[0]["reference"] != pytest.approx(results[2]["reference"], rel=1e-3)


def _helpers_follow_the_group() -> dict:
    ddpkit.init()
    grt = split_world(2)
    g = grt.group
    sampler = ddpkit.data.ShardedBatchSampler(100, 5, group=g)
    out = {
        "rank": ddpkit.get_runtime(g).rank,
        "size": ddpkit.get_runtime(g).world_size,
        "sum": ddpkit.all_reduce(dist.get_rank(), group=g),
        "bcast": ddpkit.broadcast_object(f"from {dist.get_rank()}", group=g),
        "sampler": (sampler.rank, sampler.world_size),
        "runtime": (ddpkit.get_runtime(g).rank, ddpkit.get_runtime(g).world_size),
    }
    return out


def test_helpers_count_ranks_within_the_group():
    results = run_on_ranks(_helpers_follow_the_group, 4)
    assert [r["rank"] for r in results] == [0, 1, 0, 1]
    assert [r["sum"] for r in results] == [1, 1, 5, 5]
    assert [r["bcast"] for r in results] == ["from 0", "from 0", "from 2", "from 2"]
    assert [r["sampler"] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [r["runtime"] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]


def _bad_split(size: int) -> str:
    ddpkit.init()
    try:
        split_world(size)
    except ConfigError as err:
        return str(err)
    return "accepted"


def test_a_group_size_that_does_not_divide_the_world_is_refused():
    messages = run_on_ranks(functools.partial(_bad_split, 2), 3)
    assert all("group_size=2" in m and "divisor of 3" in m for m in messages)


def _world_group_after_a_group_made_alone(align: bool) -> str:
    """Rank 0 makes a group alone with ``use_local_synchronization`` (torch 2.14 on counts it on
    rank 0 only; counted here by hand, so that every torch shows it); then every rank makes a group
    of all: named alike once aligned, else each waits for the other under another name."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    from ddpkit._internals.groups import align_group_count

    if dist.get_rank() == 0:
        dist.new_group([0], backend="gloo", use_local_synchronization=True)
        c10d._world.group_count += 1  # as torch >= 2.14 counts it, on rank 0 alone
    if align:
        align_group_count()
    try:
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
        total = torch.ones(1)
        dist.all_reduce(total, group=group)
    except Exception as err:  # noqa: BLE001 -- torch's error types vary by version
        return "timed out" if "timeout" in str(err).lower() or "timed out" in str(err) else "failed"
    return f"sum {float(total.item()):g}"


def test_a_group_of_all_after_a_group_made_alone_is_named_alike_on_every_rank():
    assert run_on_ranks(_world_group_after_a_group_made_alone, 2, (True,)) == ["sum 2", "sum 2"]
    # Control: not aligned, the ranks name the group of all otherwise and never meet.
    control = run_on_ranks(_world_group_after_a_group_made_alone, 2, (False,))
    assert "timed out" in control, control
