"""Test your own distributed code the way ddpkit tests its own: real processes, real collectives
(docs/runtime.md, "Testing your own code under ranks"): functions run on ranks
(:func:`run_on_ranks`, :func:`assert_same_on_ranks`) and scripts run as jobs (:func:`run_job`,
:func:`start_job`, :func:`wait_job`, :func:`wait_until`), whose end is a :class:`Job`.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from ddpkit import platforms
from ddpkit.distributed import Group
from ddpkit.distributed._collectives import all_gather_object, tensor_bytes
from ddpkit.distributed._runtime import get_runtime, init
from ddpkit.distributed._spawn import spawn

__all__ = [
    "LAUNCH_VARIABLES",
    "Job",
    "assert_same_on_ranks",
    "read_records",
    "run_job",
    "run_on_ranks",
    "start_job",
    "wait_job",
    "wait_until",
    "without_launch_env",
]

T = TypeVar("T")


def _on_rank(
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    collective_timeout: float,
    env: Callable[[int], Mapping[str, str]] | None,
) -> Any:
    if env is not None:
        os.environ.update(env(rank))
    init(backend="gloo", device="cpu", timeout=timedelta(seconds=collective_timeout))
    return fn(*args)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    args: tuple[Any, ...] = (),
    *,
    timeout: float = 120.0,
    collective_timeout: float = 30.0,
    env: Callable[[int], Mapping[str, str]] | None = None,
) -> list[Any]:
    """``fn(*args)`` on ``world_size`` local CPU processes joined over gloo; each rank's result, in
    rank order. A rank that raises fails the call with its traceback. Forked (``fn`` may be a
    lambda) unless this process initialised CUDA (then ``fn`` and ``args`` must be picklable). A
    collective waits at most ``collective_timeout`` seconds, the call at most ``timeout``.
    ``env(rank)``: variables set in a rank's environment before it joins (``LOCAL_RANK="0"`` and
    ``LOCAL_WORLD_SIZE="1"``: each rank a node of its own).
    """
    job = functools.partial(
        _on_rank, fn=fn, args=args, collective_timeout=collective_timeout, env=env
    )
    return spawn(job, world_size, timeout=timeout, pass_rank=True)


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


def read_records(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl`` in the order written (none if there is no such
    file); a line a kill cut short, or one that holds no JSON object, is skipped."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    found = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            found.append(record)
    return found


class Job(subprocess.CompletedProcess[str]):
    """A job of :func:`run_job` (or of :func:`start_job`, through :func:`wait_job`) that ended: a
    :class:`subprocess.CompletedProcess` (``args``, ``returncode``, ``stdout``, ``stderr``,
    ``check_returncode()``) that also reads what the job left behind.

    ``run_dir``: the run directory given to :func:`run_job` (the job's ``TrainerConfig.run_dir``),
    whose records :attr:`records` and :meth:`events` read. ``log_dir``: the folder ``ddpkit run``
    made for this run under its ``--log-dir``, where the other local ranks' output went (None when
    no rank wrote there, which the launcher then removes, or for ``check`` and ``bench``).
    """

    def __init__(
        self,
        args: Any,
        returncode: int,
        stdout: str = "",
        stderr: str = "",
        *,
        run_dir: str | os.PathLike[str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.log_dir = None if log_dir is None else Path(log_dir)

    @property
    def records(self) -> list[dict[str, Any]]:
        """:func:`read_records` of ``run_dir``."""
        if self.run_dir is None:
            raise ValueError("this job was given no run_dir: pass run_dir= to run_job or wait_job")
        return read_records(self.run_dir)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The records of kind ``"event"`` (``start``, ``resume``, ``recover``, ``stop``, ...),
        those named ``name`` only if given."""
        return [
            r
            for r in self.records
            if r.get("kind") == "event" and (name is None or r.get("event") == name)
        ]

    def output(self, rank: int, stream: str = "stdout") -> str:
        """What local rank ``rank`` wrote to ``stream`` (``"stdout"`` or ``"stderr"``): rank 0's
        is the job's own (with the launcher's lines); another rank's is its log file under
        ``log_dir``, every attempt's in order ("" if it wrote nothing)."""
        if stream not in ("stdout", "stderr"):
            raise ValueError(f"stream={stream!r}; give 'stdout' or 'stderr'")
        if rank == 0:
            return (self.stdout if stream == "stdout" else self.stderr) or ""
        if self.log_dir is None:
            return ""
        files = self.log_dir.glob(f"*/attempt_*/{rank}/{stream}.log")
        in_order = sorted(files, key=lambda p: int(p.parent.parent.name[len("attempt_") :]))
        return "".join(p.read_text(errors="replace") for p in in_order)


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
    return its :class:`subprocess.Popen` at once; :func:`wait_job` waits for its end.

    The launcher starts from ``env`` (default: this process's) less an enclosing job's variables
    (:func:`without_launch_env`), in a session of its own. Output is text, on pipes unless
    ``stdout``/``stderr`` say otherwise; other keyword arguments go to :class:`subprocess.Popen`.
    ``ddpkit run`` gets its ``--log-dir`` as an absolute path (``ddpkit-logs`` in ``cwd`` unless
    ``launcher_args`` name one), where :meth:`Job.output` finds the ranks' output.
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc}; give the number of worker processes, 1 or more")
    if script is None and args:
        raise ValueError(f"script=None with arguments {list(args)}: give the script they are for")
    options = list(launcher_args)
    if command == "run":
        options = _log_dir_first(options, Path(cwd if cwd is not None else os.getcwd()).absolute())
    argv = [sys.executable, "-m", "ddpkit.cli", command, "--nproc", str(nproc), *options]
    argv += [] if script is None else [os.fspath(script), *args]
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(
        argv, env=without_launch_env(env), cwd=cwd, text=True, start_new_session=True, **popen
    )


def _log_dir_first(options: Sequence[str], cwd: Path) -> list[str]:
    """``options`` with their ``--log-dir`` (the last given, as the launcher reads them, else
    ``ddpkit-logs``) made absolute and put first."""
    root, rest, i = "ddpkit-logs", [], 0
    while i < len(options):
        if options[i] == "--log-dir" and i + 1 < len(options):
            root, i = options[i + 1], i + 2
        elif options[i].startswith("--log-dir="):
            root, i = options[i].split("=", 1)[1], i + 1
        else:
            rest.append(options[i])
            i += 1
    return ["--log-dir", str(cwd / root), *rest]


def _run_log_dir(proc: subprocess.Popen[str]) -> Path | None:
    """The folder that ``ddpkit run`` (the process ``proc``, started by :func:`start_job`) made
    under its ``--log-dir`` for this run: ``<date>-<time>-<pid>``."""
    argv = cast("list[str]", proc.args)
    if argv[3:4] != ["run"] or argv[6:7] != ["--log-dir"]:
        return None
    mine = [
        p
        for p in Path(argv[7]).glob(f"*-{proc.pid}")
        if p.is_dir() and re.fullmatch(r"\d{8}-\d{6}-\d+", p.name)
    ]
    return mine[0] if len(mine) == 1 else None


def wait_job(
    proc: subprocess.Popen[str],
    timeout: float = 300.0,
    *,
    run_dir: str | os.PathLike[str] | None = None,
) -> Job:
    """Wait for the job ``proc`` of :func:`start_job` to end; its :class:`Job` (``run_dir``: as
    for :func:`run_job`). Output sent elsewhere than a pipe reads as "". A job still running after
    ``timeout`` seconds is killed with everything it started, and :class:`TimeoutError` is raised
    with the end of its output.
    """
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
            f"{' '.join(argv[2:])} still running after {timeout:g} s, killed"
            f"\n--- stdout (end)\n{(out or '')[-3000:]}\n--- stderr (end)\n{(err or '')[-3000:]}"
        ) from None
    return Job(
        argv, proc.returncode, out or "", err or "", run_dir=run_dir, log_dir=_run_log_dir(proc)
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
    run_dir: str | os.PathLike[str] | None = None,
) -> Job:
    """Run the job of :func:`start_job` to its end; its :class:`Job`: exit status and output (text),
    the records of ``run_dir`` (the job's run directory, if the test wants them), each rank's
    output.

    ``launcher_args`` go before the script (end them with ``"-m"`` to run a module). A job still
    running after ``timeout`` seconds is killed with everything it started, and
    :class:`TimeoutError` is raised with the end of its output.
    """
    proc = start_job(
        script, *args, nproc=nproc, launcher_args=launcher_args, command=command, env=env, cwd=cwd
    )
    return wait_job(proc, timeout, run_dir=run_dir)


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
