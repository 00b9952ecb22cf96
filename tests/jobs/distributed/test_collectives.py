"""Collective helpers over real gloo process groups (``ddpkit.spawn``) and subgroups."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.testing import run_on_ranks

WORLDS = [2, 3]


def _all_reduce_worker() -> dict:
    r = ddpkit.init().rank
    out = {}
    for op in ("sum", "max", "min"):
        out[op] = {
            "int": ddpkit.all_reduce(r + 1, op),
            "float": ddpkit.all_reduce(r + 0.5, op),
            "tensor": ddpkit.all_reduce(torch.tensor([r, -r, 2.5 * r]), op),
            "int_tensor": ddpkit.all_reduce(torch.tensor([[r, 10 - r]]), op),
            "dict": ddpkit.all_reduce(
                {"loss": torch.tensor(r * 1.5), "count": r + 1, "flag": r == 0, "f": 0.25 * r}, op
            ),
        }
    try:
        ddpkit.all_reduce(1.0, "mean")
        out["mean"] = "no error"
    except ValueError as err:
        out["mean"] = "ValueError: " + str(err)
    # the rejected op entered no collective: the next one lines up
    out["after_error"] = ddpkit.all_reduce(1)
    return out


@pytest.mark.parametrize("n", WORLDS)
def test_all_reduce_values_and_types(n):
    results = run_on_ranks(_all_reduce_worker, n)
    ranks = range(n)
    expect = {
        "sum": sum,
        "max": max,
        "min": min,
    }
    for out in results:
        for op, reduce in expect.items():
            got = out[op]
            assert got["int"] == reduce(r + 1 for r in ranks) and type(got["int"]) is int
            assert got["float"] == reduce(r + 0.5 for r in ranks) and type(got["float"]) is float
            t = got["tensor"]
            assert t.dtype == torch.float32 and t.shape == (3,)
            for i, f in enumerate((lambda r: r, lambda r: -r, lambda r: 2.5 * r)):
                assert t[i].item() == reduce(f(r) for r in ranks)
            it = got["int_tensor"]
            assert it.dtype == torch.int64 and it.shape == (1, 2)
            assert it.tolist() == [[reduce(ranks), reduce(10 - r for r in ranks)]]
            d = got["dict"]
            assert set(d) == {"loss", "count", "flag", "f"}
            assert isinstance(d["loss"], torch.Tensor) and d["loss"].item() == reduce(
                r * 1.5 for r in ranks
            )
            assert d["count"] == reduce(r + 1 for r in ranks) and type(d["count"]) is int
            assert type(d["flag"]) is bool and d["flag"] == bool(reduce(int(r == 0) for r in ranks))
            assert d["f"] == reduce(0.25 * r for r in ranks)
        assert out["mean"].startswith("ValueError: ") and "sum" in out["mean"]
        assert out["after_error"] == n


def _float_precision_worker() -> dict:
    ddpkit.init()
    sums = ddpkit.MetricSums()
    sums.update("x", 1e8, count=1)  # pre-summed python numbers, as the docstring allows
    sums.update("x", 1.0, count=1)
    return {
        "scalar": ddpkit.all_reduce(0.1),
        "dict": ddpkit.all_reduce({"third": 1 / 3}),
        "metric_sum": sums.reduced()["x"][0],
    }


def test_python_floats_keep_double_precision():
    # A Python float is a double. The helpers promise float64 transport ("float64 keeps ... sums
    # without loss"), and in a world of one they are the identity.
    assert ddpkit.all_reduce(0.1) == 0.1
    assert ddpkit.all_reduce({"third": 1 / 3}) == {"third": 1 / 3}
    sums = ddpkit.MetricSums()
    sums.update("x", 1e8, count=1)
    sums.update("x", 1.0, count=1)
    assert sums.reduced()["x"] == (1e8 + 1.0, 2)
    for out in run_on_ranks(_float_precision_worker, 2):
        assert out == {
            "scalar": 0.1 + 0.1,
            "dict": {"third": 1 / 3 + 1 / 3},
            "metric_sum": 2 * (1e8 + 1.0),
        }


VALUES = torch.arange(1, 11, dtype=torch.float64) ** 1.5  # ten samples


HITS = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0], dtype=torch.float64)


def _split(n: int) -> list[slice]:
    # Deliberately unbalanced; with three ranks the last one sees no sample at all.
    return {2: [slice(0, 3), slice(3, 10)], 3: [slice(0, 7), slice(7, 10), slice(10, 10)]}[n]


def _metric_worker() -> dict:
    rt = ddpkit.init()
    part = _split(rt.world_size)[rt.rank]
    sums = ddpkit.MetricSums()
    if part.stop > part.start:
        sums.update("loss", VALUES[part].float())  # per-sample values
        sums.update("acc", float(HITS[part].sum()), count=part.stop - part.start)  # pre-summed
    if rt.rank == 0:
        sums.update("only_rank0", torch.tensor([2.0, 4.0]))  # a metric the other ranks never saw
    local = {k: (float(s), sums.counts[k]) for k, s in sums.sums.items()}
    return {
        "local": local,
        "means": sums.compute(),
        "reduced": sums.reduced(),
        "empty": ddpkit.MetricSums().compute(),
    }


@pytest.mark.parametrize("n", WORLDS)
def test_metric_sums_exact_mean_with_uneven_and_empty_ranks(n):
    results = run_on_ranks(_metric_worker, n)
    expected_loss = VALUES.float().double().mean().item()  # one process, every sample
    expected_acc = HITS.mean().item()
    if n == 3:
        assert results[-1]["local"] == {}  # this rank really had no sample
    for out in results:
        assert out["means"]["loss"] == pytest.approx(expected_loss, rel=1e-12)
        assert out["means"]["acc"] == pytest.approx(expected_acc, rel=1e-12)
        assert out["means"]["only_rank0"] == 3.0
        assert out["reduced"]["loss"][1] == 10 and out["reduced"]["acc"][1] == 10
        assert out["empty"] == {}
    assert all(out["means"] == results[0]["means"] for out in results)
    # Control: averaging the ranks' own means (what a per-rank mean then all_reduce/world gives) is
    # wrong.
    per_rank = [s / c for out in results for (s, c) in [out["local"].get("loss", (0.0, 0))] if c]
    mean_of_means = sum(per_rank) / len(per_rank)
    assert abs(mean_of_means - expected_loss) > 1.0


def _gather_worker() -> dict:
    r = ddpkit.init().rank
    start = sum(range(r + 1)) - r  # rank r holds rows [start, start + r): rank 0 holds none
    rows = torch.arange(start, start + r, dtype=torch.int64)
    return {
        "rows": ddpkit.gather_tensors(torch.stack([rows, -rows], dim=1)),
        "floats": ddpkit.gather_tensors(torch.full((r + 1,), r + 0.5)),
        "all_empty": ddpkit.gather_tensors(torch.zeros(0, 3)),
        "objects": ddpkit.all_gather_object({"rank": r, "name": f"r{r}"}),
        "from0": ddpkit.broadcast_object({"from": r, "data": list(range(r))}, src=0),
        "from1": ddpkit.broadcast_object({"from": r, "data": list(range(r))}, src=1),
    }


def _contrastive_grads(with_grad: bool) -> torch.Tensor:
    """Rank r's ``r + 1`` rows' gradient of a loss that is each rank's mean over its own rows of a
    function of every rank's rows (as InfoNCE's negatives), under DDP's mean over ranks."""
    r = ddpkit.init().rank
    rows = torch.arange(r * (r + 1) // 2, (r + 1) * (r + 2) // 2, dtype=torch.float64)
    x = (rows[:, None] * torch.tensor([0.3, -0.2], dtype=torch.float64)).requires_grad_()
    every = ddpkit.gather_tensors(x, grad=with_grad)
    if not with_grad:  # what a detached gather gives: only this rank's own rows keep their graph
        start = r * (r + 1) // 2
        every = torch.cat([every[:start], x, every[start + len(x) :]])
    world = ddpkit.get_runtime().world_size
    loss = ((x @ every.T).exp().sum(1).log()).mean()
    (loss / world).backward()  # DDP's mean of the ranks' gradients
    return x.grad


@pytest.mark.parametrize("with_grad", [True, False], ids=["grad", "control-detached"])
def test_a_gather_with_grad_trains_what_one_process_trains(with_grad):
    results = run_on_ranks(_contrastive_grads, 3, (with_grad,))
    x = torch.arange(6, dtype=torch.float64)[:, None] * torch.tensor(
        [0.3, -0.2], dtype=torch.float64
    )
    x.requires_grad_()
    # one process: the mean over every row, in the ranks' shares (1, 2 and 3 rows) weighed alike
    shares = [x[0:1], x[1:3], x[3:6]]
    sum(((s @ x.T).exp().sum(1).log()).mean() for s in shares).div(3).backward()
    same = torch.allclose(torch.cat(results), x.grad, rtol=1e-12)
    assert same if with_grad else not same


@pytest.mark.parametrize("n", WORLDS)
def test_gather_and_broadcast(n):
    results = run_on_ranks(_gather_worker, n)
    total = sum(range(n))
    for out in results:
        rows = out["rows"]
        assert rows.dtype == torch.int64 and rows.shape == (total, 2)
        assert rows[:, 0].tolist() == list(range(total)) and rows[:, 1].tolist() == [
            -i for i in range(total)
        ]
        assert out["floats"].tolist() == [r + 0.5 for r in range(n) for _ in range(r + 1)]
        assert out["all_empty"].shape == (0, 3)
        assert out["objects"] == [{"rank": r, "name": f"r{r}"} for r in range(n)]
        assert out["from0"] == {"from": 0, "data": []}
        assert out["from1"] == {"from": 1, "data": [0]}


def _barrier_worker(tmp: str) -> dict:
    rt = ddpkit.init()
    out = {}
    Path(tmp, f"arrived_{rt.rank}").touch()
    ddpkit.barrier()
    # Every rank created its file before anyone left the barrier.
    out["after"] = sorted(p.name for p in Path(tmp).glob("arrived_*"))
    # The other way round: the other ranks cannot leave the next barrier, and write "late" files,
    # before rank 0 has looked and arrived there. (Also shows the listing is not trivially
    # complete.)
    if rt.rank == 0:
        out["late_seen_by_rank0"] = sorted(p.name for p in Path(tmp).glob("late_*"))
    ddpkit.barrier()
    if rt.rank != 0:
        Path(tmp, f"late_{rt.rank}").touch()
    return out


@pytest.mark.parametrize("n", WORLDS)
def test_barrier_waits_for_every_rank(n, tmp_path):
    results = run_on_ranks(_barrier_worker, n, (str(tmp_path),))
    assert [out["after"] for out in results] == [[f"arrived_{r}" for r in range(n)]] * n
    assert results[0]["late_seen_by_rank0"] == []
    assert sorted(p.name for p in tmp_path.glob("late_*")) == [f"late_{r}" for r in range(1, n)]


def _enter(path: Path, writer: bool) -> bool:
    existed = path.exists()
    if writer:
        path.write_text("prepared")
    return existed


def _main_first_worker(tmp: str) -> dict:
    rt = ddpkit.init()
    out = {}
    with ddpkit.main_first():
        out["global"] = _enter(Path(tmp, "global"), rt.rank == 0)
    with ddpkit.main_first(local=True):
        out["local"] = _enter(Path(tmp, "local"), rt.local_rank == 0)
    # Control, showing the probe detects a wrong order: rank 0 enters last.
    if rt.rank != 0:
        out["reversed"] = _enter(Path(tmp, "reversed"), False)
    ddpkit.barrier()
    if rt.rank == 0:
        out["reversed"] = _enter(Path(tmp, "reversed"), True)
    return out


@pytest.mark.parametrize("n", WORLDS)
def test_main_first_runs_rank0_before_the_others(n, tmp_path):
    results = run_on_ranks(_main_first_worker, n, (str(tmp_path),))
    assert [out["global"] for out in results] == [False] + [True] * (n - 1)
    assert [out["local"] for out in results] == [False] + [True] * (n - 1)
    # nobody saw the file: order not enforced
    assert [out["reversed"] for out in results] == [False] * n


def _print_worker() -> dict:
    r = ddpkit.init().rank
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
    try:
        ddpkit.print0("hello from", r)
        ddpkit.get_logger("ddpkit.test_collectives").info("main only %d", r)
        ddpkit.get_logger("ddpkit.test_collectives", all_ranks=True).info("every rank")
        return {"stdout": sys.stdout.getvalue(), "stderr": sys.stderr.getvalue()}
    finally:
        sys.stdout, sys.stderr = saved


@pytest.mark.parametrize("n", WORLDS)
def test_print0_and_logger_print_on_rank0_only(n):
    results = run_on_ranks(_print_worker, n)
    assert [out["stdout"] for out in results] == ["hello from 0\n"] + [""] * (n - 1)
    assert results[0]["stderr"] == "main only 0\n[rank 0] every rank\n"
    for r in range(1, n):
        assert results[r]["stderr"] == f"[rank {r}] every rank\n"


def _subgroup_worker(tmp: str) -> dict:
    rt = ddpkit.init()
    r = rt.rank
    group = dist.new_group([1, 2])  # every rank must call new_group, members or not
    out = {}
    saved = sys.stdout
    sys.stdout = io.StringIO()
    try:
        out["rank"] = ddpkit.get_runtime(group).rank
        out["world_size"] = ddpkit.get_runtime(group).world_size
        out["is_main"] = ddpkit.get_runtime(group).is_main
        out["sum"] = ddpkit.all_reduce(r, group=group)
        out["max"] = ddpkit.all_reduce(torch.tensor([r, -r]), "max", group=group).tolist()
        out["tensors"] = ddpkit.gather_tensors(torch.full((r,), r), group=group).tolist()
        out["objects"] = ddpkit.all_gather_object(f"r{r}", group=group)
        out["bcast0"] = ddpkit.broadcast_object(f"from{r}", src=0, group=group)
        out["bcast1"] = ddpkit.broadcast_object(f"from{r}", src=1, group=group)
        Path(tmp, f"arrived_{r}").touch()
        ddpkit.barrier(group)
        out["after_barrier"] = sorted(p.name for p in Path(tmp).glob("arrived_*"))
        with ddpkit.main_first(group=group):
            out["main_first"] = _enter(
                Path(tmp, f"group_file_{r > 0}"), ddpkit.get_runtime(group).is_main
            )
        sums = ddpkit.MetricSums()
        if r == 1:
            sums.update("v", torch.tensor([1.0, 2.0, 3.0]))
        out["metric"] = sums.compute(group)
        ddpkit.print0("group main", r, group=group)
        out["stdout"] = sys.stdout.getvalue()
    finally:
        sys.stdout = saved
    out["world_sum"] = ddpkit.all_reduce(1)  # the whole job still lines up afterwards
    return out


def test_helpers_with_a_subgroup(tmp_path):
    members_dir = tmp_path / "members"
    members_dir.mkdir()
    rank0, rank1, rank2 = run_on_ranks(_subgroup_worker, 3, (str(members_dir),))
    for global_rank, out in ((1, rank1), (2, rank2)):
        assert out["rank"] == global_rank - 1
        assert out["world_size"] == 2
        assert out["is_main"] is (global_rank == 1)
        assert out["sum"] == 3
        assert out["max"] == [2, -1]
        assert out["tensors"] == [1, 2, 2]
        assert out["objects"] == ["r1", "r2"]
        assert out["bcast0"] == "from1"  # group rank 0 is global rank 1
        assert out["bcast1"] == "from2"  # group rank 1 is global rank 2
        assert out["metric"] == {"v": 2.0}
        assert out["world_sum"] == 3
    assert rank1["main_first"] is False and rank2["main_first"] is True
    assert rank1["stdout"] == "group main 1\n" and rank2["stdout"] == ""
    # Members left the group barrier only once both members had arrived (rank 0 may or may not
    # have).
    for out in (rank1, rank2):
        assert {"arrived_1", "arrived_2"} <= set(out["after_barrier"])
    # A rank outside the group is no member (rank -1, not main, prints nothing); the collective
    # helpers are identities for it and do not wait for the group.
    assert (rank0["rank"], rank0["world_size"], rank0["sum"], rank0["objects"]) == (
        -1,
        -1,
        0,
        ["r0"],
    )
    assert rank0["is_main"] is False and rank0["stdout"] == ""
    assert rank0["tensors"] == [] and rank0["bcast1"] == "from0"
    assert rank0["world_sum"] == 3
