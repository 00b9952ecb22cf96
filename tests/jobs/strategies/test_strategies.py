"""The strategies in real gloo jobs: zero and fsdp train what ddp trains, resume at another world
size, decide clipping and non-finite steps over the whole sharded gradient; Join ends uneven inputs;
comm hooks."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import ddpkit
import ddpkit.strategies
from ddpkit._errors import ConfigError
from ddpkit.strategies import DDPConfig, build_strategy, strategy_config
from ddpkit.strategies._ddp import bf16_compress
from ddpkit.testing import run_on_ranks
from tests.jobs.scripts.train_job import train_on_ranks


def rel_diff(a: dict, b: dict) -> float:
    """Largest relative difference (norm of difference / norm) over model and optimizer tensors, by
    name."""
    assert a.keys() == b.keys()
    out = 0.0
    for key, ref in b.items():
        got = a[key]
        if torch.is_tensor(ref) and ref.is_floating_point():
            diff = (got.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-12)
            out = max(out, diff.item())
    return out


def full_diff(a: dict, b: dict) -> float:
    return max(
        rel_diff(a["full"]["model"], b["full"]["model"]),
        rel_diff(a["full"]["optim"], b["full"]["optim"]),
    )


def test_zero_trains_what_ddp_trains(tmp_path, ddp_reference, monkeypatch):
    zero = train_on_ranks(2, tmp_path / "zero", global_dropout=True, strategy="zero")
    assert zero["step"] == ddp_reference["step"] == 30
    diff = full_diff(zero, ddp_reference)
    print(f"zero vs ddp after 30 Adam steps: largest relative difference {diff:.1e}")
    assert diff < 1e-6
    # Control: the LR scheduler left on the optimizer the user built (not on the ZeRO one) steps
    # nothing that trains, and the comparison sees it.
    monkeypatch.setattr(ddpkit.strategies, "rebind_scheduler", lambda *args: None)
    stale = train_on_ranks(2, tmp_path / "stale", global_dropout=True, strategy="zero", epochs=1)
    plain = train_on_ranks(2, tmp_path / "d1", global_dropout=True, epochs=1)
    assert rel_diff(stale["full"]["model"], plain["full"]["model"]) > 1e-3


@pytest.mark.heavy
def test_fsdp_fp32_trains_what_ddp_trains_and_bf16_differs(tmp_path, ddp_reference):
    # Per-block sharding: each Linear is its own unit, gathered and freed on its own.
    fsdp = train_on_ranks(
        2,
        tmp_path / "fsdp",
        global_dropout=True,
        strategy="fsdp",
        strategy_options={"shard_blocks": ["Linear"]},
    )
    diff = full_diff(fsdp, ddp_reference)
    print(f"fsdp (fp32) vs ddp after 30 Adam steps: largest relative difference {diff:.1e}")
    assert diff < 1e-5
    # Control: bf16 parameters (mixed precision) give another model, and the tolerance sees it.
    bf16 = train_on_ranks(
        2,
        tmp_path / "bf16",
        global_dropout=True,
        strategy="fsdp",
        epochs=1,
        strategy_options={"param_dtype": "bf16", "reduce_dtype": "fp32"},
    )
    fp32 = train_on_ranks(2, tmp_path / "fp32", global_dropout=True, strategy="fsdp", epochs=1)
    assert all(torch.isfinite(v).all() for v in bf16["full"]["model"].values())
    assert rel_diff(bf16["full"]["model"], fp32["full"]["model"]) > 1e-4


@pytest.mark.slow  # ~15 s: 4 jobs
@pytest.mark.parametrize("world", [1, 3])
def test_fsdp_snapshot_of_2_ranks_resumes_at_another_world_size(tmp_path, ddp_reference, world):
    first = train_on_ranks(2, tmp_path / "run", max_steps=13, global_dropout=True, strategy="fsdp")
    assert first["step"] == 13
    final = train_on_ranks(world, tmp_path / "run", global_dropout=True, strategy="fsdp")
    assert final["resumed_from"] == 13 and final["step"] == 30
    diff = full_diff(final, ddp_reference)
    print(
        f"fsdp stopped at 2 ranks, resumed at {world}: largest relative difference to ddp "
        f"{diff:.1e}"
    )
    assert diff < 1e-5


def _verdicts(poison: str) -> dict:
    """The same gradients under ddp and fsdp (two copies of one model in one job): their verdicts
    and norms."""
    rt = ddpkit.init()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    copies = {
        name: nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        for name in ("ddp", "fsdp")
    }
    out: dict = {}
    for name, model in copies.items():
        model.load_state_dict(base.state_dict())
        strategy = build_strategy(
            name, model, torch.optim.SGD(model.parameters(), lr=0.1), runtime=rt
        )
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rt.rank)) * 10
        loss = strategy.model(x).square().mean()
        if poison == "loss" and rt.rank == 1:
            loss = loss + float("inf")  # a non-finite loss with finite gradients, on one rank
        strategy.mark_nonfinite(loss).backward()
        params = [p for p in strategy.model.parameters()]
        if poison == "grad" and name == "fsdp" and rt.rank == 1:
            params[0].grad.to_local().view(-1)[0] = float("nan")  # in rank 1's shard only
        # Control: the norm of this rank's own shard, what a clip without the all-reduce would use.
        local = [p.grad.to_local() if name == "fsdp" else p.grad for p in params]
        local_norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in local])
        ).item()
        local_finite = all(torch.isfinite(g).all().item() for g in local)
        verdict = strategy.check_gradients(max_norm=1.0)
        clipped = [p.grad.full_tensor() if name == "fsdp" else p.grad for p in params]
        out[name] = {
            "finite": verdict.finite,
            "norm": float(verdict.norm),
            "local_norm": local_norm,
            "local_finite": local_finite,
            "clipped": [g.clone() for g in clipped],
        }
    return out


def test_fsdp_clips_by_the_global_norm_as_ddp_does():
    ranks = run_on_ranks(functools.partial(_verdicts, "none"), 2)
    for r in ranks:
        ddp, fsdp = r["ddp"], r["fsdp"]
        assert ddp["finite"] and fsdp["finite"]
        # clipping happens
        assert fsdp["norm"] == pytest.approx(ddp["norm"], rel=1e-6) and ddp["norm"] > 1.0
        for a, b in zip(fsdp["clipped"], ddp["clipped"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        # Control: a rank's shard has a smaller norm; clipping by it would scale by another factor.
        assert fsdp["local_norm"] < 0.95 * ddp["norm"]


@pytest.mark.parametrize("poison", ["loss", "grad"])
def test_fsdp_skips_a_step_on_every_rank_when_any_shard_or_loss_is_not_finite(poison):
    ranks = run_on_ranks(functools.partial(_verdicts, poison), 2)
    assert [r["fsdp"]["finite"] for r in ranks] == [False, False]
    if poison == "loss":
        assert [r["ddp"]["finite"] for r in ranks] == [False, False]  # the same decision as ddp's
    else:
        # Control: rank 0's own shard is finite; a verdict from the local shard would take the step
        # there.
        assert ranks[0]["fsdp"]["local_finite"] and not ranks[1]["fsdp"]["local_finite"]


def _evaluate_uneven(name: str, gathered: bool) -> dict:
    """Exact metrics over 33 samples in batches of 8: rank 0 evaluates 3 batches, rank 1 two."""
    rt = ddpkit.get_runtime()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    config = strategy_config(name, {"shard_blocks": ["Linear"]} if name == "fsdp" else {})
    strategy = build_strategy(
        config, model, torch.optim.SGD(model.parameters(), lr=0.1), runtime=rt
    )
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(33, 5, generator=g), torch.randint(0, 3, (33,), generator=g)
    )
    strategy.model(
        torch.randn(8, 5, generator=torch.Generator().manual_seed(rt.rank))
    ).sum().backward()
    strategy.optimizer.step()  # ranks' BatchNorm statistics now differ: evaluation must use one set
    with strategy.evaluation() if gathered else torch.no_grad():
        return ddpkit.evaluate(strategy.model, data, batch_size=8, group=rt.group)


def test_fsdp_evaluates_unpadded_shards_as_ddp_does():
    ddp = run_on_ranks(functools.partial(_evaluate_uneven, "ddp", True), 2, collective_timeout=4)
    fsdp = run_on_ranks(functools.partial(_evaluate_uneven, "fsdp", True), 2, collective_timeout=4)
    assert fsdp[0] == fsdp[1]
    assert fsdp[0] == pytest.approx(ddp[0], rel=1e-6)
    # Control: sharded forwards all-gather per batch, and rank 1 runs out of batches first: its
    # metrics all-reduce meets rank 0's all-gather (gloo aborts on the size mismatch, or a wait hits
    # the 4 s timeout).
    with pytest.raises(Exception, match="(?i)SIGABRT|timed? ?out|closed|reset"):
        run_on_ranks(functools.partial(_evaluate_uneven, "fsdp", False), 2, collective_timeout=4)


def _uneven(strategy_name: str, use_join: bool, rank0_waits: object = None) -> list[torch.Tensor]:
    """Rank 0 has 2 batches, rank 1 has 4: SGD on a linear model, with or without the strategy's
    Join."""
    rt = ddpkit.get_runtime()
    torch.manual_seed(0)
    model = nn.Linear(3, 1, bias=False)
    strategy = build_strategy(
        strategy_name, model, torch.optim.SGD(model.parameters(), lr=0.1), runtime=rt
    )
    batches = [torch.full((2, 3), float(rt.rank + 1 + i)) for i in range(2 + 2 * rt.rank)]
    with strategy.join() if use_join else torch.enable_grad():
        for x in batches:
            strategy.model(x).sum().backward()
            strategy.optimizer.step()
            strategy.optimizer.zero_grad(set_to_none=True)
    if rank0_waits is not None and rt.rank == 0:
        # a real job would go on to its next phase; rank 1 is left in its all-reduce
        rank0_waits.wait(60)
    return [p.detach().clone() for p in strategy.model.parameters()]


def _expected_after_uneven() -> torch.Tensor:
    """The same steps in one process: a joined rank contributes zeros, and DDP divides by the
    initial world size (2), so each step moves by the mean over 2 ranks of the gradients of the
    ranks still in."""
    torch.manual_seed(0)
    w = nn.Linear(3, 1, bias=False).weight.detach().clone()
    for i in range(4):
        grads = [
            torch.full((2, 3), float(rank + 1 + i)).sum(0) for rank in (0, 1) if i < 2 + 2 * rank
        ]
        w -= 0.1 * sum(grads) / 2
    return w


def test_join_ends_uneven_inputs_with_the_right_result():
    ranks = run_on_ranks(functools.partial(_uneven, "ddp", True), 2, collective_timeout=4)
    torch.testing.assert_close(ranks[0][0], ranks[1][0], rtol=0, atol=0)
    torch.testing.assert_close(ranks[0][0], _expected_after_uneven())


def test_control_without_join_uneven_inputs_hang_until_the_timeout():
    # Rank 0 waits on an event nobody sets (it is killed when rank 1 fails); rank 1 waits in an
    # all-reduce that rank 0 never joins, until the 4-second collective timeout of this job ends it.
    never = mp.get_context("fork").Event()
    with pytest.raises(Exception, match="(?i)timed? ?out"):
        run_on_ranks(functools.partial(_uneven, "ddp", False, never), 2, collective_timeout=4)


def _join_refused(name: str) -> str:
    rt = ddpkit.init()
    model = nn.Linear(2, 2)
    strategy = build_strategy(name, model, torch.optim.SGD(model.parameters(), lr=0.1), runtime=rt)
    try:
        strategy.join()
    except ConfigError as err:
        return str(err)
    return "joined"


@pytest.mark.parametrize("name", ["zero", "fsdp"])
def test_zero_and_fsdp_refuse_join_with_a_clear_message(name):
    # zero: torch's Join ends, but a joined rank's parameters stop training; fsdp: torch has no Join
    # for it.
    assert "same number of batches" in run_on_ranks(functools.partial(_join_refused, name), 2)[0]


HOOK_JOB = dict(global_dropout=True, batchnorm=False, epochs=1, snapshot_every_steps=None)


@pytest.fixture(scope="module")
def plain_ddp(tmp_path_factory) -> dict:
    return train_on_ranks(2, tmp_path_factory.mktemp("plain") / "run", **HOOK_JOB)


@pytest.mark.parametrize(
    "hook, low, high",
    [
        # an all-reduce done as reduce + broadcast: only the order of sums differs
        pytest.param("parameter_server", 0.0, 1e-6, marks=pytest.mark.slow),
        pytest.param("fp16", 1e-9, 1e-2, marks=pytest.mark.slow),
        ("bf16", 1e-9, 5e-2),
        ("powersgd", 1e-6, 0.5),  # rank-1 approximation of the gradients after 2 plain steps
    ],
)
def test_comm_hook_trains_within_its_tolerance_of_plain_ddp(tmp_path, plain_ddp, hook, low, high):
    options = {"comm_hook": hook, "powersgd_start_iter": 2}
    hooked = train_on_ranks(2, tmp_path / hook, strategy_options=options, **HOOK_JOB)
    plain = plain_ddp
    diff = rel_diff(hooked["full"]["model"], plain["full"]["model"])
    print(f"{hook}: largest relative difference to plain DDP after 10 steps {diff:.1e}")
    # Above ``low``: the hook really ran (control); below ``high``: it trains the same model within
    # tolerance.
    assert low <= diff < high


def _bf16_hooks_on_gloo() -> tuple[str, list[list[float]]]:
    """Whether torch registers its own bf16 hook on this gloo group, and the averaged gradients of
    the same step under torch's hook (where registered) and under ours."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    rt = ddpkit.init()
    verdict, grads = "registered", []
    for hook in (bf16_compress_hook, bf16_compress):
        torch.manual_seed(0)
        model = ddpkit.prepare_model(nn.Linear(4, 3), runtime=rt)
        try:
            model.register_comm_hook(None, hook)
        except Exception as err:  # torch's own hook, refused
            verdict = str(err)
            continue
        model(torch.randn(8, 4, generator=torch.Generator().manual_seed(rt.rank))).pow(
            2
        ).sum().backward()
        grads.append(model.module.weight.grad.flatten().tolist())
    return verdict, grads


def test_torch_refuses_its_bf16_hook_by_the_build_not_the_backend_which_is_why_ours_exists():
    """A build of torch with CUDA (or ROCm) and NCCL registers its ``bf16_compress_hook`` on gloo as
    well and averages the same bfloat16 gradients as ours; a build without them (the CPU wheel)
    refuses it whatever the backend, and ours is then the only bf16 hook."""
    import torch.distributed as dist

    gpu_build = (
        torch.version.cuda is not None or torch.version.hip is not None
    ) and dist.is_nccl_available()
    (verdict, grads), other = run_on_ranks(_bf16_hooks_on_gloo, 2)
    assert other == (verdict, grads)  # both ranks hold the same mean
    if gpu_build:
        torch_s, ours = grads
        assert verdict == "registered" and torch_s == ours
    else:
        assert "NCCL" in verdict and len(grads) == 1  # refused; ours ran
    # Control: the step moves the weights, and in bfloat16 (its last 16 bits are zero).
    words = torch.tensor(grads[-1], dtype=torch.float32).view(torch.int32)
    assert words.abs().sum() > 0 and (words & 0xFFFF).eq(0).all()


def _unused_parameter(find_unused: bool) -> str:
    rt = ddpkit.init()

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.used, self.spare = nn.Linear(2, 2), nn.Linear(2, 1), nn.Linear(2, 1)

        def forward(self, x):
            return self.used(self.body(x))

    model = TwoHeads()
    strategy = build_strategy(
        DDPConfig(find_unused_parameters=find_unused),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        runtime=rt,
    )
    strategy.model(torch.ones(3, 2)).sum().backward()
    try:
        return "finite" if strategy.check_gradients().finite else "not finite"
    except ConfigError as err:
        return str(err)


def test_an_unused_parameter_is_named_with_the_option_to_set():
    message = run_on_ranks(functools.partial(_unused_parameter, False), 2)[0]
    assert "spare.weight, spare.bias" in message and "find_unused_parameters" in message
    assert run_on_ranks(functools.partial(_unused_parameter, True), 2)[0] == "finite"


def test_fsdp_best_weights_are_the_whole_model_and_load_outside_ddpkit(tmp_path):
    # Under fsdp each rank holds a shard: best.pt must hold the whole model, gathered, as under ddp.
    from tests.jobs.scripts.train_job import build_model

    train_on_ranks(2, tmp_path / "run", strategy="fsdp", epochs=3, early_stopping_patience=5)
    best = torch.load(tmp_path / "run" / "best.pt", weights_only=True)
    model = build_model()
    model.load_state_dict(best["model"])  # strict: every tensor whole, none a shard
    assert all(type(t) is torch.Tensor for t in best["model"].values())
