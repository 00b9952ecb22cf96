"""What each rank gets back from a snapshot, under every strategy, in real 2- and 3-rank gloo jobs.

BatchNorm without sync BatchNorm keeps running statistics of each rank's own batches, and a
parameter DDP ignores gets each rank's own gradients: one name, a value per rank. At the same world
size every rank must get its own values back; at another, every rank gets rank 0's. Control: saved
the way DCP saves a replicated key (one copy, written by one rank), some rank gets another rank's
copy.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

import ddpkit
from ddpkit._internals.versions import TORCH_VERSION
from ddpkit.snapshot import _codec as codec
from ddpkit.snapshot._disk import DiskStore
from ddpkit.strategies import build_strategy
from ddpkit.strategies._base import join_own
from ddpkit.strategies._fsdp import FSDP_ON_CPU
from ddpkit.testing import run_on_ranks
from tests.trainer_checks import differences

# fsdp on the CPU from the torch that runs it there (older ones refuse it, naming the version).
STRATEGIES = ("ddp", "zero", "fsdp") if TORCH_VERSION >= FSDP_ON_CPU else ("ddp", "zero")
# under ddp: left out of DDP's all-reduce, so each rank steps it with its own gradient
IGNORED = "3.bias"


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def build(name: str, rt) -> object:
    net = model()
    if name == "ddp":
        nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            net, [IGNORED]
        )
    return build_strategy(name, net, torch.optim.Adam(net.parameters(), lr=0.1), runtime=rt)


def train(strategy, rank: int, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(1000 * seed + rank)  # each rank its own batches
    for _ in range(steps):
        x, y = torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)
        nn.functional.cross_entropy(strategy.model(x), y).backward()
        strategy.optimizer.step()
        strategy.optimizer.zero_grad(set_to_none=True)


def own_view(strategy) -> dict[str, torch.Tensor]:
    """Everything this rank holds of model and optimizer (its shards as local tensors), by key."""
    from torch.distributed.tensor import DTensor

    out = {}

    def walk(tree, prefix):
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, torch.Tensor):
                out[f"{prefix}{k}"] = (
                    (v.to_local() if isinstance(v, DTensor) else v).detach().clone()
                )

    walk(join_own(strategy.state_dict()), "")
    return out


def buffers(strategy) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ddpkit.unwrap(strategy.model).named_buffers()}


def save_and_restore(folder: str) -> dict:
    """For each strategy: this rank's state when saved, and after a load (with the fix, and saved as
    DCP saves a replicated key: the control); the buffers saved for the other world size's load."""
    rt = ddpkit.init()
    out = {}
    for name in STRATEGIES:
        strategy = build(name, rt)
        train(strategy, rt.rank, 3, seed=0)
        fixed = DiskStore(Path(folder) / name / "fixed", group=rt.group)
        one_copy = DiskStore(Path(folder) / name / "one-copy", group=rt.group)
        fixed.save(3, strategy.state_dict(), {"step": 3}, replicated=strategy.replicated)
        # no per-rank part: one copy per key
        one_copy.save(3, join_own(strategy.state_dict()), {"step": 3})
        saved, saved_buffers = own_view(strategy), buffers(strategy)
        restored = {}
        for kind, ckpt, template in (
            ("fixed", fixed, strategy.state_dict),
            ("one-copy", one_copy, lambda strategy=strategy: join_own(strategy.state_dict())),
        ):
            train(strategy, rt.rank, 2, seed=1)  # training moves every value on
            state, _ = ckpt.load(ckpt.latest(warn=print), template)
            strategy.load_state_dict(state)
            restored[kind] = own_view(strategy)
        out[name] = {"saved": saved, "buffers": saved_buffers, **restored}
    return out


def load_at_another_world_size(folder: str) -> dict:
    rt = ddpkit.init()
    out = {}
    for name in STRATEGIES:
        strategy = build(name, rt)
        train(strategy, rt.rank, 1, seed=2)
        ckpt = DiskStore(Path(folder) / name / "fixed", group=rt.group)
        state, _ = ckpt.load(ckpt.latest(warn=print), strategy.state_dict)
        strategy.load_state_dict(state)
        out[name] = buffers(strategy)
    return out


def differs(a: dict, b: dict) -> list[str]:
    """The keys whose tensors are not the same bits."""
    assert a.keys() == b.keys()
    return [k for k in a if differences(a[k], b[k])]


def own(key: str) -> bool:
    """A value that is each rank's own: running statistics, and ddp's ignored parameter with its
    Adam state."""
    return "running_" in key or IGNORED in key


def test_every_rank_resumes_its_own_buffers_and_at_another_world_size_rank_0s(tmp_path):
    ranks = run_on_ranks(functools.partial(save_and_restore, str(tmp_path)), 2)
    for name in STRATEGIES:
        r0, r1 = ranks[0][name], ranks[1][name]
        # The case exists: the two ranks' running statistics (and ddp's ignored parameter) differ.
        assert differs(r0["buffers"], r1["buffers"]) == ["1.running_mean", "1.running_var"], name
        if name == "ddp":
            assert not torch.equal(r0["saved"][f"model.{IGNORED}"], r1["saved"][f"model.{IGNORED}"])
        for rank, r in enumerate((r0, r1)):
            assert differs(r["fixed"], r["saved"]) == [], (
                f"{name}: rank {rank} did not get its own state back"
            )
        # Control: one copy per key gives some rank the other's copy of what was its own (and
        # nothing else).
        wrong = {rank: differs(r["one-copy"], r["saved"]) for rank, r in enumerate((r0, r1))}
        print(f"{name}, one copy per key: keys not this rank's own after the load: {wrong}")
        assert any(wrong.values()), name
        assert all(own(k) for keys in wrong.values() for k in keys), name
    # Another world size: every rank takes rank 0's buffers, as DDP's broadcast would make them.
    three = run_on_ranks(functools.partial(load_at_another_world_size, str(tmp_path)), 3)
    for name in STRATEGIES:
        for rank in range(3):
            assert differs(three[rank][name], ranks[0][name]["buffers"]) == [], (
                f"{name} at 3 ranks: rank {rank}"
            )


def save_shared(folder: str, strategy_name: str, replicated: bool) -> dict:
    """Save a trained strategy's state, each rank writing a share of the shared tensors when
    ``replicated``; load it back: this rank's state when saved and after the load, or the load's
    error."""
    rt = ddpkit.init()
    strategy = build(strategy_name, rt)
    train(strategy, rt.rank, 3, seed=0)
    ckpt = DiskStore(Path(folder), group=rt.group)
    ckpt.save(3, strategy.state_dict(), {"step": 3}, replicated=replicated)
    saved = own_view(strategy)
    train(strategy, rt.rank, 2, seed=1)
    try:
        state, _ = ckpt.load(ckpt.latest(warn=print), strategy.state_dict)
    except Exception as err:  # the control's outcome, on every rank alike
        return {"saved": saved, "error": str(err)}
    strategy.load_state_dict(state)
    return {"saved": saved, "restored": own_view(strategy)}


def test_ddp_ranks_each_write_a_share_of_the_replicated_state_and_every_rank_gets_all_of_it(
    tmp_path,
):
    import json

    ranks = run_on_ranks(functools.partial(save_shared, str(tmp_path / "ddp"), "ddp", True), 3)
    for rank, r in enumerate(ranks):
        assert differs(r["restored"], r["saved"]) == [], f"rank {rank} did not get its state back"
    (folder,) = (tmp_path / "ddp").iterdir()
    index = json.loads((folder / "metadata.json").read_text())
    writers: dict[str, list[str]] = {}
    for item in index["storage"]:
        writers.setdefault(item["fqn"], []).append(item["file"])
    shared = [k for k in writers if not k.startswith("per_rank.")]
    # Each shared tensor written once, and by every rank some: DCP's first rank plans them once, not
    # per rank.
    assert all(len(writers[k]) == 1 for k in shared)
    assert {writers[k][0] for k in shared} == {"__0_0.distcp", "__1_0.distcp", "__2_0.distcp"}
    # The other values (hyper-parameters by parameter) once, rank 0's: the other ranks' are the
    # same.
    values = codec.read_file(folder / "values.pt")
    assert len(values["values"]) > 0 and values["differences"] == [{}, {}, {}]


def test_a_state_that_is_not_replicated_saved_as_one_loses_what_other_ranks_own(tmp_path):
    # Control: zero's optimizer state is each rank's own parameters'. Shared out as if every rank
    # held all of it, some ranks drop what only they hold, and the snapshot no longer has it: why
    # only ddp says replicated.
    ranks = run_on_ranks(functools.partial(save_shared, str(tmp_path / "zero"), "zero", True), 2)
    outcomes = [r.get("error") or differs(r["restored"], r["saved"]) for r in ranks]
    print(f"zero saved as replicated: {outcomes}")
    assert any(outcomes)
    fine = run_on_ranks(functools.partial(save_shared, str(tmp_path / "zero-ok"), "zero", False), 2)
    assert all(differs(r["restored"], r["saved"]) == [] for r in fine)


def load_with_a_wrong_shape_on_rank_1(folder: str) -> str:
    rt = ddpkit.init()
    ckpt = DiskStore(Path(folder), group=rt.group)
    ckpt.save(1, {"w": torch.arange(6.0)}, {}, replicated=True)
    shape = 7 if rt.rank == 1 else 6
    try:
        ckpt.load(ckpt.latest(warn=print), lambda: {"w": torch.zeros(shape)})
    except RuntimeError as err:
        return str(err)
    # a rank that returned without the failure would wait here for the one that raised
    ddpkit.barrier()
    return "loaded"


def test_one_ranks_failed_load_fails_every_rank_with_its_message(tmp_path):
    # Each rank reads with no collective, so a rank whose read fails alone must still stop the
    # others, which would otherwise go on into the next collective and wait there for ever.
    messages = run_on_ranks(functools.partial(load_with_a_wrong_shape_on_rank_1, str(tmp_path)), 3)
    assert all(m.startswith("ddpkit: loading snapshot") for m in messages), messages
    assert all("(on rank 1)" in m for r, m in enumerate(messages) if r != 1), messages
    assert "(on rank" not in messages[1] and "size" in messages[1].lower(), messages[1]
