"""``ddpkit run``'s options: :class:`LaunchConfig`, the checks of each value, and the command line
that builds it."""

from __future__ import annotations

import argparse
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ddpkit._errors import PREEMPTED_EXIT_CODE, ConfigError
from ddpkit.distributed._environment import check_seconds, parse_seconds
from ddpkit.platforms._cpus import cpu_count

MAX_RESTARTS = 100_000
"""The most --max-restarts: a job failing that often is not going to succeed."""
MAX_NODES = 100_000
MAX_RDZV_ID = 128
"""torch names temporary folders after the rendezvous id; a file name holds at most 255 bytes."""

MAX_NPROC = 1024
"""The most worker processes on one node, whatever else is said: each is an interpreter with torch
loaded."""
OVERSUBSCRIBE_FACTOR = 4
"""More processes than this many per core (or per GPU, where there are more GPUs) need
``--oversubscribe``."""

# options of `ddpkit run` that take a value, filled by add_arguments
_VALUE_OPTIONS: set[str] = set()


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
    """``HOST:PORT`` every node can reach; needed with more than one node. The node owning HOST
    hosts it."""
    rdzv_id: str | None = None
    rdzv_secret_file: str | None = None
    """A file (readable only by its owner) holding the secret every node of a multi-node job must
    know; else ``$DDPKIT_RDZV_SECRET``. A node without it is not admitted to the rendezvous."""
    rdzv_conf: list[str] = field(default_factory=list)
    """Extra ``KEY=VALUE`` settings for torchrun's c10d rendezvous (``--rdzv-conf``)."""
    local_addr: str | None = None
    """This node's address as the others reach it; worked out from the route to the endpoint when
    unset."""
    join_timeout: float = 120.0
    """Seconds a node waits for the rendezvous host to answer, and for all nodes to join, before
    failing."""
    collective_timeout: float | None = None
    """Seconds a collective may wait before it raises (``ddpkit.init``'s default is 5 minutes): the
    bound on a hang, after which the job ends with each rank's stack in the summary."""
    max_restarts: int | None = None
    """How many times the agent restarts all workers after one fails: 0 by default, 3 for an elastic
    job."""
    debug_collectives: bool = False
    """Have torch check that every rank calls the same collective with the same shapes
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL``: a mismatch raises at once, naming both) and, on nccl, keep
    a record of recent collectives that is written out on a timeout (the flight recorder). Slower;
    for diagnosis."""
    all_ranks: bool = False
    """Show every rank's output, each line prefixed with ``[rank N]``; by default only local rank
    0's."""
    log_dir: str = "ddpkit-logs"
    """Where each run's folder of rank output and error files goes:
    ``LOG_DIR/<date>-<time>-<pid>/``."""
    fork_server: Literal["auto", "on", "off"] = "auto"
    """``on``: fork the workers from a process that imported torch once for the job
    (:mod:`ddpkit._launch.forkserver`), so that a restart after a failure skips the interpreter's
    start and torch's import; ``off``: every worker is a new interpreter, as under torchrun;
    ``auto`` (the default): on when the job may restart its workers (``--max-restarts`` above 0, or
    an elastic job)."""
    preload: list[str] = field(default_factory=list)
    """Modules the fork server imports besides torch and ddpkit (a script's own heavy imports)."""
    preempted_exit_code: int = PREEMPTED_EXIT_CODE
    """The launcher's exit code when the workers were stopped by a signal after saving a snapshot. A
    PyTorchJob's ``ExitCode`` restart policy recreates a pod only for codes from 128 (``ddpkit k8s``
    passes 143, SIGTERM's)."""
    stall_timeout: float | None = None
    """Seconds a rank may make no progress while the others wait for it before the agent names it
    (at least 10 times its median step; its first step and a snapshot get 10 times this):
    ``$DDPKIT_STALL_TIMEOUT``, else
    30. 0 turns the watch off (:mod:`ddpkit._launch.watch`)."""
    on_stall: Literal["end", "warn"] = "end"
    """``end``: the stalled rank is killed and the job ends, or restarts under ``max_restarts``;
    ``warn``: only said."""
    oversubscribe: bool = False
    """Allow ``nproc`` above :data:`OVERSUBSCRIBE_FACTOR` processes per core or GPU (never above
    :data:`MAX_NPROC`)."""

    def __post_init__(self) -> None:
        if self.max_restarts is not None and not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise ConfigError(f"--max-restarts {self.max_restarts}: use 0 to {MAX_RESTARTS}")
        # ASCII digits only: str.isdigit() also accepts "²", which int() then rejects. The length
        # first: int() of thousands of digits raises, and a huge count would be built into
        # torchrun's per-rank arguments (gigabytes of "--redirects") before anything else looked at
        # it.
        if self.nproc not in ("auto", "gpu") and not (
            re.fullmatch("[0-9]{1,6}", self.nproc) and 0 < int(self.nproc) <= MAX_NPROC
        ):
            raise ConfigError(
                f"--nproc {self.nproc[:40]!r}: use auto, gpu, or a whole number of processes from "
                f"1 to {MAX_NPROC}"
            )
        node_range(self.nnodes)
        if self.max_nodes > 1 and not self.rdzv_endpoint:
            raise ConfigError(
                f"--nnodes {self.nnodes} needs --rdzv-endpoint HOST:PORT reachable from every node"
            )
        if self.node_rank is not None and not 0 <= self.node_rank < self.max_nodes:
            raise ConfigError(
                f"--node-rank {self.node_rank}: use 0 to {self.max_nodes - 1} (--nnodes "
                f"{self.nnodes})"
            )
        if self.local_addr is not None and not _is_host(self.local_addr):
            raise ConfigError(
                f"--local-addr {self.local_addr[:80]!r}: give this node's IP address or host name "
                "as the other nodes reach it"
            )
        if self.collective_timeout is not None:
            check_seconds("--collective-timeout", self.collective_timeout)
        check_seconds("--join-timeout", self.join_timeout)
        if not 1 <= self.preempted_exit_code <= 255:
            raise ConfigError(f"--preempted-exit-code {self.preempted_exit_code}: use 1 to 255")
        if self.stall_timeout is not None and self.stall_timeout != 0:
            try:
                check_seconds("--stall-timeout", self.stall_timeout)
            except ConfigError as err:
                raise ConfigError(f"{err}; or 0 to turn the stall watch off") from None
        if self.on_stall not in ("end", "warn"):
            raise ConfigError(f"--on-stall {self.on_stall[:40]!r}: use end or warn")
        if self.fork_server not in ("auto", "on", "off"):
            raise ConfigError(f"--fork-server {self.fork_server!r}: use auto, on or off")
        for name in self.preload:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", name):
                raise ConfigError(
                    f"--preload {name!r}: use module names separated by commas (for example "
                    "numpy,pandas)"
                )
        for item in self.rdzv_conf:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=[^=,]+", item):
                raise ConfigError(
                    f"--rdzv-conf {item[:80]!r}: use KEY=VALUE, for example last_call_timeout=5"
                )
        if self.rdzv_id is not None and not re.fullmatch(
            f"[A-Za-z0-9_.:-]{{1,{MAX_RDZV_ID}}}", self.rdzv_id
        ):
            raise ConfigError(
                f"--rdzv-id {self.rdzv_id[:40]!r}: use 1 to {MAX_RDZV_ID} letters, digits, '_', "
                "'.', ':' or '-', the same on every node"
            )

    @property
    def uses_fork_server(self) -> bool:
        return self.fork_server == "on" or (self.fork_server == "auto" and self.restarts > 0)

    @property
    def max_nodes(self) -> int:
        return node_range(self.nnodes)[1]

    @property
    def elastic(self) -> bool:
        low, high = node_range(self.nnodes)
        return low != high

    @property
    def networked(self) -> bool:
        """The rendezvous is served to other nodes (an endpoint was named), so a secret guards
        it."""
        return bool(self.rdzv_endpoint)

    @property
    def restarts(self) -> int:
        # Elastic membership works through restarts: a lost node fails the survivors' collectives,
        # and the agents re-rendezvous and restart the workers at the new size only while restarts
        # are left.
        if self.max_restarts is not None:
            return self.max_restarts
        return 3 if self.elastic else 0


def node_range(nnodes: str) -> tuple[int, int]:
    """(MIN, MAX) nodes of ``--nnodes N`` or ``--nnodes MIN:MAX``."""
    match = re.fullmatch("([0-9]{1,7})(?::([0-9]{1,7}))?", nnodes)
    low, high = (int(match[1]), int(match[2] or match[1])) if match else (0, 0)
    if not 1 <= low <= high <= MAX_NODES:
        raise ConfigError(
            f"--nnodes {nnodes[:40]!r}: use a number of nodes >= 1, or MIN:MAX with 1 <= MIN <= "
            f"MAX (for example 1:4), at most {MAX_NODES}"
        )
    return low, high


def _is_host(text: str) -> bool:
    """True for an IPv4 or IPv6 address, or a host name as DNS allows it (letters, digits, hyphens;
    not all digits at the end)."""
    try:
        ipaddress.ip_address(text.strip("[]"))
        return True
    except ValueError:
        pass
    labels = text.rstrip(".").split(".")
    return (
        len(text) <= 253
        and all(
            re.fullmatch(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?", label)
            for label in labels
        )
        and not labels[-1].isdigit()
    )


def resolve_nproc(nproc: str, oversubscribe: bool = False) -> int:
    """Processes per node for ``--nproc``: GPUs visible, or on a CPU-only machine one per core up
    to 8.

    A number above :data:`OVERSUBSCRIBE_FACTOR` per core (or per GPU) is refused unless
    ``oversubscribe``: it is far more often a typo than a plan, and each process is an interpreter
    with torch loaded.
    """
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc == "gpu":
        if not gpus:
            raise ConfigError(
                "--nproc gpu but no GPU is visible: use --nproc auto or a number of CPU processes"
            )
        return gpus
    if nproc == "auto":
        # On CPUs every process runs its own intra-op thread pool; past ~8 processes gloo's
        # all-reduce costs more than the extra processes bring, so larger machines get more threads
        # per process instead.
        return gpus or max(1, min(cpu_count(), 8))
    count, room = int(nproc), OVERSUBSCRIBE_FACTOR * max(cpu_count(), gpus)
    if count > room and not oversubscribe:
        raise ConfigError(
            f"--nproc {count}: more than {OVERSUBSCRIBE_FACTOR} processes per "
            f"{'GPU' if gpus > cpu_count() else 'core'} on this node ({room} at most); pass "
            "--oversubscribe if that is what you mean"
        )
    return count


DESCRIPTION = """Start SCRIPT on every process of this node under torchrun's elastic agent.

One process per GPU (or a share of the CPU cores) by default. Each process finds its rank, world
size and device with ddpkit.init(). Local rank 0's output goes to the terminal; the other ranks'
output goes to LOG_DIR/<date>-<time>-<pid>/, whose path is printed when the job fails. Everything
after SCRIPT is passed to the script, including options that look like these.

One node: the rendezvous, the workers' store and gloo listen on 127.0.0.1 only.

Several nodes: run the same command on each, with --nnodes and --rdzv-endpoint naming a host:port on
one of them; that node hosts the rendezvous, and each node's own address and network interface are
worked out. Every node must hold the job's secret (DDPKIT_RDZV_SECRET, or --rdzv-secret-file); the
rendezvous admits no other.

Exit code: 0 when every worker finished, 75 when the workers were stopped by a signal
(SIGTERM/SIGUSR1) and saved a snapshot (run the command again to resume), else the first failed
worker's code."""


EXAMPLES = """examples:
  ddpkit run --nproc 2 train.py --lr 0.1
  ddpkit run --max-restarts 3 train.py                  # restart all workers after a failure
  export DDPKIT_RDZV_SECRET=<the same 64 hex digits on every node>
  ddpkit run --nnodes 2 --rdzv-endpoint node1:29400 train.py      # on node1 and on node2
  ddpkit run --nnodes 1:4 --rdzv-endpoint node1:29400 train.py    # elastic: 1 to 4 nodes"""


def _option(parser: argparse.ArgumentParser, *names: str, **kwargs: Any) -> None:
    parser.add_argument(*names, **kwargs)
    if kwargs.get("action") not in ("store_true", "store_false", "count"):
        _VALUE_OPTIONS.update(names)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _option(
        parser,
        "--nproc",
        default="auto",
        help="processes per node: auto (default), gpu, or a number",
    )
    _option(
        parser,
        "--nnodes",
        default="1",
        help="nodes in the job, or MIN:MAX for an elastic job (default 1)",
    )
    _option(
        parser,
        "--rdzv-endpoint",
        default=None,
        help="HOST:PORT on one node, the same on every node",
    )
    _option(
        parser,
        "--node-rank",
        type=int,
        default=None,
        help="this node's rank (default: assigned at join)",
    )
    _option(
        parser, "--rdzv-id", default=None, help="job id shared by all nodes (default: SLURM_JOB_ID)"
    )
    _option(
        parser,
        "--rdzv-secret-file",
        default=None,
        help="file (mode 600) with the secret every node of a multi-node job holds (default: "
        "$DDPKIT_RDZV_SECRET)",
    )
    _option(
        parser,
        "--rdzv-conf",
        action="append",
        default=None,
        help="extra KEY=VALUE[,KEY=VALUE] for torchrun's c10d rendezvous (repeatable)",
    )
    _option(
        parser,
        "--local-addr",
        default=None,
        help="this node's address (default: the route to the endpoint)",
    )
    # Seconds are checked by LaunchConfig, not argparse: one line naming the valid range for inf,
    # nan, 1e30 or x.
    _option(
        parser,
        "--join-timeout",
        default="120",
        help="seconds to wait for the rendezvous host and for all nodes (default 120)",
    )
    _option(
        parser,
        "--collective-timeout",
        default=None,
        help="seconds a collective may wait before the job ends with every rank's stack (default "
        "300)",
    )
    _option(
        parser,
        "--stall-timeout",
        default=None,
        help="seconds a rank may make no progress while the others wait for it before the job ends "
        "naming it, with every rank's stack (default 30, or $DDPKIT_STALL_TIMEOUT; 0: off)",
    )
    _option(
        parser,
        "--on-stall",
        default="end",
        help="end (default): kill the stalled rank, so the job ends or restarts; warn: only say so",
    )
    _option(
        parser,
        "--debug-collectives",
        action="store_true",
        help="check that ranks call the same collectives with the same shapes (slower; for "
        "diagnosis)",
    )
    _option(
        parser,
        "--max-restarts",
        type=int,
        default=None,
        help="restarts of all workers after a failure (default 0; 3 for an elastic job)",
    )
    _option(
        parser,
        "--preempted-exit-code",
        type=int,
        default=PREEMPTED_EXIT_CODE,
        help=f"exit code after a stop signal and a snapshot (default {PREEMPTED_EXIT_CODE})",
    )
    _option(
        parser,
        "--log-dir",
        default="ddpkit-logs",
        help="folder for each run's rank output (default ddpkit-logs)",
    )
    _option(
        parser,
        "--all-ranks",
        action="store_true",
        help="show every rank's output, prefixed [rank N]",
    )
    _option(
        parser,
        "--fork-server",
        default="auto",
        help="fork the workers from a process that imported torch once, for fast restarts: auto "
        "(on when the job may restart; the default), on, off",
    )
    _option(
        parser,
        "--preload",
        action="append",
        default=None,
        help="modules the fork server imports before forking workers, besides torch "
        "(comma-separated, repeatable)",
    )
    _option(
        parser,
        "--oversubscribe",
        action="store_true",
        help=f"allow --nproc above {OVERSUBSCRIBE_FACTOR} processes per core or GPU (at most "
        f"{MAX_NPROC})",
    )
    _option(
        parser, "-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m"
    )
    parser.add_argument("script", help="training script (or module with -m)")


def value_options() -> set[str]:
    """The options of ``ddpkit run`` that take a value (``--nproc``, not ``--all-ranks``)."""
    if not _VALUE_OPTIONS:  # filled as the parser is built
        build_parser()
    return _VALUE_OPTIONS


def split_argv(
    argv: Sequence[str], value_options: set[str] | None = None
) -> tuple[list[str], list[str]]:
    """(launcher options and the script, the script's arguments): everything after the script is the
    script's.

    argparse alone would read ``train.py --nproc 4`` or ``train.py --log 5`` (a prefix of
    ``--log-dir``) as the launcher's own options.
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
        collective_timeout=(
            None
            if ns.collective_timeout is None
            else parse_seconds("--collective-timeout", ns.collective_timeout)
        ),
        debug_collectives=ns.debug_collectives,
        stall_timeout=None if ns.stall_timeout is None else _stall_seconds(ns.stall_timeout),
        on_stall=ns.on_stall,
        max_restarts=ns.max_restarts,
        all_ranks=ns.all_ranks,
        log_dir=ns.log_dir,
        fork_server=ns.fork_server,
        preload=[name for value in ns.preload or [] for name in value.split(",") if name],
        oversubscribe=ns.oversubscribe,
        preempted_exit_code=ns.preempted_exit_code,
    )


def _stall_seconds(text: str) -> float:
    # the watch's own reading of a floor, as of its variable
    from ddpkit._launch.watch import parse_floor

    return parse_floor("--stall-timeout", text)


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
