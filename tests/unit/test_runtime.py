"""Picking a rank's device: more local ranks than GPUs is refused naming the fix (the GPUs are mocked)."""

from __future__ import annotations

import pytest
import torch

import ddpkit


def test_more_local_ranks_than_gpus_names_the_fix(monkeypatch):
    # Pure logic: no GPU here, so the device count is mocked.

    from ddpkit.distributed.environment import LaunchEnv
    from ddpkit.distributed.runtime import _pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    launch = LaunchEnv(rank=3, local_rank=3, world_size=4, local_world_size=4, launcher="torchrun")
    with pytest.raises(ddpkit.ConfigError, match="4 processes on this node but only 2 GPU.*--nproc 2"):
        _pick_device(launch, None)
    assert _pick_device(LaunchEnv(rank=1, local_rank=1, world_size=2, local_world_size=2), None) == torch.device(
        "cuda", 1
    )
