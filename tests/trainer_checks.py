"""Comparisons shared by the tests of runs: final states bit for bit, and the samples a run really
trained on."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.testing import _differences, read_records


def differences(a: Any, b: Any, *parts: str) -> list[str]:
    """Where ``a`` and ``b`` differ, bit for bit (``parts``: their entries of those keys only):
    nested dicts, lists and tuples of tensors and values; a tensor by its dtype, shape and bytes
    (the same NaN is equal, -0.0 is not 0.0), another value by ``==``."""
    if parts:
        a, b = {p: a[p] for p in parts}, {p: b[p] for p in parts}
    return _differences(a, b, "state")


def same_bits(a: Any, b: Any, *parts: str) -> bool:
    """No :func:`differences`."""
    return not differences(a, b, *parts)


def bitwise_equal(a: dict, b: dict) -> bool:
    """The Trainer job's model, optimizer and scheduler states identical to the bit."""
    return same_bits(a, b, "model", "optimizer", "scheduler")


def rank_differences(
    out: str | Path, reference: str | Path, world: int = 2
) -> dict[int, list[str]]:
    """For each rank, the keys of its final state (``out.rank<r>``, written by the test job) that
    are not bitwise those of the same rank of ``reference``."""
    found = {}
    for rank in range(world):
        a = torch.load(f"{out}.rank{rank}", weights_only=False)
        b = torch.load(f"{reference}.rank{rank}", weights_only=False)
        assert a.keys() == b.keys(), f"rank {rank}: {sorted(a.keys() ^ b.keys())}"
        found[rank] = [k for k in a if differences(a[k], b[k])]
    return found


def rank_max_abs_diff(out: str | Path, reference: str | Path, world: int = 2) -> float:
    """Largest absolute difference over every rank's floating-point tensors."""
    worst = 0.0
    for rank in range(world):
        a = torch.load(f"{out}.rank{rank}", weights_only=False)
        b = torch.load(f"{reference}.rank{rank}", weights_only=False)
        for k, v in a.items():
            if torch.is_tensor(v) and v.is_floating_point():
                worst = max(worst, (v.double() - b[k].double()).abs().max().item())
    return worst


def max_abs_diff(a: dict, b: dict) -> float:
    return max(
        (a["model"][k].double() - b["model"][k].double()).abs().max().item() for k in a["model"]
    )


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest relative difference (norm of difference / norm) over the model's float tensors."""
    out = 0.0
    for k, ref in b["model"].items():
        if ref.is_floating_point():
            diff = (a["model"][k].double() - ref.double()).norm() / ref.double().norm().clamp(
                min=1e-12
            )
            out = max(out, diff.item())
    return out


def use_reference(reference_dir: Path, tmp: Path) -> dict:
    """An uninterrupted run's final states (``reference.pt`` and each rank's
    ``reference.pt.rank<r>`` in ``reference_dir``, a reference fixture's) copied into ``tmp``,
    beside the runs compared to them; rank 0's."""
    for path in reference_dir.glob("reference.pt*"):
        (tmp / path.name).write_bytes(path.read_bytes())
    return torch.load(tmp / "reference.pt", weights_only=False)


def resume_steps(run_dir: str | Path) -> dict[int, int]:
    """Attempt number -> optimizer step it resumed from, read from the run's event log."""
    steps = {}
    for rec in read_records(run_dir):
        if rec.get("event") in ("start", "resume"):  # "start": no snapshot yet, so from step 0
            steps[rec["restart_count"]] = rec["step"]
    return steps


def samples_per_epoch(log_dir: str | Path, resumed: dict[int, int]) -> dict[int, list[int]]:
    """Samples trained on in each epoch by the work that counted.

    Work of attempt ``a`` at or after the step that attempt ``a + 1`` resumed from was lost with the
    crash and redone, so it is left out; what remains is what the final weights were trained on.
    """
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for path in sorted(Path(log_dir).glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            nxt = resumed.get(rec["attempt"] + 1)
            if nxt is not None and rec["step"] >= nxt:
                continue
            per_epoch[rec["epoch"]] += rec["idx"]
    return dict(per_epoch)


def assert_each_sample_once(per_epoch: dict[int, list[int]], n_samples: int, epochs: int) -> None:
    assert sorted(per_epoch) == list(range(epochs)), f"epochs trained: {sorted(per_epoch)}"
    for epoch, idx in per_epoch.items():
        repeated = len(idx) - len(set(idx))
        missing = n_samples - len(set(idx))
        assert repeated == 0 and missing == 0, (
            f"epoch {epoch}: {repeated} samples twice, {missing} never"
        )


def newest_snapshot(run_dir: str | Path) -> tuple[int, dict]:
    """(step, model state) of the newest whole snapshot folder (DCP), read into one file with
    torch's converter."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    markers = sorted((Path(run_dir) / "snapshots").glob("step-*/complete.json"))
    assert markers, f"no snapshot in {run_dir}"
    folder = markers[-1].parent
    dcp_to_torch_save(folder, Path(run_dir) / f"{folder.name}.pt")
    return int(folder.name.split("-")[1]), torch.load(
        Path(run_dir) / f"{folder.name}.pt", weights_only=True
    )["model"]


class _Overflow(torch.autograd.Function):
    """The identity, whose gradient is infinite while ``ON[0]``: a gradient overflow in the layers
    before it, with the loss and the layers after it finite."""

    ON = [False]

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf") if _Overflow.ON[0] else grad


class Overflow(nn.Module):
    """:class:`_Overflow` as a layer; ``Overflow.ON[0] = True`` turns it on."""

    ON = _Overflow.ON

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Overflow.apply(x)
