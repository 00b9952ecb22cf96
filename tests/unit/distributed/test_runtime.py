"""Picking a rank's device: more local ranks than GPUs is refused naming the fix (the GPUs are
mocked)."""

from __future__ import annotations

import pytest
import torch

import ddpkit


def test_more_local_ranks_than_gpus_names_the_fix(monkeypatch):
    # Pure logic: no GPU here, so the device count is mocked.

    from ddpkit.distributed._runtime import _pick_device
    from ddpkit.platforms._base import LaunchEnv

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    launch = LaunchEnv(rank=3, local_rank=3, world_size=4, local_world_size=4, launcher="torchrun")
    with pytest.raises(
        ddpkit.ConfigError, match="4 processes on this node but only 2 GPU.*--nproc 2"
    ):
        _pick_device(launch, None)
    assert _pick_device(
        LaunchEnv(rank=1, local_rank=1, world_size=2, local_world_size=2), None
    ) == torch.device("cuda", 1)


def _init_calls(monkeypatch, device: str | None, cuda: bool) -> dict:
    """The keywords init() passes to init_process_group for local rank 1 of a torchrun job of 2, on
    a machine with (mocked) 2 GPUs or none: pure logic, no process group is made."""
    import torch.distributed as dist

    from ddpkit.distributed import _runtime as runtime
    from ddpkit.platforms._base import LaunchEnv

    calls: list[dict] = []
    launch = LaunchEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, launcher="torchrun")
    monkeypatch.setattr(runtime, "read_launch_env", lambda: launch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if cuda else 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(runtime, "hold_stop_signals", lambda: None)
    monkeypatch.setattr(runtime, "_rendezvous_store", lambda launch, timeout: dist.HashStore())
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        dist, "init_process_group", lambda backend, **kw: calls.append({"backend": backend, **kw})
    )
    monkeypatch.setattr(runtime.atexit, "register", lambda fn: None)
    monkeypatch.setattr(runtime.torchrun, "uneven_nodes", lambda env: None)
    monkeypatch.setattr(runtime, "_runtime", None)
    runtime.init(device=device)
    monkeypatch.setattr(runtime, "_runtime", None)
    (call,) = calls
    return call


def test_a_gpu_rank_binds_its_process_group_to_its_own_gpu(monkeypatch):
    """``device_id`` is the rank's own GPU: torch's newer NCCL group would otherwise pick one from
    LOCAL_RANK or the global rank, which is another rank's when ranks are mapped to GPUs
    otherwise."""
    call = _init_calls(monkeypatch, None, cuda=True)
    assert (call["backend"], call["device_id"]) == ("nccl", torch.device("cuda", 1))
    call = _init_calls(monkeypatch, "cuda:0", cuda=True)  # the device asked for, not LOCAL_RANK's
    assert call["device_id"] == torch.device("cuda", 0)
    # Control: on the CPU (gloo) nothing is bound.
    call = _init_calls(monkeypatch, None, cuda=False)
    assert call["backend"] == "gloo" and "device_id" not in call
