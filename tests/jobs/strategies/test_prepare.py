"""prepare_model in real 2-rank jobs: each rank its own random stream once the weights are alike,
and ``state_dict()`` keys that do not depend on the world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

import ddpkit
from ddpkit.testing import assert_same_on_ranks, run_on_ranks


def _recipe_masks(seed_ranks: bool) -> torch.Tensor:
    """The README's hand-written loop up to its first forward: seed_everything, prepare_model,
    build_loader."""
    ddpkit.seed_everything(0)
    # the recipe's call as it is, or the seeding off
    switch = {} if seed_ranks else {"seed_ranks": False}
    model = ddpkit.prepare_model(nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5)), **switch)
    data = TensorDataset(torch.ones(16, 8), torch.zeros(16))
    x, _ = next(iter(ddpkit.build_loader(data, batch_size=4, num_workers=0)))
    # the weights are rank 0's on every rank
    assert_same_on_ranks(ddpkit.unwrap(model).state_dict())
    return model(x) != 0  # the dropout mask of this rank's 4 samples


def test_after_the_recipes_calls_each_rank_draws_its_own_dropout_masks():
    masks = run_on_ranks(_recipe_masks, 2, (True,))
    assert not torch.equal(masks[0], masks[1])
    # A world of one draws as rank 0 of N: the same mask for the same samples.
    assert torch.equal(_recipe_masks(True), masks[0])
    # Control: main's recipe (no seeding after the broadcast) gives both ranks the same masks.
    same = run_on_ranks(_recipe_masks, 2, (False,))
    assert torch.equal(same[0], same[1])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)  # buffers too, num_batches_tracked among them

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


def _same(a: dict, b: dict) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _at_two_ranks(folder: str) -> list[str]:
    rank = ddpkit.get_runtime().rank
    saved_at_one = torch.load(Path(folder) / "one.pt", weights_only=True)
    torch.manual_seed(1)  # weights other than the file's
    model = ddpkit.prepare_model(Net())
    model.load_state_dict(saved_at_one, strict=True)
    assert _same(model.state_dict(), saved_at_one)
    # a step: the weights are rank 0's broadcast, then trained alike
    model(torch.randn(8, 4)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    # Inside a container the same: the container's keys, without DDP's.
    box = nn.ModuleDict({"d": model})
    assert list(box.state_dict()) == [f"d.{k}" for k in saved_at_one]
    box.load_state_dict(box.state_dict(), strict=True)
    # DDP's own keys still load (a checkpoint of main's).
    model.load_state_dict({f"module.{k}": v for k, v in saved_at_one.items()}, strict=True)
    assert _same(model.state_dict(), saved_at_one)
    model(torch.randn(8, 4)).sum().backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    plain = DDP(Net())  # main's prepare_model: torch's DDP as it is
    if rank == 0:
        torch.save(model.state_dict(), Path(folder) / "two.pt")
        torch.save(plain.state_dict(), Path(folder) / "plain.pt")
    # control: DDP's keys do not take a world of one's
    with pytest.raises(RuntimeError, match="Missing key"):
        plain.load_state_dict(saved_at_one, strict=True)
    return list(model.state_dict())


def test_a_state_dict_saved_at_one_world_size_loads_strictly_at_another(tmp_path):
    torch.manual_seed(0)
    one = ddpkit.prepare_model(Net())  # a world of one: the bare module
    one(torch.randn(8, 4))  # BatchNorm's running statistics move
    torch.save(one.state_dict(), tmp_path / "one.pt")
    keys = run_on_ranks(_at_two_ranks, 2, (str(tmp_path),))
    assert keys[0] == keys[1] == list(one.state_dict())
    saved_at_two = torch.load(tmp_path / "two.pt", weights_only=True)
    one.load_state_dict(saved_at_two, strict=True)
    assert _same(one.state_dict(), saved_at_two)
    # Control: main's keys, saved at 2 ranks, do not load strictly at 1.
    with pytest.raises(RuntimeError, match='Unexpected key.*"module.fc.weight"'):
        one.load_state_dict(torch.load(tmp_path / "plain.pt", weights_only=True), strict=True)


def _trained(view: bool | None, set_to_none: bool = True) -> tuple[int, list[torch.Tensor]]:
    """Three steps of two micro-batches (the first under ``no_sync()``) with momentum, each rank on
    its own data, the gradients set to None between steps (``zero_grad()``'s default) or zeroed in
    place; how many storages the gradients live in, and the weights."""
    torch.manual_seed(0)
    switch = {} if view is None else {"gradient_as_bucket_view": view}
    model = ddpkit.prepare_model(
        nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)), seed_ranks=False, **switch
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(ddpkit.get_runtime().rank)
    for _ in range(3):
        optimizer.zero_grad(set_to_none=set_to_none)
        with model.no_sync():
            model(torch.randn(4, 8, generator=data)).pow(2).sum().backward()
        model(torch.randn(4, 8, generator=data)).pow(2).sum().backward()
        optimizer.step()
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    weights = [p.detach().clone() for p in model.parameters()]
    assert_same_on_ranks(weights)
    return len(storages), weights


def _views_and_copies() -> dict[tuple[bool | None, bool], tuple[int, list[torch.Tensor]]]:
    return {(view, none): _trained(view, none) for view in (None, False) for none in (True, False)}


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_are_views_into_ddps_bucket_and_train_as_torchs_copies_do(world):
    out = run_on_ranks(_views_and_copies, world)[0]
    (views, trained), (copies, as_torch) = out[None, True], out[False, True]
    # prepare_model's default: the four gradients are views into one bucket (no copy out of it)
    assert views == 1
    # control: torch's default gives each gradient its own storage
    assert copies == 4
    # the same arithmetic: bit for bit the weights torch's default trains
    assert all(torch.equal(a, b) for a, b in zip(trained, as_torch, strict=True))
    # zeroed in place too: every bucket is divided by the world size before its sum, views or not
    zeroed, zeroed_copies = out[None, False][1], out[False, False][1]
    assert all(torch.equal(a, b) for a, b in zip(zeroed, zeroed_copies, strict=True))


def _six_steps(wrap, rewrap: bool, cap: float | None) -> list[torch.Tensor]:
    """Six steps of the digits CNN (each rank its own data, momentum, BatchNorm) wrapped by
    ``wrap``; with ``rewrap``, wrapped anew after step 3 from the model's and the optimizer's
    state dicts, as a resumed run is. Rank 0's weights."""
    from ddpkit.demo._models import DigitsCNN

    torch.manual_seed(0)
    model = wrap(DigitsCNN(), cap)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(ddpkit.get_runtime().rank)
    for step in range(6):
        if rewrap and step == 3:
            state = ddpkit.unwrap(model).state_dict(), optimizer.state_dict()
            model = wrap(DigitsCNN(), cap)
            ddpkit.unwrap(model).load_state_dict(state[0])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            optimizer.load_state_dict(state[1])
        optimizer.zero_grad()
        x, y = torch.randn(6, 1, 28, 28, generator=data), torch.randint(0, 10, (6,), generator=data)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _prepared(module: nn.Module, cap: float | None) -> nn.Module:
    return ddpkit.prepare_model(module, seed_ranks=False, bucket_cap_mb=cap)


def _torchs(module: nn.Module, cap: float | None) -> nn.Module:
    return DDP(module, bucket_cap_mb=cap)


def _rewrapped() -> dict[tuple[str, float | None], tuple[list, list]]:
    return {
        (name, cap): (_six_steps(wrap, False, cap), _six_steps(wrap, True, cap))
        for name, wrap in (("ddpkit", _prepared), ("torch", _torchs))
        for cap in (None, 0.05)  # one bucket (the model's 0.46 MB), or three
    }


def test_a_model_wrapped_anew_trains_on_bitwise_at_three_ranks():
    out = run_on_ranks(_rewrapped, 3)[0]
    for cap in (None, 0.05):
        once, anew = out["ddpkit", cap]
        assert all(torch.equal(a, b) for a, b in zip(once, anew, strict=True)), cap
        # control: torch's DDP reduces the first step after wrapping in one bucket, in the
        # parameters' order, and the later ones in the buckets it rebuilds (the gradients' ready
        # order): at 3 ranks a sum's order follows an element's place in its bucket
        once, anew = out["torch", cap]
        assert not all(torch.equal(a, b) for a, b in zip(once, anew, strict=True)), cap


def _verdicts() -> list[tuple[bool, bool]]:
    """Each step: the verdict on the gradients (views into DDP's bucket), and whether a rank (rank 0
    at step 1, rank 1 at step 3) put an inf into its gradient of one parameter before the
    all-reduce (a hook on that parameter)."""
    from ddpkit.strategies._ddp import FiniteCheck

    rank = ddpkit.get_runtime().rank
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1)))
    params = list(model.parameters())
    check = FiniteCheck(params)
    out = []
    for step in range(4):
        poisoned = params[step % len(params)]
        handle = None
        if step % 2 and rank == step // 2 % 2:
            handle = poisoned.register_hook(lambda g: torch.full_like(g, float("inf")))
        model.zero_grad()
        model(torch.randn(2, 3)).sum().backward()
        if handle is not None:
            handle.remove()
        grads = [p.grad for p in params]
        assert len({g.untyped_storage().data_ptr() for g in grads}) == 1  # one bucket
        out.append((check(grads), bool(step % 2)))
    return out


def test_every_ranks_verdict_on_the_bucket_views_sees_either_ranks_inf():
    for steps in run_on_ranks(_verdicts, 2):
        assert [finite for finite, _ in steps] == [not bad for _, bad in steps]


def _hooked_later() -> list[int]:
    """Two steps, then a comm hook of the caller's counting the buckets it serves, two more."""
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2)))
    served = []

    def counting(state, bucket):
        served.append(bucket.index())
        return default_hooks.allreduce_hook(state, bucket)

    for step in range(4):
        if step == 2:
            # control: DDP's own registration refuses a second hook
            with pytest.raises(RuntimeError, match="can only be called once"):
                DDP.register_comm_hook(model, None, counting)
            model.register_comm_hook(None, counting)
        model(torch.randn(4, 8)).sum().backward()
    assert_same_on_ranks([p.grad for p in model.parameters()])
    return served


def test_a_comm_hook_registered_after_the_first_forward_serves_the_steps_after_it():
    # prepare_model's own hook is registered at the first forward; the caller's, registered at
    # step 2, serves steps 2 and 3 in its place
    assert run_on_ranks(_hooked_later, 2) == [[0, 0]] * 2


class _RankOrdered(nn.Module):
    """Two layers run in an order that depends on the rank: their gradients become ready in
    another order on each rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, then = (self.a, self.b) if ddpkit.get_runtime().rank % 2 else (self.b, self.a)
        y = first(x).sum(1)
        return y + then(x).sum(1)


def _first_step_of_rank_ordered(wrap) -> tuple[list[torch.Tensor], list[str]]:
    torch.manual_seed(0)
    module = _RankOrdered()
    ready: list[str] = []
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, name=name: ready.append(name))
    model = wrap(module, None)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(ddpkit.get_runtime().rank)))
    model(torch.randn(4, 8)).sum().backward()
    return [p.grad.clone() for p in model.parameters()], ready


def _rank_ordered() -> dict[str, tuple[list[torch.Tensor], list[str]]]:
    return {
        name: _first_step_of_rank_ordered(w)
        for name, w in (("ddpkit", _prepared), ("torch", _torchs))
    }


def test_ranks_whose_gradients_are_ready_in_other_orders_sum_the_first_step_alike():
    out = run_on_ranks(_rank_ordered, 2)
    # the hazard is there: each rank's gradients became ready in another order
    assert out[0]["ddpkit"][1] != out[1]["ddpkit"][1]
    for rank in out:  # every rank laid its first step out as rank 0 did: torch's sums, bitwise
        assert all(torch.equal(a, b) for a, b in zip(rank["ddpkit"][0], out[0]["torch"][0]))
