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
        ...
        assert_same_on_ranks(model.state_dict())
        return ddpkit.get_runtime().rank

    def test_ranks_stay_in_step():
        assert run_on_ranks(one_step, world_size=2) == [0, 1]
"""

from __future__ import annotations

import functools
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

    Inside ``fn`` the process group is up (:func:`ddpkit.get_runtime` says the rank); ``fn`` may be a local
    function or a lambda (the processes are forked). A collective that waits ``collective_timeout`` seconds
    for a rank raises on the rank that waits; the whole call is bounded by ``timeout`` (:func:`ddpkit.spawn`).
    """
    return spawn(functools.partial(_on_rank, fn, args, collective_timeout), world_size, timeout=timeout)


def _differences(a: Any, b: Any, path: str = "value") -> list[str]:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
        return [] if same else [path]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if a.keys() != b.keys():
            return [f"{path} (keys)"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return [f"{path} (length)"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if type(a) is type(b) and a == b else [path]


def assert_same_on_ranks(value: Any, group: Any = None) -> None:
    """Raise :class:`AssertionError` on every rank unless every rank of ``group`` holds the same ``value``:
    tensors bit for bit (on the CPU), nested in dicts, lists and tuples, other values by ``==``. The message
    names the first rank that differs from rank 0 and where. A collective: every rank calls it."""
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
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value) if not hasattr(value, "_fields") else value
    return value
