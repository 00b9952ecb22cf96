"""``ddpkit run``: an argument builder over torchrun's elastic agent (``torch.distributed.run``).

No process management of our own: anything that runs under torchrun runs under ``ddpkit run`` and vice versa.
What it adds are defaults for what users trip over, and one readable summary when a worker fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ddpkit.cluster import cpu_count
from ddpkit.errors import ConfigError


@dataclass(kw_only=True)
class LaunchConfig:
    """Options of ``ddpkit run``; each maps onto torchrun's."""

    script: str
    """The training script (or module, with ``module=True``)."""
    script_args: list[str] = field(default_factory=list)
    module: bool = False
    nproc: str = "auto"
    """``auto`` (one per GPU, or a count that fits the cores), ``gpu``, or a number."""
    nnodes: str = "1"
    """Number of nodes, or ``MIN:MAX`` for an elastic job."""
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    """``HOST:PORT`` every node can reach; needed with more than one node."""
    rdzv_id: str | None = None
    local_addr: str | None = None
    max_restarts: int = 0
    """How many times the agent restarts all workers after one fails."""
    all_ranks: bool = False
    """Show every rank's output, each line prefixed with ``[rank N]``; by default only local rank 0's."""
    log_dir: str | None = None
    """Where each rank's output and error files go (a temporary folder by default)."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: must be >= 0")
        if self.nproc not in ("auto", "gpu") and not (self.nproc.isdigit() and int(self.nproc) > 0):
            raise ConfigError(f"--nproc {self.nproc!r}: use auto, gpu, or a positive number of processes")
        if self.max_nodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT reachable from every node")

    @property
    def max_nodes(self) -> int:
        try:
            return int(self.nnodes.split(":")[-1])
        except ValueError:
            raise ConfigError(f"--nnodes {self.nnodes!r}: use a number of nodes or MIN:MAX") from None


def resolve_nproc(nproc: str) -> int:
    """Processes per node for ``--nproc``: GPUs visible, or on a CPU-only machine one per core up to 8."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc == "gpu":
        if not gpus:
            raise ConfigError("--nproc gpu but no GPU is visible: use --nproc auto or a number of CPU processes")
        return gpus
    if nproc == "auto":
        # On CPUs every process runs its own intra-op thread pool; past ~8 processes gloo's all-reduce costs
        # more than the extra processes bring, so larger machines get more threads per process instead.
        return gpus or max(1, min(cpu_count(), 8))
    return int(nproc)


def torchrun_argv(cfg: LaunchConfig, nproc: int) -> list[str]:
    """The torchrun command line (without the program name) that carries out ``cfg``."""
    argv = ["--nproc-per-node", str(nproc), "--max-restarts", str(cfg.max_restarts)]
    if cfg.max_nodes == 1 and not cfg.rdzv_endpoint:
        # Rendezvous on localhost:0: the agent binds a free port, so two jobs on one machine never collide
        # (the "address already in use" / DistNetworkError of a fixed port 29500).
        argv.append("--standalone")
    else:
        argv += ["--nnodes", cfg.nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", str(cfg.rdzv_endpoint)]
        argv += ["--rdzv-id", cfg.rdzv_id or os.environ.get("SLURM_JOB_ID", "ddpkit")]
    if cfg.node_rank is not None:
        argv += ["--node-rank", str(cfg.node_rank)]
    if cfg.local_addr:
        argv += ["--local-addr", cfg.local_addr]
    if cfg.log_dir:
        argv += ["--log-dir", cfg.log_dir]
    if cfg.all_ranks:
        argv += ["--tee", "3"]
    elif nproc > 1:
        # Local ranks 1.. write to files in the log folder; local rank 0 keeps the terminal itself, so its
        # lines arrive unprefixed and a progress bar still sees a TTY.
        argv += ["--redirects", ",".join(f"{r}:3" for r in range(1, nproc))]
    argv += ["-m", "ddpkit.worker"] + (["-m"] if cfg.module else []) + [cfg.script, *cfg.script_args]
    return argv


def worker_env(cfg: LaunchConfig, nproc: int) -> dict[str, str]:
    """Variables the agent passes to the workers."""
    threads = str(max(1, cpu_count() // nproc))
    env = {
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", threads),
    }
    if cfg.all_ranks:
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank ${rank}] "
    if cfg.max_restarts:
        # With the agent's rendezvous store shared, restarted workers can wait forever on the address of a
        # peer that died; a fresh store per attempt avoids that (3 hangs in 9 restart trials seen without).
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def _describe(rank: int, failure: Any) -> str:
    how = f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
    return f"rank {rank} (local rank {failure.local_rank}, pid {failure.pid}): {how}"


def _recorded(failure: Any) -> tuple[str, list[str]]:
    data = (failure.error_file_data or {}).get("message")
    if not isinstance(data, dict):
        return "", []
    stack = data.get("extraInfo", {}).get("py_callstack", "").rstrip().splitlines()
    # Drop the frames of the launch machinery (torch's @record wrapper, ddpkit.worker, runpy): the user's
    # frames start after the last runpy frame.
    runpy_frames = [i for i, line in enumerate(stack) if "<frozen runpy>" in line]
    if runpy_frames:
        stack = stack[runpy_frames[-1] + 1 :]
    return data.get("message", ""), stack


def summarize_failure(err: BaseException, tail: int = 12) -> str:
    """The failed ranks: the first to fail with its exception and the end of its traceback, then the rest.

    Once one rank fails, its peers fail too (a collective loses its peer, or the agent stops them), so the
    first failure in time is the cause and the others are its consequences.
    """
    failures: dict[int, Any] = getattr(err, "failures", {})
    if not failures:
        return f"ddpkit run: the job failed: {err}"
    first_rank, first = err.get_first_failure()  # type: ignore[attr-defined]
    lines = [f"ddpkit run: {len(failures)} worker(s) failed; first: {_describe(first_rank, first)}"]
    message, stack = _recorded(first)
    if message:
        lines.append(f"  {message}")
        lines += ["  traceback (last lines):"] + [f"    {line}" for line in stack[-tail:]]
    elif first.exitcode < 0:
        lines.append("  no Python exception: the process was killed (out of memory? the scheduler? a signal?)")
    others = [r for r in sorted(failures) if r != first_rank]
    for rank in others:
        message, _ = _recorded(failures[rank])
        lines.append(f"  then {_describe(rank, failures[rank])}" + (f": {message.splitlines()[0]}" if message else ""))
    return "\n".join(lines)


def exit_code(err: BaseException) -> int:
    failures = getattr(err, "failures", {})
    for failure in failures.values():
        if failure.exitcode < 0:
            return 128 - failure.exitcode  # as a shell reports death by signal
        if failure.exitcode:
            return failure.exitcode
    return 1


def launch(cfg: LaunchConfig) -> int:
    """Run ``cfg`` under torchrun's agent; return the process exit code."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    nproc = resolve_nproc(cfg.nproc)
    os.environ.update(worker_env(cfg, nproc))
    args = torchrun.parse_args(torchrun_argv(cfg, nproc))
    try:
        torchrun.run(args)
    except ChildFailedError as err:
        print(summarize_failure(err), file=sys.stderr, flush=True)
        return exit_code(err)
    except SignalException as err:  # Ctrl-C or a scheduler's SIGTERM to the agent: workers were stopped
        print(f"ddpkit run: stopped by {err.sigval.name}; the workers were stopped too", file=sys.stderr)
        return 128 + int(err.sigval)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", default="auto", help="processes per node: auto (default), gpu, or a number")
    parser.add_argument("--nnodes", default="1", help="nodes in the job, or MIN:MAX (default 1)")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's rank (static rendezvous)")
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous, for several nodes")
    parser.add_argument("--rdzv-id", default=None, help="job id shared by all nodes (default: SLURM_JOB_ID)")
    parser.add_argument("--local-addr", default=None, help="address of this node that the others can reach")
    parser.add_argument("--max-restarts", type=int, default=0, help="restarts of all workers after a failure")
    parser.add_argument("--all-ranks", action="store_true", help="show every rank's output, prefixed [rank N]")
    parser.add_argument("--log-dir", default=None, help="folder for each rank's output and error files")
    parser.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    parser.add_argument("script", help="training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def config_from_args(ns: argparse.Namespace) -> LaunchConfig:
    return LaunchConfig(
        script=ns.script,
        script_args=list(ns.script_args),
        module=ns.module,
        nproc=str(ns.nproc),
        nnodes=str(ns.nnodes),
        node_rank=ns.node_rank,
        rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_id=ns.rdzv_id,
        local_addr=ns.local_addr,
        max_restarts=ns.max_restarts,
        all_ranks=ns.all_ranks,
        log_dir=ns.log_dir,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddpkit run", description=__doc__)
    add_arguments(parser)
    return launch(config_from_args(parser.parse_args(argv)))
