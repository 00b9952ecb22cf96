"""Test your own distributed code the way ddpkit tests its own: real processes, real collectives
(docs/runtime.md, "Testing your own code under ranks"): functions run on ranks
(:func:`run_on_ranks`, :func:`assert_same_on_ranks`) and scripts run as jobs (:func:`run_job`,
:func:`start_job`, :func:`wait_until`).
"""

from __future__ import annotations

import functools
import os
import pickle
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch

from ddpkit import platforms
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import all_gather_object, tensor_bytes
from ddpkit.distributed._runtime import get_runtime, init
from ddpkit.distributed._spawn import spawn

__all__ = [
    "LAUNCH_VARIABLES",
    "assert_same_on_ranks",
    "run_job",
    "run_on_ranks",
    "start_job",
    "wait_until",
    "without_launch_env",
]

T = TypeVar("T")


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
    """``fn(*args)`` on ``world_size`` local CPU processes joined over gloo; each rank's result, in
    rank order. A rank that raises fails the call with its traceback. Forked (``fn`` may be a
    lambda) unless this process initialised CUDA (then ``fn`` and ``args`` must be picklable). A
    collective waits at most ``collective_timeout`` seconds, the call at most ``timeout``.
    """
    return spawn(
        functools.partial(_on_rank, fn, args, collective_timeout), world_size, timeout=timeout
    )


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (a != a and b != b)  # NaN: the same on both ranks
    try:
        return bool(a == b)
    # == gives an array (numpy), or no truth value: the bytes
    except (TypeError, ValueError, RuntimeError):
        return pickle.dumps(a) == pickle.dumps(b)


def _differences(a: Any, b: Any, path: str = "value") -> list[str]:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        # Bytes, not values: a NaN equals the same NaN, -0.0 differs from 0.0 (torch.equal says
        # the opposite).
        same = (a.shape, a.dtype) == (b.shape, b.dtype) and tensor_bytes(a) == tensor_bytes(b)
        return [] if same else [path]
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if a.keys() != b.keys():
            return [f"{path} (keys)"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return [f"{path} (length)"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if _same_value(a, b) else [path]


def assert_same_on_ranks(value: Any, group: Group = None) -> None:
    """Raise :class:`AssertionError` on every rank unless every rank of ``group`` holds the same
    ``value``: tensors bit for bit (shape and dtype too), nested in dicts, lists and tuples, NaN
    equal to NaN, other values by ``==`` (or their pickled bytes). The message names the first rank
    that differs from rank 0 and where. A collective: every rank calls it."""
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
    """``value`` with every tensor on the CPU (unpickled, a CUDA one goes to the sender's GPU)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        moved = [_on_cpu(v) for v in value]
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    return value


LAUNCH_VARIABLES = platforms.LAUNCH_VARIABLES
"""Variables through which a launcher or a scheduler tells a process where it sits in a job
(``ddpkit.platforms.LAUNCH_VARIABLES``): :func:`without_launch_env` leaves them out."""


def without_launch_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default: ``os.environ``) without :data:`LAUNCH_VARIABLES` and any
    ``SLURM_*``, ``TORCHELASTIC_*``, ``PMI_*``, ``PMIX_*`` or ``OMPI_*`` variable."""
    return platforms.without_launch_env(os.environ if env is None else env)


def start_job(
    script: str | os.PathLike[str] | None,
    *args: str,
    nproc: int = 2,
    launcher_args: Sequence[str] = (),
    command: str = "run",
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    **popen: Any,
) -> subprocess.Popen[str]:
    """Start ``ddpkit COMMAND --nproc NPROC *launcher_args script *args`` (``command``: ``"run"``,
    ``"check"`` or ``"bench"``; ``script=None``: the command's built-in workload, no ``args``) and
    return its :class:`subprocess.Popen` at once.

    The launcher starts from ``env`` (default: this process's) less an enclosing job's variables
    (:func:`without_launch_env`), in a session of its own. Output is text, on pipes unless
    ``stdout``/``stderr`` say otherwise; other keyword arguments go to :class:`subprocess.Popen`.
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc}; give the number of worker processes, 1 or more")
    if script is None and args:
        raise ValueError(f"script=None with arguments {list(args)}: give the script they are for")
    argv = [sys.executable, "-m", "ddpkit.cli", command, "--nproc", str(nproc), *launcher_args]
    argv += [] if script is None else [os.fspath(script), *args]
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(
        argv, env=without_launch_env(env), cwd=cwd, text=True, start_new_session=True, **popen
    )


def run_job(
    script: str | os.PathLike[str] | None,
    *args: str,
    nproc: int = 2,
    launcher_args: Sequence[str] = (),
    command: str = "run",
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    timeout: float = 300.0,
) -> subprocess.CompletedProcess[str]:
    """Run the job of :func:`start_job` to its end; its exit status and output (text).

    ``launcher_args`` go before the script (end them with ``"-m"`` to run a module). A job still
    running after ``timeout`` seconds is killed with everything it started, and
    :class:`TimeoutError` is raised with the end of its output.
    """
    proc = start_job(
        script, *args, nproc=nproc, launcher_args=launcher_args, command=command, env=env, cwd=cwd
    )
    argv = cast("list[str]", proc.args)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=30)
        # a process that left the group still holds the pipes open
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = "", ""
        raise TimeoutError(
            f"run_job: {' '.join(argv[2:])} still running after {timeout:g} s, killed"
            f"\n--- stdout (end)\n{out[-3000:]}\n--- stderr (end)\n{err[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def wait_until(
    predicate: Callable[[], T],
    timeout: float = 120.0,
    *,
    what: str | Callable[[], str] = "the condition",
    interval: float = 0.01,
    max_interval: float = 0.5,
) -> T:
    """Call ``predicate`` until it returns a true value, and return that value; after ``timeout``
    seconds, raise :class:`TimeoutError` naming ``what`` (or what a callable ``what`` returns) and
    the last value. The waits start at ``interval`` and double up to ``max_interval``; an exception
    ``predicate`` raises ends the wait at once.
    """
    # NaN fails every comparison
    if not (timeout >= 0 and interval > 0 and max_interval >= interval):
        raise ValueError(
            f"wait_until: timeout={timeout}, interval={interval}, max_interval={max_interval}; "
            "give timeout >= 0 and 0 < interval <= max_interval"
        )
    deadline = time.monotonic() + timeout
    pause = interval
    while True:
        value = predicate()
        if value:
            return value
        left = deadline - time.monotonic()
        if left <= 0:
            name = what() if callable(what) else what
            raise TimeoutError(f"waited {timeout:g} s for {name}; last seen: {value!r}")
        time.sleep(min(pause, left))
        pause = min(pause * 2, max_interval)
