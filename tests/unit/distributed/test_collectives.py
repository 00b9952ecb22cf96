"""Collective helpers without a process group (identities in a world of one) and their refusals of
bad arguments."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ddpkit


def test_all_reduce_invalid_op_without_group():
    with pytest.raises(ValueError, match="op='avg'"):
        ddpkit.all_reduce(torch.ones(2), "avg")


def test_metric_sums_rejects_number_without_count():
    with pytest.raises(ValueError, match="count="):
        ddpkit.MetricSums().update("loss", 3.0)


def test_helpers_without_process_group_are_identities(capsys, tmp_path):
    assert not dist.is_initialized()
    rt = ddpkit.get_runtime()
    assert (rt.rank, rt.world_size, rt.is_main) == (0, 1, True)
    t = torch.arange(6.0).reshape(3, 2)
    assert ddpkit.gather_tensors(t) is t
    assert ddpkit.all_gather_object({"a": 1}) == [{"a": 1}]
    obj = {"b": [1, 2]}
    assert ddpkit.broadcast_object(obj) is obj and ddpkit.broadcast_object(obj, src=0) is obj
    assert ddpkit.all_reduce(7) == 7 and ddpkit.all_reduce(2.5, "max") == 2.5
    assert torch.equal(ddpkit.all_reduce(t, "min"), t)
    assert ddpkit.all_reduce({"n": 3, "flag": True, "x": torch.tensor(1.5)}) == {
        "n": 3,
        "flag": True,
        "x": torch.tensor(1.5),
    }
    ddpkit.barrier()
    entered = []
    with ddpkit.main_first():
        entered.append(1)
    with ddpkit.main_first(local=True):
        entered.append(2)
    assert entered == [1, 2]
    ddpkit.print0("only", "one")
    assert capsys.readouterr().out == "only one\n"
    sums = ddpkit.MetricSums()
    sums.update("loss", torch.tensor([1.0, 2.0, 6.0]))
    assert sums.compute() == {"loss": 3.0}
