"""Memory slots (``ddpkit.snapshot._slots``) written and read as the Trainer's side does: the
helpers of the tests of snapshots in memory and of every format ddpkit reads."""

from __future__ import annotations

import torch

from ddpkit.snapshot import _codec as region
from ddpkit.snapshot import _slots as ms


def store(folder, rank=0, world=2, job="job-a", run="run-a") -> ms.Slots:
    return ms.Slots(folder, job=job, run=run, rank=rank, world_size=world)


def save(st: ms.Slots, step: int, tensors: list[torch.Tensor], extra=None) -> None:
    """What the Trainer's side does: lay the tensors out and commit them with the step's values."""
    specs, size = region.layout(tensors)
    manifest = {"specs": [[s.dtype, list(s.shape), s.offset] for s in specs], "data_size": size}
    key = tuple((t.dtype, t.shape) for t in tensors)
    values = {"step": step, "position": [0, step, step], "peers": False, "values": extra}
    st.save(values, tensors, manifest, key)


def load(found: ms.Found) -> tuple[dict, list[torch.Tensor]]:
    got = ms.read_slot(found.path, data=True)
    assert got is not None
    record, manifest, values, data = got
    return values, ms.tensors_of(data, record, manifest)
