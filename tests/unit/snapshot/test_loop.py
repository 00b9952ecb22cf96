"""``ddpkit.Snapshots`` refuses bad arguments naming what to change (one process; the loop on real
ranks is in ``tests/jobs/snapshot/test_loop.py``)."""

from __future__ import annotations

import pytest
import torch

import ddpkit
from ddpkit._errors import ConfigError


def test_bad_arguments_name_what_to_change(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="every_steps=0"):
        ddpkit.Snapshots(tmp_path, model=model, every_steps=0)
    with pytest.raises(ConfigError, match="build_loader"):
        ddpkit.Snapshots(tmp_path, model=model, loader=torch.utils.data.DataLoader(range(4)))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="optimizer 0 holds a parameter of no model"):
        ddpkit.Snapshots(
            tmp_path,
            model=model,
            optimizer=torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1),
        )
