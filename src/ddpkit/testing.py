"""Test your own distributed code the way ddpkit tests its own: real processes, real collectives, in
one call.

:func:`run_on_ranks` runs a function on N processes of the CPU joined over gloo, each with
:func:`ddpkit.init` already called, and returns what each rank returned; a rank that raises fails
the call with its traceback, and a hang fails it after ``timeout`` seconds instead of blocking the
test run. :func:`assert_same_on_ranks` checks, inside such a function, that every rank holds the
same value (a model's weights after a step, a sampler's order): the property DDP training rests on::

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

:func:`run_job` runs a script the way a user starts it, under ``ddpkit run`` in a fresh process,
from an environment without the variables of any job the tests themselves run in; :func:`start_job`
starts it the same way and returns at once, for a test that signals the job or reads its logs while
it runs; :func:`wait_until` waits, with a deadline, for what a running job makes true (a file it
writes, a process it ends)::

    from ddpkit.testing import run_job

    def test_the_job_trains(tmp_path):
        done = run_job("train.py", "--out", str(tmp_path), nproc=2)
        assert done.returncode == 0, done.stderr[-3000:]
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
from ddpkit._launch.spawn import spawn
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import all_gather_object
from ddpkit.distributed._runtime import get_runtime, init

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
    rank order.

    Inside ``fn`` the process group is up (:func:`ddpkit.get_runtime` says the rank). The processes
    are forked, so ``fn`` may be a local function or a lambda; once this process has initialised
    CUDA they are started afresh instead (CUDA does not survive a fork), and ``fn`` and ``args``
    must then be picklable (a function of a module). A collective that waits ``collective_timeout``
    seconds for a rank raises on the rank that waits; the whole call is bounded by ``timeout``
    (:func:`ddpkit.spawn`).
    """
    return spawn(
        functools.partial(_on_rank, fn, args, collective_timeout), world_size, timeout=timeout
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    # Bytes, not values: a NaN equals the same NaN, -0.0 differs from 0.0 (torch.equal says the
    # opposite).
    return torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
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


def assert_same_on_ranks(value: Any, group: Group = None) -> None:
    """Raise :class:`AssertionError` on every rank unless every rank of ``group`` holds the same
    ``value``: tensors bit for bit (a NaN equals the same NaN; their shape and dtype too), nested in
    dicts, lists and tuples (named ones too), floats with NaN equal to NaN, other values by ``==``
    (or their pickled bytes where ``==`` gives an array). The message names the first rank that
    differs from rank 0 and where. A collective: every rank calls it."""
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
    """``value`` with every tensor on the CPU: gathered as it is, a CUDA tensor would be unpickled
    onto the sender's GPU on every other rank."""
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
    """A copy of ``env`` (default: ``os.environ``) without :data:`LAUNCH_VARIABLES` and without any
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
    """Start ``ddpkit COMMAND --nproc NPROC *launcher_args script *args`` and return its
    :class:`subprocess.Popen` at once: for a test that acts on the job while it runs (signals it,
    reads its logs, waits for a file it writes).

    ``command`` is ``"run"`` by default; ``"check"`` and ``"bench"`` take the same form.
    ``script=None`` gives none (the command's built-in workload), and then no ``args``. The
    launcher starts from ``env`` (default: this process's environment) less the variables of an
    enclosing job (:func:`without_launch_env`), in a session of its own: ``os.killpg(proc.pid,
    signal.SIGKILL)`` ends its whole process group, and the workers end with the launcher. Output
    is text, on pipes unless ``stdout``/``stderr`` send it elsewhere (a file,
    ``subprocess.STDOUT``); other keyword arguments (``stdin``, ``preexec_fn``) go to
    :class:`subprocess.Popen`. The caller waits for the process, and reads the pipes meanwhile
    (``proc.communicate``)::

        with open(tmp_path / "job.log", "w") as log:
            proc = start_job("train.py", str(run_dir), stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: (run_dir / "metrics.jsonl").exists(), what="the first records")
        proc.send_signal(signal.SIGTERM)  # a pre-emption: the Trainer saves and exits 75
        assert proc.wait(timeout=120) == 75
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc}; give the number of worker processes, 1 or more")
    if script is None and args:
        raise ValueError(f"script=None with arguments {list(args)}: give the script they are for")
    argv = [sys.executable, "-m", "ddpkit.cli", command, "--nproc", str(nproc), *launcher_args]
    argv += [] if script is None else [os.fspath(script), *args]
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    # A session of its own: the launcher's process group can be signalled, or killed, whole, and
    # nothing the job started outlives the test.
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
    """``ddpkit COMMAND --nproc NPROC *launcher_args script *args`` as a fresh process
    (:func:`start_job`, ``ddpkit run`` by default); its exit status and output.

    The launcher starts from ``env`` (default: this process's environment) less the variables of an
    enclosing job (:func:`without_launch_env`), so a test run under a launcher starts a job of its
    own. ``launcher_args`` go before the script (``("--max-restarts", "1")``; end them with ``"-m"``
    to run a module). Output is captured as text. A job still running after ``timeout`` seconds is
    killed with everything it started (launcher, workers, their children) and :class:`TimeoutError`
    is raised with the end of its output::

        done = run_job("train.py", "--epochs", "2", launcher_args=("--max-restarts", "1"))
        assert done.returncode == 0, done.stderr[-3000:]
        checked = run_job("my_script.py", command="check", launcher_args=("--steps", "2"))
    """
    proc = start_job(
        script,
        *args,
        nproc=nproc,
        launcher_args=launcher_args,
        command=command,
        env=env,
        cwd=cwd,
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
    seconds, raise :class:`TimeoutError` naming ``what`` and the last value ``predicate`` returned.

    The waits between calls start at ``interval`` and double up to ``max_interval``: a condition
    that comes soon is seen soon, a long wait does not spin. An exception ``predicate`` raises (a
    process it checks has died) ends the wait at once. ``what`` may be a function, called at the
    timeout: the message can then carry what was true by then (the end of a log)::

        wait_until(lambda: (run_dir / "step-6").exists(), 60, what="the snapshot at step 6")
        pids = wait_until(lambda: sorted(folder.glob("*.pid")), what="the pid files")
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
