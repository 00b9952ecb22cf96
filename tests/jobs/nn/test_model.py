"""prepare_model / unwrap under real DDP, global-batch BatchNorm on CPU, and seeding."""

from __future__ import annotations

import contextlib
import functools
import random

import numpy as np
import pytest
import torch
import torch._dynamo  # noqa: F401  DDP imports it lazily: once here, not in every forked worker (seconds each)
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpkit
from ddpkit.distributed._seeding import rng_state, set_rng_state
from ddpkit.nn._batchnorm import CPUSyncBatchNorm, convert_sync_batchnorm
from ddpkit.testing import run_on_ranks

# ---------------------------------------------------------------------------------------- the model


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn2d = nn.BatchNorm2d(4)
        self.fc1 = nn.Linear(4 * 2 * 2, 8)
        # cumulative average: the other running-stat rule
        self.bn1d = nn.BatchNorm1d(8, momentum=None)
        self.fc2 = nn.Linear(8, 3)
        self.register_buffer("scale", torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.adaptive_avg_pool2d(F.relu(self.bn2d(self.conv(x))), 2).flatten(1)
        return self.fc2(F.relu(self.bn1d(self.fc1(x)))) * self.scale


def fixed_net() -> Net:
    torch.manual_seed(1234)
    return Net()


def global_batches(steps: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    # Per-channel offsets and scales, so that the statistics of a slice and of the whole batch
    # differ.
    offset = torch.tensor([0.5, -1.0, 2.0]).reshape(1, 3, 1, 1)
    return [
        (
            torch.randn(size, 3, 5, 5, generator=g) * 1.5 + offset,
            torch.randint(0, 3, (size,), generator=g),
        )
        for _ in range(steps)
    ]


def checksums(module: nn.Module) -> dict[str, float]:
    return {
        k: v.double().sum().item() + v.double().abs().sum().item()
        for k, v in module.state_dict().items()
    }


# ------------------------------------------------------------------------------------ prepare_model


def _prepare_worker() -> dict:
    rt = ddpkit.init()
    torch.manual_seed(100 + rt.rank)  # every rank builds a different model
    model = Net()
    with torch.no_grad():
        model.bn2d.running_mean.uniform_()  # buffers differ too
    before = checksums(model)
    wrapped = ddpkit.prepare_model(model)
    after = checksums(ddpkit.unwrap(wrapped))
    # One step on rank-specific data keeps the replicas identical (gradients are averaged).
    x = torch.randn(4, 3, 5, 5) + rt.rank
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    wrapped(x).square().mean().backward()
    opt.step()
    return {
        "before": before,
        "after": after,
        "after_step": {
            k: v for k, v in checksums(ddpkit.unwrap(wrapped)).items() if "running" not in k
        },
        "is_ddp": isinstance(wrapped, DDP),
        "unwrap_is_inner": ddpkit.unwrap(wrapped) is model and wrapped.module is model,
    }


@pytest.mark.parametrize("world", [2, 3])
def test_prepare_model_makes_every_rank_start_from_rank0(world):
    results = run_on_ranks(_prepare_worker, world)
    # Control: before wrapping, the ranks' models differ (parameters and buffers).
    for key in ("conv.weight", "fc2.bias", "scale", "bn2d.running_mean"):
        assert len({out["before"][key] for out in results}) == world, key
    for out in results:
        assert out["is_ddp"] and out["unwrap_is_inner"]
        assert out["after"] == results[0]["before"]  # rank 0's parameters and buffers, everywhere
        assert out["after_step"] == results[0]["after_step"]


def _accumulate(skip_first_sync: bool, compiled: bool = False) -> list[float]:
    """Two micro-batches of rank-specific data; the first backward under ``ddpkit.no_sync`` or not
    (given the model as ``torch.compile`` wraps it, with ``compiled``). The gradient right after the
    first backward: this rank's own if the all-reduce was skipped."""
    rt = ddpkit.init()
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Linear(3, 1))
    x = torch.full((2, 3), float(rt.rank + 1))
    # compiled lazily: the forward below is the model's
    wrapped = torch.compile(model) if compiled else model
    with ddpkit.no_sync(wrapped) if skip_first_sync else contextlib.nullcontext():
        model(x).sum().backward()
    first = model.module.weight.grad.clone()
    # synchronised: the sum over both micro-batches, averaged over the ranks
    model(x).sum().backward()
    return [first.sum().item(), model.module.weight.grad.sum().item()]


def test_no_sync_skips_the_all_reduce_until_the_steps_last_micro_batch():
    skipped = run_on_ranks(functools.partial(_accumulate, True), 2)
    assert skipped[0][0] != skipped[1][0]  # each rank's own gradient: no all-reduce yet
    # both micro-batches, averaged
    assert skipped[0][1] == skipped[1][1] == pytest.approx(2 * (2 * 3 * (1 + 2) / 2))
    # Control: without it the first backward is all-reduced too (the same gradient on both ranks at
    # once).
    synced = run_on_ranks(functools.partial(_accumulate, False), 2)
    assert synced[0][0] == synced[1][0]
    # Given the model as torch.compile wraps it, it finds DDP inside.
    through = run_on_ranks(functools.partial(_accumulate, True, True), 2)
    assert through[0][0] != through[1][0]
    # In a world of one (no DDP) there is nothing to skip, and the loop runs as it is.
    model = nn.Linear(3, 1)
    with ddpkit.no_sync(model):
        model(torch.ones(1, 3)).sum().backward()
    assert model.weight.grad is not None


def test_world_of_one_gets_the_plain_module():
    assert not dist.is_initialized()
    model = Net()
    prepared = ddpkit.prepare_model(model, sync_batchnorm=True)
    assert prepared is model and not isinstance(prepared, DDP)
    assert type(prepared.bn2d) is nn.BatchNorm2d  # nothing to synchronise with
    assert ddpkit.unwrap(prepared) is model
    compiled = torch.compile(model)  # compilation is lazy: nothing is compiled until it is called
    assert compiled is not model and ddpkit.unwrap(compiled) is model


# ---------------------------------------------------------------------------------- sync batch norm


def train(model: nn.Module, batches, part: slice) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for x, y in batches:
        opt.zero_grad()
        F.cross_entropy(model(x[part]), y[part]).backward()
        opt.step()


def _sync_bn_worker(sync: bool, steps: int, size: int) -> dict:
    rt = ddpkit.get_runtime()  # run_on_ranks: collectives wait 30 s at most
    model = ddpkit.prepare_model(fixed_net(), sync_batchnorm=sync)
    per_rank = size // rt.world_size
    train(model, global_batches(steps, size), slice(rt.rank * per_rank, (rt.rank + 1) * per_rank))
    inner = ddpkit.unwrap(model)
    out = {
        "state": {k: v.clone() for k, v in inner.state_dict().items()},
        "types": (type(inner.bn2d).__name__, type(inner.bn1d).__name__),
        "momentum": inner.bn1d.momentum,
    }
    if rt.rank == 0:
        # Eval mode uses the running statistics: no collective (rank 0 runs it alone), and a
        # sample's output does not depend on the batch it is in.
        inner.eval()
        x = global_batches(1, 6)[0][0]
        out["eval_batch"] = inner(x).detach()
        out["eval_single"] = torch.cat([inner(x[i : i + 1]) for i in range(len(x))]).detach()
        inner.train()
    ddpkit.barrier()
    return out


def _reference(steps: int, size: int) -> nn.Module:
    model = fixed_net()
    train(model, global_batches(steps, size), slice(None))
    return model


def _max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for key in a:
        x, y = a[key].double(), b[key].double()
        worst = max(worst, ((x - y).abs() / (y.abs() + 1e-6)).max().item())
    return worst


@pytest.mark.parametrize("world", [2, 3])
def test_sync_batchnorm_matches_one_process_on_the_global_batch(world):
    steps, size = 3, 12
    reference = _reference(steps, size)
    expected = reference.state_dict()
    results = run_on_ranks(_sync_bn_worker, world, (True, steps, size))
    for out in results:
        assert out["types"] == ("CPUSyncBatchNorm", "CPUSyncBatchNorm")
        assert out["momentum"] is None
        assert set(out["state"]) == set(expected)
        for key, value in expected.items():
            torch.testing.assert_close(out["state"][key], value, rtol=1e-5, atol=1e-6, msg=key)
        assert out["state"]["bn2d.num_batches_tracked"].item() == steps
    rank0 = results[0]
    torch.testing.assert_close(rank0["eval_batch"], rank0["eval_single"], rtol=1e-5, atol=1e-6)
    reference.eval()
    torch.testing.assert_close(rank0["eval_batch"], reference(global_batches(1, 6)[0][0]).detach())


def test_plain_batchnorm_under_ddp_does_not_match_one_process():
    # Control for the test above: without sync, each rank normalises its own slice.
    steps, size = 3, 12
    expected = _reference(steps, size).state_dict()
    results = run_on_ranks(_sync_bn_worker, 2, (False, steps, size))
    assert results[0]["types"] == ("BatchNorm2d", "BatchNorm1d")
    assert _max_rel_diff(results[0]["state"], expected) > 1e-3
    running = {k: v for k, v in results[0]["state"].items() if "running" in k}
    assert _max_rel_diff(running, {k: expected[k] for k in running}) > 1e-3


def _far_from_zero_worker() -> tuple[float, float]:
    """Rank r's half of 64 float64 samples of mean 1000 and spread 1 through a synced BatchNorm,
    against torch's BatchNorm over all of them: the largest output difference and the largest
    input gradient difference (relative)."""
    rt = ddpkit.get_runtime()  # run_on_ranks: collectives wait 30 s at most
    g = torch.Generator().manual_seed(0)
    x = 1000 + torch.randn(64, 8, generator=g, dtype=torch.float64)
    weights = torch.arange(8, dtype=torch.float64)
    mine = x[rt.rank * 32 : (rt.rank + 1) * 32].clone().requires_grad_()
    synced = ddpkit.prepare_model(
        nn.Sequential(nn.BatchNorm1d(8, dtype=torch.float64)), sync_batchnorm=True
    )
    out = synced(mine)
    (out * weights).square().sum().backward()
    whole = x.clone().requires_grad_()
    reference = nn.BatchNorm1d(8, dtype=torch.float64)(whole)
    (reference * weights).square().sum().backward()
    part = slice(rt.rank * 32, (rt.rank + 1) * 32)
    grad = (mine.grad - whole.grad[part]).abs().max() / whole.grad.abs().max()
    return float((out - reference[part]).abs().max()), float(grad)


def test_sync_batchnorm_keeps_float64s_digits_far_from_zero():
    # E[x^2] - E[x]^2 loses the digits of mean^2 / var (1e6 here): in float64 inputs' own precision
    # there are none to spare. Seen: 6e-13 and 5e-9 (with that formula: 4e-10 and 9e-6).
    for out, grad in run_on_ranks(_far_from_zero_worker, 2):
        assert out < 1e-11 and grad < 1e-7, (out, grad)


def test_convert_sync_batchnorm_keeps_parameters_buffers_and_modes():
    model = fixed_net()
    model.bn1d.eval()
    bn2d_weight, bn2d_mean, bn1d_var = (
        model.bn2d.weight,
        model.bn2d.running_mean,
        model.bn1d.running_var,
    )
    x = global_batches(1, 6)[0][0]
    expected = model(x).detach()
    converted = convert_sync_batchnorm(model, torch.device("cpu"))
    assert isinstance(converted.bn2d, CPUSyncBatchNorm) and isinstance(
        converted.bn1d, CPUSyncBatchNorm
    )
    assert converted.bn2d.weight is bn2d_weight and converted.bn2d.running_mean is bn2d_mean
    assert converted.bn1d.running_var is bn1d_var
    assert converted.bn2d.training and not converted.bn1d.training
    assert converted.bn1d.momentum is None and converted.bn2d.eps == 1e-5
    # Without a process group the layer is plain BatchNorm.
    torch.testing.assert_close(converted(x).detach(), expected)
    top = convert_sync_batchnorm(nn.BatchNorm1d(5), torch.device("cpu"))
    assert isinstance(top, CPUSyncBatchNorm)


# ----------------------------------------------------------------------------------------- seeding


def _seed_worker() -> dict:
    ddpkit.init()
    same = ddpkit.seed_everything(7)
    shared = checksums(Net())
    own = ddpkit.seed_everything(7, per_rank=True)
    return {"seeds": (same, own), "shared": shared, "own": checksums(Net()), "py": random.random()}


def test_seed_everything_same_or_per_rank():
    results = run_on_ranks(_seed_worker, 2)
    assert [out["seeds"] for out in results] == [(7, 7), (7, 8)]
    assert results[0]["shared"] == results[1]["shared"]
    assert results[0]["own"] != results[1]["own"]
    assert results[0]["py"] != results[1]["py"]


def test_rng_state_round_trip_through_a_weights_only_file(tmp_path):
    saved_torch, saved_py, saved_np = (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(),
    )
    try:
        ddpkit.seed_everything(3)
        torch.save(rng_state(), tmp_path / "rng.pt")
        first = (torch.rand(3), random.random(), np.random.rand())
        ddpkit.seed_everything(4)
        other = (torch.rand(3), random.random(), np.random.rand())
        set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
        again = (torch.rand(3), random.random(), np.random.rand())
        assert torch.equal(first[0], again[0]) and first[1:] == again[1:]
        # control: seed 4 differs
        assert not torch.equal(first[0], other[0]) and first[1:] != other[1:]
    finally:
        torch.set_rng_state(saved_torch)
        random.setstate(saved_py)
        np.random.set_state(saved_np)
