"""``ddpkit run``: an argument builder over torchrun's elastic agent (``torch.distributed.run``).

No process management of our own: anything that runs under torchrun runs under ``ddpkit run`` and vice versa.
What it adds are defaults for what users trip over, and one readable summary when a worker fails.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import secrets
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit import agent, proctree
from ddpkit.cluster import cpu_count
from ddpkit.errors import PREEMPTED_EXIT_CODE, ConfigError
from ddpkit.rendezvous import NodeAddress, interface_of, node_address, wait_reachable

LOOPBACK = "127.0.0.1"
MAX_TIMEOUT = 30 * 24 * 3600.0
"""The longest --join-timeout / --collective-timeout, in seconds (30 days): torch keeps timeouts in
milliseconds, and a value beyond its range would overflow instead of meaning "never"."""


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
    """``HOST:PORT`` every node can reach; needed with more than one node. The node owning HOST hosts it."""
    rdzv_id: str | None = None
    rdzv_secret_file: str | None = None
    """A file (readable only by its owner) holding the secret every node of a multi-node job must know; else
    ``$DDPKIT_RDZV_SECRET``. A node without it is not admitted to the rendezvous."""
    rdzv_conf: list[str] = field(default_factory=list)
    """Extra ``KEY=VALUE`` settings for torchrun's c10d rendezvous (``--rdzv-conf``)."""
    local_addr: str | None = None
    """This node's address as the others reach it; worked out from the route to the endpoint when unset."""
    join_timeout: float = 120.0
    """Seconds a node waits for the rendezvous host to answer, and for all nodes to join, before failing."""
    collective_timeout: float | None = None
    """Seconds a collective may wait before it raises (``ddpkit.init``'s default is 5 minutes): the bound on a
    hang, after which the job ends with each rank's stack in the summary."""
    max_restarts: int | None = None
    """How many times the agent restarts all workers after one fails: 0 by default, 3 for an elastic job."""
    debug_collectives: bool = False
    """Have torch check that every rank calls the same collective with the same shapes
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL``: a mismatch raises at once, naming both) and, on nccl, keep a record
    of recent collectives that is written out on a timeout (the flight recorder). Slower; for diagnosis."""
    all_ranks: bool = False
    """Show every rank's output, each line prefixed with ``[rank N]``; by default only local rank 0's."""
    log_dir: str = "ddpkit-logs"
    """Where each run's folder of rank output and error files goes: ``LOG_DIR/<date>-<time>-<pid>/``."""

    def __post_init__(self) -> None:
        if self.max_restarts is not None and self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts}: must be >= 0")
        # ASCII digits only: str.isdigit() also accepts "²", which int() then rejects.
        if self.nproc not in ("auto", "gpu") and not (re.fullmatch("[0-9]+", self.nproc) and int(self.nproc) > 0):
            raise ConfigError(f"--nproc {self.nproc!r}: use auto, gpu, or a whole number of processes >= 1")
        node_range(self.nnodes)
        if self.max_nodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT reachable from every node")
        if self.node_rank is not None and not 0 <= self.node_rank < self.max_nodes:
            raise ConfigError(f"--node-rank {self.node_rank}: use 0 to {self.max_nodes - 1} (--nnodes {self.nnodes})")
        if self.collective_timeout is not None:
            check_seconds("--collective-timeout", self.collective_timeout)
        check_seconds("--join-timeout", self.join_timeout)
        for item in self.rdzv_conf:
            if "=" not in item:
                raise ConfigError(f"--rdzv-conf {item!r}: use KEY=VALUE, for example last_call_timeout=5")

    @property
    def max_nodes(self) -> int:
        return node_range(self.nnodes)[1]

    @property
    def elastic(self) -> bool:
        low, high = node_range(self.nnodes)
        return low != high

    @property
    def networked(self) -> bool:
        """The rendezvous is served to other nodes (an endpoint was named), so a secret guards it."""
        return bool(self.rdzv_endpoint)

    @property
    def restarts(self) -> int:
        # Elastic membership works through restarts: a lost node fails the survivors' collectives, and the
        # agents re-rendezvous and restart the workers at the new size only while restarts are left.
        if self.max_restarts is not None:
            return self.max_restarts
        return 3 if self.elastic else 0


def node_range(nnodes: str) -> tuple[int, int]:
    """(MIN, MAX) nodes of ``--nnodes N`` or ``--nnodes MIN:MAX``."""
    match = re.fullmatch("([0-9]+)(?::([0-9]+))?", nnodes)
    low, high = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if not 1 <= low <= high:
        raise ConfigError(
            f"--nnodes {nnodes!r}: use a number of nodes >= 1, or MIN:MAX with 1 <= MIN <= MAX (for example 1:4)"
        )
    return low, high


_SECONDS = f"use a number of seconds > 0 and at most {MAX_TIMEOUT:.0f} (30 days)"


def check_seconds(option: str, value: float) -> float:
    """``value`` when it is a usable number of seconds for ``option``; else a :class:`ConfigError`."""
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT):
        raise ConfigError(f"{option} {value}: {_SECONDS}")
    return value


def parse_seconds(option: str, text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{option} {text!r}: {_SECONDS}") from None
    return check_seconds(option, value)


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


def rdzv_id(cfg: LaunchConfig) -> str:
    """The rendezvous id: ``--rdzv-id``, else ``SLURM_JOB_ID`` or ``ddpkit`` across nodes (every node must name
    the same), else one of this process alone."""
    if cfg.rdzv_id:
        return cfg.rdzv_id
    if cfg.networked:
        return os.environ.get("SLURM_JOB_ID", "ddpkit")
    return f"ddpkit-{os.getpid()}"


def torchrun_argv(
    cfg: LaunchConfig, nproc: int, run_log_dir: str | None = None, node: NodeAddress | None = None
) -> list[str]:
    """The torchrun command line (without the program name) that carries out ``cfg``.

    ``node`` is what :func:`ddpkit.rendezvous.node_address` worked out for a multi-node job. The rendezvous is
    ddpkit's (:mod:`ddpkit.rendezvous_backend`): on one node its store listens on 127.0.0.1 at a free port
    (two jobs on one machine never collide, no "address already in use"), and the workers' own store and
    gloo's sockets are on 127.0.0.1 as well; across nodes only holders of the job's secret get in.
    """
    from ddpkit.rendezvous_backend import BACKEND

    argv = ["--nproc-per-node", str(nproc), "--max-restarts", str(cfg.restarts), "--rdzv-backend", BACKEND]
    argv += ["--rdzv-id", rdzv_id(cfg)]
    if not cfg.networked:
        argv += ["--nnodes", "1", "--rdzv-endpoint", f"{LOOPBACK}:0"]
        conf = []
    else:
        argv += ["--nnodes", cfg.nnodes, "--rdzv-endpoint", str(cfg.rdzv_endpoint)]
        conf = [f"join_timeout={math.ceil(cfg.join_timeout)}"]
        if node is not None:
            conf.append(f"is_host={int(node.is_host)}")
    if conf + cfg.rdzv_conf:
        argv += ["--rdzv-conf", ",".join(conf + cfg.rdzv_conf)]
    if cfg.node_rank is not None:
        argv += ["--node-rank", str(cfg.node_rank)]
    local_addr = _local_addr(cfg, node)
    if local_addr:
        argv += ["--local-addr", local_addr]
    if run_log_dir:
        argv += ["--log-dir", run_log_dir]
    if cfg.all_ranks:
        argv += ["--tee", "3"]
    elif nproc > 1:
        # Local ranks 1.. write to files in the log folder; local rank 0 keeps the terminal itself, so its
        # lines arrive unprefixed and a progress bar still sees a TTY.
        argv += ["--redirects", ",".join(f"{r}:3" for r in range(1, nproc))]
    argv += ["-m", "ddpkit.worker"] + (["-m"] if cfg.module else []) + [cfg.script, *cfg.script_args]
    return argv


def _flight_recorder_vars() -> tuple[str, str]:
    """The variables naming the flight recorder's buffer size and dump file: torch 2.8 renamed them
    (``TORCH_FR_*``) and warns at every process start when the old names are set."""
    import torch

    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 8):
        return "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"
    return "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def _local_addr(cfg: LaunchConfig, node: NodeAddress | None) -> str | None:
    """This node's address for torchrun, which the workers get as MASTER_ADDR: on one node, loopback."""
    if cfg.local_addr:
        return cfg.local_addr
    if node is not None:
        return node.local_addr
    return None if cfg.networked else LOOPBACK


def _interface(cfg: LaunchConfig, node: NodeAddress | None) -> str | None:
    if node is not None:
        return node.interface
    return None if cfg.networked else interface_of(LOOPBACK)


def worker_env(cfg: LaunchConfig, nproc: int, node: NodeAddress | None = None) -> dict[str, str]:
    """Variables the agent passes to the workers."""
    threads = str(max(1, cpu_count() // nproc))
    env = {
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", threads),
        "DDPKIT_AGENT_PID": str(os.getpid()),
    }
    # gloo and nccl pick their interface from the host name unless told. Across nodes that is often a loopback
    # or an unrouted address, and the first collective hangs; on one node it is an address the network
    # reaches, where gloo's sockets would accept connections for nothing. The user's choice wins.
    interface = _interface(cfg, node)
    if interface:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env[name] = os.environ.get(name, interface)
    if cfg.collective_timeout is not None:
        env["DDPKIT_COLLECTIVE_TIMEOUT"] = str(cfg.collective_timeout)
    if cfg.debug_collectives:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        buffer = _flight_recorder_vars()[0]
        env[buffer] = os.environ.get(buffer, "2000")
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if cfg.all_ranks:
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank ${rank}] "
    # The workers' store is served by global rank 0's worker, bound to MASTER_ADDR (ddpkit.worker), not by the
    # agent on every interface. A fresh store per attempt also keeps restarted workers from waiting forever on
    # the address of a peer that died, and a node joining a running job from hanging both agents (3 hangs in 9
    # restart trials seen with the agent's store shared).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def new_run_log_dir(root: str) -> Path:
    """``ROOT/<date>-<time>-<pid>``: one folder per run, created now."""
    path = Path(root).absolute() / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"cannot create the log folder {path} ({err.strerror}): pass --log-dir DIR") from None
    return path


def tidy_log_dirs(root: str, run: Path, keep: int = 20) -> None:
    """Remove this run's folder when no rank wrote anything, and all but the newest ``keep`` run folders."""
    if run.is_dir() and not any(f.stat().st_size for f in run.rglob("*") if f.is_file()):
        shutil.rmtree(run, ignore_errors=True)
    ours = sorted(p for p in Path(root).glob("*-*-*") if p.is_dir() and re.fullmatch(r"\d{8}-\d{6}-\d+", p.name))
    for old in ours[:-keep] if len(ours) > keep else []:
        shutil.rmtree(old, ignore_errors=True)
    with contextlib.suppress(OSError):
        Path(root).rmdir()  # only if empty


def check_target(cfg: LaunchConfig) -> None:
    """Fail before any worker starts when the script or module does not exist."""
    if cfg.module:
        import importlib.util

        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(cfg.script) is not None
        except (ImportError, ValueError):
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise ConfigError(f"no module named {cfg.script!r} (run with -m): check the name and PYTHONPATH")
    elif not Path(cfg.script).is_file():
        raise ConfigError(
            f"script {cfg.script!r} not found (from {os.getcwd()}): check the path"
            + ("; to run a module, pass -m" if "/" not in cfg.script and not cfg.script.endswith(".py") else "")
        )


def launch(cfg: LaunchConfig) -> int:
    """Run ``cfg`` under torchrun's agent; return the process exit code."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher import api as launcher_api

    from ddpkit import rendezvous_backend
    from ddpkit.rendezvous_auth import SECRET_ENV, check_host, derive, load_secret

    check_target(cfg)
    nproc = resolve_nproc(cfg.nproc)
    node = None
    if cfg.networked:
        secret = load_secret(cfg.rdzv_secret_file)
        node = node_address(cfg.rdzv_endpoint)
        if not node.is_host:
            wait_reachable(node.host_ip, node.port, cfg.join_timeout)
            check_host((node.host_ip, node.port), derive(secret, "relay"))
        access = rendezvous_backend.JobAccess(secret, node.host_ip)
    else:
        access = rendezvous_backend.JobAccess(secrets.token_bytes(32), None)  # known to this process alone
    os.environ.pop(SECRET_ENV, None)  # the workers, and all they start, have no use for it
    run_id = rdzv_id(cfg)
    rendezvous_backend.register(run_id, access)
    # Orphans of the workers' children are re-parented to the agent, which ends them with the workers.
    proctree.become_subreaper()
    run_dir = new_run_log_dir(cfg.log_dir)
    (run_dir / "stacks").mkdir()
    os.environ.update(worker_env(cfg, nproc, node))
    os.environ["DDPKIT_STACK_DIR"] = str(run_dir / "stacks")
    if cfg.debug_collectives:  # where nccl's flight recorder writes each rank's record on a timeout
        os.environ.setdefault(_flight_recorder_vars()[1], str(run_dir / "stacks" / "nccl_trace_rank_"))
    argv = torchrun_argv(cfg, nproc, str(run_dir), node)
    # The script's own arguments are set after parsing: torchrun's parser would take `--log 5` for an
    # abbreviation of its --log-dir, and `--nproc 4` for its own option.
    args = torchrun.parse_args(argv[: len(argv) - len(cfg.script_args)])
    args.training_script_args += list(cfg.script_args)
    if hasattr(args, "signals_to_handle"):  # torchrun's own SIGTERM handling would end the workers itself
        args.signals_to_handle = agent.TORCHRUN_SIGNALS
    agent.install(launcher_api)
    try:
        torchrun.run(args)
    except ChildFailedError as err:
        if agent.preempted(err.failures):
            print(
                f"ddpkit run: stopped by a signal after saving a snapshot (exit code {PREEMPTED_EXIT_CODE}); run "
                "the same command again to resume",
                file=sys.stderr,
                flush=True,
            )
            return PREEMPTED_EXIT_CODE
        print(agent.summarize_failure(err), file=sys.stderr, flush=True)
        # This node's workers still running at the first failure wrote their stacks when the agent asked.
        files = [p for p in (run_dir / "stacks").glob("rank*.txt") if p.stem[4:].isdigit() and p.stat().st_size]
        for line in agent.stacks(run_dir / "stacks", sorted(int(p.stem[4:]) for p in files)):
            print(line, file=sys.stderr, flush=True)
        for trace in sorted((run_dir / "stacks").glob("nccl_trace_rank_*")):  # --debug-collectives on nccl
            print(f"  nccl flight recorder of rank {trace.name.rsplit('_', 1)[-1]}: {trace}", file=sys.stderr,
                  flush=True)
        print(f"  output of every rank: {run_dir}", file=sys.stderr, flush=True)
        return agent.exit_code(err)
    except RendezvousError as err:
        print(
            f"ddpkit run: the nodes did not come together at {cfg.rdzv_endpoint} ({type(err).__name__}: "
            f"{err or 'no detail'}): start the same command on every node within --join-timeout "
            f"({cfg.join_timeout:.0f} s), with the same --nnodes, --rdzv-endpoint and --rdzv-id",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except SignalException as err:  # Ctrl-C or a scheduler's SIGTERM to the agent: workers were stopped
        print(
            f"ddpkit run: stopped by {err.sigval.name}; the workers were stopped too (their output: {run_dir})",
            file=sys.stderr,
        )
        return 128 + int(err.sigval)
    finally:
        agent.uninstall()
        rendezvous_backend.unregister(run_id)
        proctree.kill_descendants()  # whatever the workers started and left behind, however the job ended
    tidy_log_dirs(cfg.log_dir, run_dir)
    return 0


DESCRIPTION = """Start SCRIPT on every process of this node under torchrun's elastic agent.

One process per GPU (or a share of the CPU cores) by default. Each process finds its rank, world size and
device with ddpkit.init(). Local rank 0's output goes to the terminal; the other ranks' output goes to
LOG_DIR/<date>-<time>-<pid>/, whose path is printed when the job fails. Everything after SCRIPT is passed to
the script, including options that look like these.

One node: the rendezvous, the workers' store and gloo listen on 127.0.0.1 only.

Several nodes: run the same command on each, with --nnodes and --rdzv-endpoint naming a host:port on one of
them; that node hosts the rendezvous, and each node's own address and network interface are worked out. Every
node must hold the job's secret (DDPKIT_RDZV_SECRET, or --rdzv-secret-file); the rendezvous admits no other.

Exit code: 0 when every worker finished, 75 when the workers were stopped by a signal (SIGTERM/SIGUSR1) and
saved a snapshot (run the command again to resume), else the first failed worker's code."""

EXAMPLES = """examples:
  ddpkit run --nproc 2 train.py --lr 0.1
  ddpkit run --max-restarts 3 train.py                  # restart all workers after a failure
  export DDPKIT_RDZV_SECRET=<the same 64 hex digits on every node>
  ddpkit run --nnodes 2 --rdzv-endpoint node1:29400 train.py      # on node1 and on node2
  ddpkit run --nnodes 1:4 --rdzv-endpoint node1:29400 train.py    # elastic: 1 to 4 nodes"""


# Options of ``ddpkit run`` that take a value: what follows them is not the script.
_VALUE_OPTIONS: set[str] = set()


def _option(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> None:
    parser.add_argument(*names, **kwargs)
    if kwargs.get("action") not in ("store_true", "store_false", "count"):
        _VALUE_OPTIONS.update(names)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _option(parser, "--nproc", default="auto", help="processes per node: auto (default), gpu, or a number")
    _option(parser, "--nnodes", default="1", help="nodes in the job, or MIN:MAX for an elastic job (default 1)")
    _option(parser, "--rdzv-endpoint", default=None, help="HOST:PORT on one node, the same on every node")
    _option(parser, "--node-rank", type=int, default=None, help="this node's rank (default: assigned at join)")
    _option(parser, "--rdzv-id", default=None, help="job id shared by all nodes (default: SLURM_JOB_ID)")
    _option(parser, "--rdzv-secret-file", default=None,
            help="file (mode 600) with the secret every node of a multi-node job holds (default: $DDPKIT_RDZV_SECRET)")
    _option(parser, "--rdzv-conf", action="append", default=None,
            help="extra KEY=VALUE[,KEY=VALUE] for torchrun's c10d rendezvous (repeatable)")
    _option(parser, "--local-addr", default=None, help="this node's address (default: the route to the endpoint)")
    # Seconds are checked by LaunchConfig, not argparse: one line naming the valid range for inf, nan, 1e30 or x.
    _option(parser, "--join-timeout", default="120",
            help="seconds to wait for the rendezvous host and for all nodes (default 120)")
    _option(parser, "--collective-timeout", default=None,
            help="seconds a collective may wait before the job ends with every rank's stack (default 300)")
    _option(parser, "--debug-collectives", action="store_true",
            help="check that ranks call the same collectives with the same shapes (slower; for diagnosis)")
    _option(parser, "--max-restarts", type=int, default=None,
            help="restarts of all workers after a failure (default 0; 3 for an elastic job)")
    _option(parser, "--log-dir", default="ddpkit-logs", help="folder for each run's rank output (default ddpkit-logs)")
    _option(parser, "--all-ranks", action="store_true", help="show every rank's output, prefixed [rank N]")
    _option(parser, "-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m")
    parser.add_argument("script", help="training script (or module with -m)")


def split_argv(argv: Sequence[str], value_options: set[str] | None = None) -> tuple[list[str], list[str]]:
    """(launcher options and the script, the script's arguments): everything after the script is the script's.

    argparse alone would read ``train.py --nproc 4`` or ``train.py --log 5`` (a prefix of ``--log-dir``) as
    the launcher's own options.
    """
    argv = list(argv)
    value_options = _VALUE_OPTIONS if value_options is None else value_options
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i] + argv[i + 1 : i + 2], argv[i + 2 :]
        if not token.startswith("-") or token == "-":
            return argv[: i + 1], argv[i + 1 :]
        if token in value_options:  # "--opt value"; "--opt=value" is one token
            i += 1
        i += 1
    return argv, []


def config_from_args(ns: argparse.Namespace, script_args: Sequence[str] = ()) -> LaunchConfig:
    conf = [item for value in ns.rdzv_conf or [] for item in value.split(",") if item]
    return LaunchConfig(
        script=ns.script,
        script_args=list(script_args),
        module=ns.module,
        nproc=str(ns.nproc),
        nnodes=str(ns.nnodes),
        node_rank=ns.node_rank,
        rdzv_endpoint=ns.rdzv_endpoint,
        rdzv_id=ns.rdzv_id,
        rdzv_secret_file=ns.rdzv_secret_file,
        rdzv_conf=conf,
        local_addr=ns.local_addr,
        join_timeout=parse_seconds("--join-timeout", ns.join_timeout),
        collective_timeout=parse_seconds("--collective-timeout", ns.collective_timeout),
        debug_collectives=ns.debug_collectives,
        max_restarts=ns.max_restarts,
        all_ranks=ns.all_ranks,
        log_dir=ns.log_dir,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpkit run",
        usage="ddpkit run [options] SCRIPT [ARGS...]",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ours, script_args = split_argv(sys.argv[1:] if argv is None else argv)
    return launch(config_from_args(parser.parse_args(ours), script_args))
