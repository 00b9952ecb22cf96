"""Test your own distributed code the way ddpkit tests its own: real processes, real collectives, in one call.

:func:`run_on_ranks` runs a function on N processes of the CPU joined over gloo, each with
:func:`ddpkit.init` already called, and returns what each rank returned; a rank that raises fails the call
with its traceback, and a hang fails it after ``timeout`` seconds instead of blocking the test run.
:func:`assert_same_on_ranks` checks, inside such a function, that every rank holds the same value (a model's
weights after a step, a sampler's order): the property DDP training rests on::

    import torch, ddpkit
    from ddpkit.testing import assert_same_on_ranks, run_on_ranks

    def one_step():
        model = ddpkit.prepare_model(torch.nn.Linear(4, 1))
        rank = ddpkit.get_runtime().rank
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))  # per rank
        model(x).pow(2).mean().backward()  # DDP averages the gradients over the ranks
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        assert_same_on_ranks(ddpkit.unwrap(model).state_dict())
        return rank

    def test_ranks_stay_in_step():
        assert run_on_ranks(one_step, world_size=2) == [0, 1]
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from ddpkit.distributed.collectives import all_gather_object
from ddpkit.distributed.runtime import get_runtime, init
from ddpkit.launch.spawn import spawn


def _on_rank(fn: Callable[..., Any], args: tuple[Any, ...], collective_timeout: float) -> Any:
    init(backend="gloo", device="cpu", timeout=timedelta(seconds=collective_timeout))
    return fn(*args)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    *,
    timeout: float = 120.0,
    collective_timeout: float = 30.0,
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` local CPU processes joined over gloo; each rank's result, in rank order.

    Inside ``fn`` the process group is up (:func:`ddpkit.get_runtime` says the rank). The processes are forked,
    so ``fn`` may be a local function or a lambda; once this process has initialised CUDA they are started
    afresh instead (CUDA does not survive a fork), and ``fn`` and ``args`` must then be picklable (a function
    of a module). A collective that waits ``collective_timeout`` seconds
    for a rank raises on the rank that waits; the whole call is bounded by ``timeout`` (:func:`ddpkit.spawn`).
    """
    return spawn(functools.partial(_on_rank, fn, args, collective_timeout), world_size, timeout=timeout)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    # Bytes, not values: a NaN equals the same NaN, -0.0 differs from 0.0 (torch.equal says the opposite).
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (a != a and b != b)  # NaN: the same on both ranks
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # == gives an array (numpy), or no truth value: the bytes
        return pickle.dumps(a) == pickle.dumps(b)


def _differences(a: Any, b: Any, path: str = "value") -> list[str]:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if _same_bits(a, b) else [path]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if a.keys() != b.keys():
            return [f"{path} (keys)"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return [f"{path} (length)"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if _same_value(a, b) else [path]


def assert_same_on_ranks(value: Any, group: Any = None) -> None:
    """Raise :class:`AssertionError` on every rank unless every rank of ``group`` holds the same ``value``:
    tensors bit for bit (a NaN equals the same NaN; their shape and dtype too), nested in dicts, lists and
    tuples (named ones too), floats with NaN equal to NaN, other values by ``==`` (or their pickled bytes where
    ``==`` gives an array). The message names the first rank that differs from rank 0 and where. A
    collective: every rank calls it."""
    every = all_gather_object(_on_cpu(value), group=group)
    for rank, theirs in enumerate(every[1:], start=1):
        differ = _differences(every[0], theirs)
        if differ:
            me = get_runtime(group).rank
            raise AssertionError(
                f"rank {rank} differs from rank 0 in {', '.join(differ[:5])}"
                + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
                + f" (seen from rank {me})"
            )


def _on_cpu(value: Any) -> Any:
    """``value`` with every tensor on the CPU: gathered as it is, a CUDA tensor would be unpickled onto the
    sender's GPU on every other rank."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        moved = [_on_cpu(v) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    return value
