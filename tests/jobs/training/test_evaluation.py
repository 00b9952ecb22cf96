"""Exact distributed evaluation: every sample counted once at every remainder, compared with one
process."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch._dynamo  # noqa: F401  DDP imports it lazily: once here, not in every forked worker (seconds each)
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit
from ddpkit.testing import run_on_ranks


def make_classification(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1000 + n)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def make_regression(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(2000 + n)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g))


def fixed_linear(out_features: int) -> nn.Linear:
    model = nn.Linear(4, out_features)
    with torch.no_grad():
        model.weight.copy_(torch.linspace(-1, 1, 4 * out_features).reshape(out_features, 4))
        model.bias.copy_(torch.linspace(0.3, -0.2, out_features))
    return model


def direct_classification(n: int) -> dict[str, float]:
    """The metrics by hand, on the whole dataset at once (no ddpkit)."""
    x, y = make_classification(n).tensors
    logits = fixed_linear(3)(x).detach()
    return {
        "loss": F.cross_entropy(logits, y).item(),
        "accuracy": (logits.argmax(1) == y).double().mean().item(),
    }


def padded_evaluation(
    model: nn.Module, dataset: TensorDataset, batch_size: int
) -> dict[str, float]:
    """The usual recipe: DistributedSampler (which pads) and a sum/count all-reduce. Used as the
    control."""
    loader = DataLoader(
        dataset, batch_size=batch_size, sampler=DistributedSampler(dataset, shuffle=False)
    )
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            loss_sum += F.cross_entropy(model(x), y, reduction="sum").item()
            count += len(y)
    total = ddpkit.all_reduce({"loss": loss_sum, "count": count})
    return {
        "loss": total["loss"] / total["count"] if total["count"] else math.nan,
        "count": total["count"],
    }


SIZES = {2: [0, 1, 10, 11], 3: [0, 1, 2, 9, 10, 11, 12]}


def _classification_worker(sizes: list[int]) -> dict:
    ddpkit.init()
    model = fixed_linear(3)
    out = {}
    for n in sizes:
        dataset = make_classification(n)
        # batch_size=2: ranks with one sample more also run one batch more.
        out[n] = {
            "ddpkit": ddpkit.evaluate(model, dataset, batch_size=2),
            "padded": padded_evaluation(model, dataset, 2),
        }
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_evaluate_equals_one_process_at_every_remainder(world):
    sizes = SIZES[world]
    results = run_on_ranks(_classification_worker, world, (sizes,))
    for n in sizes:
        # no process group
        reference = ddpkit.evaluate(fixed_linear(3), make_classification(n), batch_size=2)
        if n == 0:
            assert reference == {} and all(out[n]["ddpkit"] == {} for out in results)
            continue
        assert reference == pytest.approx(direct_classification(n), rel=1e-6)
        for out in results:
            assert out[n]["ddpkit"] == pytest.approx(reference, rel=1e-6, abs=1e-7), (world, n)
        # Control: DistributedSampler counts padded samples twice whenever n % world != 0.
        padded = results[0][n]["padded"]
        if n % world:
            assert padded["count"] == world * math.ceil(n / world) > n
            if n > 1:  # (repeating the only sample leaves its mean unchanged, not its count)
                assert abs(padded["loss"] - reference["loss"]) > 1e-4
        else:
            assert padded["count"] == n and padded["loss"] == pytest.approx(
                reference["loss"], rel=1e-6
            )


def custom_metrics(model: nn.Module, batch) -> dict[str, torch.Tensor]:
    x, target = batch
    return {"abs_err": (model(x) - target).abs().sum(dim=1), "positive": (x[:, 0] > 0).float()}


def summed_metrics(model: nn.Module, batch) -> dict[str, tuple]:
    # The (sum, count) form: e.g. a token-level loss where a batch's count is not its number of
    # rows.
    x, target = batch
    err = (model(x) - target).pow(2)
    return {"sq_err_per_value": (err.sum(), err.numel()), "rows": (float(len(x)), len(x))}


def _metrics_worker(n: int) -> dict:
    rt = ddpkit.init()
    model = fixed_linear(2)
    dataset = make_regression(n)
    group = torch.distributed.new_group([1, 2])
    return {
        "regression": ddpkit.evaluate(model, dataset, ddpkit.regression_metrics, batch_size=3),
        "custom": ddpkit.evaluate(model, dataset, custom_metrics, batch_size=4),
        "summed": ddpkit.evaluate(model, dataset, summed_metrics, batch_size=4),
        "loader": ddpkit.evaluate(
            model, ddpkit.build_eval_loader(dataset, 3, num_workers=0), ddpkit.regression_metrics
        ),
        "group": ddpkit.evaluate(
            model, dataset, ddpkit.regression_metrics, batch_size=2, group=group
        ),
        "rank": rt.rank,
    }


def test_regression_custom_summed_metrics_loader_and_subgroup():
    n = 11
    results = run_on_ranks(_metrics_worker, 3, (n,))
    x, target = make_regression(n).tensors
    pred = fixed_linear(2)(x).detach()
    expected_mse = (pred - target).pow(2).mean(dim=1).double().mean().item()
    expected_abs = (pred - target).abs().sum(dim=1).double().mean().item()
    expected_pos = (x[:, 0] > 0).double().mean().item()
    assert 0 < expected_pos < 1
    for out in results:
        assert out["regression"] == pytest.approx({"loss": expected_mse}, rel=1e-6)
        assert out["custom"] == pytest.approx(
            {"abs_err": expected_abs, "positive": expected_pos}, rel=1e-6
        )
        assert out["summed"] == pytest.approx(
            {"sq_err_per_value": expected_mse, "rows": 1.0}, rel=1e-6
        )
        assert out["loader"] == pytest.approx({"loss": expected_mse}, rel=1e-6)
        # Group [1, 2] shares the data between its two members; rank 0, outside it, evaluates
        # everything alone.
        assert out["group"] == pytest.approx({"loss": expected_mse}, rel=1e-6)


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
    with torch.no_grad():
        model[1].running_mean.copy_(torch.linspace(-0.5, 0.5, 6))
        model[1].running_var.copy_(torch.linspace(0.5, 2.0, 6))
    return model


def _ddp_bn_worker(sync: bool, n: int, train_step: bool) -> dict:
    # a hang surfaces as an error, well before pytest's limit
    rt = ddpkit.get_runtime()  # run_on_ranks: collectives wait 30 s at most
    model = ddpkit.prepare_model(bn_model(), sync_batchnorm=sync)
    if train_step:  # as in a real loop: every rank holds 4 of the same 8 samples
        x, y = make_classification(8).tensors
        mine = slice(4 * rt.rank, 4 * rt.rank + 4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
    # batch_size=1 with n=5: rank 0 runs 3 batches, rank 1 runs 2.
    result = ddpkit.evaluate(model, make_classification(n), batch_size=1)
    return {
        "result": result,
        "state": ddpkit.unwrap(model).state_dict(),
        "training": model.training,
        "bn_type": type(ddpkit.unwrap(model)[1]).__name__,
    }


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sync", [False, True])
def test_evaluate_ddp_batchnorm_uneven_batches_does_not_hang(sync):
    n = 5
    results = run_on_ranks(_ddp_bn_worker, 2, (sync, n, False))
    reference = ddpkit.evaluate(bn_model(), make_classification(n))
    for out in results:
        assert out["bn_type"] == ("CPUSyncBatchNorm" if sync else "BatchNorm1d")
        assert out["training"] is True
        assert out["result"] == pytest.approx(reference, rel=1e-6, abs=1e-7)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("sync", [False, True])
def test_evaluate_after_a_training_step_evaluates_rank0_model(sync):
    # After a step, DDP treats rank 0's buffers as the model's (it broadcasts them before the next
    # forward, and rank 0 is the rank that saves checkpoints). With plain BatchNorm each rank's
    # running statistics saw only its own slice, so evaluating each rank's own copy measures a
    # mixture of different models.
    n = 5
    results = run_on_ranks(_ddp_bn_worker, 2, (sync, n, True))
    reference_model = bn_model()
    reference_model.load_state_dict(results[0]["state"])
    reference = ddpkit.evaluate(reference_model, make_classification(n))
    stats = [out["state"]["1.running_mean"] for out in results]
    for out in results:
        assert out["result"] == pytest.approx(reference, rel=1e-6, abs=1e-7), (
            f"per-rank running means: {stats}"
        )


def bn_no_running_stats_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 3, 1),
        nn.BatchNorm2d(3, track_running_stats=False),
        nn.Flatten(),
        nn.Linear(12, 3),
    )


def _bn_no_running_stats_worker(n: int) -> dict:
    g = torch.Generator().manual_seed(7)
    dataset = TensorDataset(
        torch.randn(n, 2, 2, 2, generator=g), torch.randint(0, 3, (n,), generator=g)
    )
    plain = bn_no_running_stats_model()
    synced = ddpkit.prepare_model(copy.deepcopy(plain), sync_batchnorm=True)
    # In eval mode, a BatchNorm without running statistics normalises each batch by its own
    # statistics, as torch's own SyncBatchNorm does in eval mode (it synchronises only while
    # training).
    expected = ddpkit.evaluate(plain, dataset, batch_size=2)
    return {"synced": ddpkit.evaluate(synced, dataset, batch_size=2), "expected": expected}


@pytest.mark.timeout(90)
def test_evaluate_sync_batchnorm_without_running_stats_uneven_batches():
    # n=7 over 3 ranks: shares of 3, 2, 2 samples, so rank 0 runs 2 batches of 2 and the others 1.
    # a hang surfaces in seconds
    results = run_on_ranks(_bn_no_running_stats_worker, 3, (7,), collective_timeout=3)
    for out in results:
        assert out["synced"] == pytest.approx(out["expected"], rel=1e-6)
