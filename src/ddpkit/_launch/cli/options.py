"""The options and command lines of ``ddpkit run``, ``sbatch`` and ``k8s``, each a table of options
split from its script's arguments and turned into its config (:func:`config_from`)."""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from ddpkit import platforms
from ddpkit._errors import PREEMPTED_EXIT_CODE, ConfigError
from ddpkit.distributed._environment import parse_seconds
from ddpkit.platforms import _kubernetes as kubernetes
from ddpkit.platforms._cpus import cpu_count

MAX_RESTARTS = 100_000
MAX_NODES = 100_000
MAX_RDZV_ID = 128  # torch names folders after the rendezvous id
MAX_NPROC = 1024
"""The most worker processes on one node, whatever else is said."""
OVERSUBSCRIBE_FACTOR = 4
"""More processes per core (or per GPU, if more) need ``--oversubscribe``."""


@dataclass(kw_only=True)
class LaunchConfig:
    """Options of ``ddpkit run``, each mapped onto torchrun's (``ddpkit run -h``)."""

    script: str
    """The training script (or module, with ``module=True``)."""
    script_args: list[str] = field(default_factory=list)
    module: bool = False
    nproc: str = "auto"
    nnodes: str = "1"
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    rdzv_secret_file: str | None = None
    rdzv_conf: list[str] = field(default_factory=list)
    local_addr: str | None = None
    join_timeout: float = 120.0
    node_timeout: float = 30.0
    """Seconds another node's agent may not beat, whatever else says it is there, before its node
    counts as lost (docs/recovery.md)."""
    collective_timeout: float | None = None
    max_restarts: int | None = None
    recover: Literal["restart", "in-place"] = "restart"
    """After a failure: restart every worker, or recover in place (docs/recovery.md)."""
    debug_collectives: bool = False
    all_ranks: bool = False
    log_dir: str = "ddpkit-logs"
    fork_server: Literal["auto", "on", "off"] = "auto"
    preload: list[str] = field(default_factory=list)
    preempted_exit_code: int = PREEMPTED_EXIT_CODE
    stall_timeout: float | None = None
    """None: ``$DDPKIT_STALL_TIMEOUT``, else 30; 0 turns the stall watch off."""
    on_stall: Literal["end", "warn"] = "end"
    oversubscribe: bool = False

    def __post_init__(self) -> None:
        self._check_sizes()  # the seconds: as parsed (config_from_args)
        self._check_names()

    def _check_sizes(self) -> None:
        if self.max_restarts is not None and not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise ConfigError(f"--max-restarts {self.max_restarts}: use 0 to {MAX_RESTARTS}")
        # ASCII digits, and few: int() of thousands of digits raises
        if self.nproc not in ("auto", "gpu") and not (
            re.fullmatch("[0-9]{1,6}", self.nproc) and 0 < int(self.nproc) <= MAX_NPROC
        ):
            raise ConfigError(
                f"--nproc {self.nproc[:40]!r}: use auto, gpu, or a whole number of processes from "
                f"1 to {MAX_NPROC}"
            )
        node_range(self.nnodes)
        if not 1 <= self.preempted_exit_code <= 255:
            raise ConfigError(f"--preempted-exit-code {self.preempted_exit_code}: use 1 to 255")
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

    def _check_names(self) -> None:
        if self.on_stall not in ("end", "warn"):
            raise ConfigError(f"--on-stall {self.on_stall[:40]!r}: use end or warn")
        if self.recover not in ("restart", "in-place"):
            raise ConfigError(f"--recover {self.recover!r}: use restart or in-place")
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
        """The rendezvous is served to other nodes (an endpoint was named): a secret guards it."""
        return bool(self.rdzv_endpoint)

    @property
    def restarts(self) -> int:
        # an elastic job changes size only through restarts
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
    """True for an IPv4 or IPv6 address, or a host name as DNS allows it."""
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


def shown(text: str, limit: int = 80) -> str:
    """``text`` quoted for a one-line message, cut to ``limit`` characters."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def check_script(script: str, hint: str = "") -> None:
    """Refuse a ``script`` that is not a file, naming it, the current folder and ``hint``."""
    try:
        found, problem = Path(script).is_file(), "not found"
    except (OSError, ValueError) as err:  # a name too long for the file system, a NUL byte
        found, problem = False, f"cannot be read ({getattr(err, 'strerror', None) or err})"
    if not found:
        raise ConfigError(
            f"script {shown(script)} {problem} (from {os.getcwd()}): check the path{hint}"
        )


def resolve_nproc(nproc: str, oversubscribe: bool = False) -> int:
    """Processes per node for ``--nproc``: GPUs visible, or on a CPU-only machine one per core up
    to 8. A number above :data:`OVERSUBSCRIBE_FACTOR` per core (or per GPU) is refused unless
    ``oversubscribe``: far more often a typo than a plan."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc == "gpu":
        if not gpus:
            raise ConfigError(
                "--nproc gpu but no GPU is visible: use --nproc auto or a number of CPU processes"
            )
        return gpus
    if nproc == "auto":
        # past ~8 CPU processes gloo's all-reduce costs more than they bring: more threads each
        return gpus or max(1, min(cpu_count(), 8))
    count, room = int(nproc), OVERSUBSCRIBE_FACTOR * max(cpu_count(), gpus)
    if count > room and not oversubscribe:
        raise ConfigError(
            f"--nproc {count}: more than {OVERSUBSCRIBE_FACTOR} processes per "
            f"{'GPU' if gpus > cpu_count() else 'core'} on this node ({room} at most); pass "
            "--oversubscribe if that is what you mean"
        )
    return count


Option = tuple[tuple[str, ...], dict[str, Any]]
"""One argument of a command: its names and ``add_argument``'s keywords."""
C = TypeVar("C")


def argument(*names: str, **kwargs: Any) -> Option:
    return names, kwargs


def command_parser(
    prog: str, usage: str, description: str, epilog: str, options: Sequence[Option]
) -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog, usage, description, epilog, formatter_class=formatter, allow_abbrev=False
    )
    for names, kwargs in options:
        parser.add_argument(*names, **kwargs)
    return parser


def value_options(options: Sequence[Option]) -> set[str]:
    """The names of the options that take a value (``--nproc``, not ``--all-ranks``)."""
    flags = ("store_true", "store_false", "count")
    return {
        name
        for names, kwargs in options
        if kwargs.get("action") not in flags
        for name in names
        if name.startswith("-")
    }


def split_argv(
    argv: Sequence[str], value_options: set[str] | None = None
) -> tuple[list[str], list[str]]:
    """(the command's options and the script, the script's arguments): everything after the script
    is the script's, which argparse alone would read as the command's (``train.py --nproc 4``, or
    ``--log 5``, a prefix of ``--log-dir``). ``value_options``: ``ddpkit run``'s by default."""
    argv = list(argv)
    value_options = RUN_VALUE_OPTIONS if value_options is None else value_options
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


def parse_command(
    parser: argparse.ArgumentParser, options: Sequence[Option], argv: Sequence[str]
) -> tuple[argparse.Namespace, list[str]]:
    """(the command's options parsed, the script's arguments) of ``argv``."""
    ours, script_args = split_argv(argv, value_options(options))
    return parser.parse_args(ours), script_args


def config_from(
    cls: type[C], ns: argparse.Namespace, script_args: Sequence[str], **converted: Any
) -> C:
    """The config ``cls`` of a parsed command line: each field its option's, ``converted`` over."""
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    given = {name: value for name, value in vars(ns).items() if name in fields}
    return cls(**{**given, "script_args": list(script_args), **converted})


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
  ddpkit run --max-restarts 3 --recover in-place train.py  # replace the failed worker alone
  export DDPKIT_RDZV_SECRET=<the same 64 hex digits on every node>
  ddpkit run --nnodes 2 --rdzv-endpoint node1:29400 train.py      # on node1 and on node2
  ddpkit run --nnodes 1:4 --rdzv-endpoint node1:29400 train.py    # elastic: 1 to 4 nodes"""

# seconds are checked by LaunchConfig, not argparse: one line naming the valid range
OPTIONS = [
    argument("--nproc", default="auto",
             help="processes per node: auto (default), gpu, or a number"),
    argument("--nnodes", default="1",
             help="nodes in the job, or MIN:MAX for an elastic job (default 1)"),
    argument("--rdzv-endpoint", default=None, help="HOST:PORT on one node, the same on every node"),
    argument("--node-rank", type=int, default=None,
             help="this node's rank (default: assigned at join)"),
    argument("--rdzv-id", default=None, help="job id shared by all nodes (default: SLURM_JOB_ID)"),
    argument("--rdzv-secret-file", default=None,
             help="file (mode 600) with the secret every node of a multi-node job holds (default: "
             "$DDPKIT_RDZV_SECRET)"),
    argument("--rdzv-conf", action="append", default=None,
             help="extra KEY=VALUE[,KEY=VALUE] for torchrun's c10d rendezvous (repeatable)"),
    argument("--local-addr", default=None,
             help="this node's address (default: the route to the endpoint)"),
    argument("--join-timeout", default="120",
             help="seconds to wait for the rendezvous host and for all nodes (default 120)"),
    argument("--node-timeout", default="30",
             help="seconds another node's agent may not beat before its node counts as lost, "
             "whatever else says it is there (default 30); one whose agent is gone or unreachable "
             "counts as lost in seconds"),
    argument("--collective-timeout", default=None,
             help="seconds a collective may wait before the job ends with every rank's stack "
             "(default 300)"),
    argument("--stall-timeout", default=None,
             help="seconds a rank may make no progress while the others wait for it before the "
             "job ends naming it, with every rank's stack (default 30, or $DDPKIT_STALL_TIMEOUT; "
             "0: off)"),
    argument("--on-stall", default="end",
             help="end (default): kill the stalled rank, so the job ends or restarts; warn: only "
             "say so"),
    argument("--debug-collectives", action="store_true",
             help="check that ranks call the same collectives with the same shapes (slower; for "
             "diagnosis)"),
    argument("--max-restarts", type=int, default=None,
             help="restarts of all workers after a failure (default 0; 3 for an elastic job)"),
    argument("--recover", default="restart",
             help="after a failure, restart every worker (default), or in-place: the others keep "
             "their processes, a failed one is replaced, and every rank resumes from the copies "
             "in memory; across nodes a new node takes a lost one's place (counted in "
             "--max-restarts)"),
    argument("--preempted-exit-code", type=int, default=PREEMPTED_EXIT_CODE,
             help=f"exit code after a stop signal and a snapshot (default {PREEMPTED_EXIT_CODE})"),
    argument("--log-dir", default="ddpkit-logs",
             help="folder for each run's rank output (default ddpkit-logs)"),
    argument("--all-ranks", action="store_true",
             help="show every rank's output, prefixed [rank N]"),
    argument("--fork-server", default="auto",
             help="fork the workers from a process that imported torch once, for fast restarts: "
             "auto (on when the job may restart; the default), on, off"),
    argument("--preload", action="append", default=None,
             help="modules the fork server imports before forking workers, besides torch "
             "(comma-separated, repeatable)"),
    argument("--oversubscribe", action="store_true",
             help=f"allow --nproc above {OVERSUBSCRIBE_FACTOR} processes per core or GPU (at most "
             f"{MAX_NPROC})"),
    argument("-m", "--module", action="store_true", help="run SCRIPT as a module, like python -m"),
    argument("script", help="training script (or module with -m)"),
]  # fmt: skip
RUN_VALUE_OPTIONS = value_options(OPTIONS)


def build_parser() -> argparse.ArgumentParser:
    return command_parser(
        "ddpkit run", "ddpkit run [options] SCRIPT [ARGS...]", DESCRIPTION, EXAMPLES, OPTIONS
    )


def config_from_args(ns: argparse.Namespace, script_args: Sequence[str] = ()) -> LaunchConfig:
    """``ddpkit run``'s :class:`LaunchConfig` of its parsed command line."""
    from ddpkit._launch.watch.stall import parse_floor  # the watch's reading, as of its variable

    def items(values: list[str] | None) -> list[str]:
        return [item for value in values or [] for item in value.split(",") if item]

    return config_from(
        LaunchConfig,
        ns,
        script_args,
        rdzv_conf=items(ns.rdzv_conf),
        preload=items(ns.preload),
        join_timeout=parse_seconds("--join-timeout", ns.join_timeout),
        node_timeout=parse_seconds("--node-timeout", ns.node_timeout),
        collective_timeout=(
            None
            if ns.collective_timeout is None
            else parse_seconds("--collective-timeout", ns.collective_timeout)
        ),
        stall_timeout=(
            None if ns.stall_timeout is None else parse_floor("--stall-timeout", ns.stall_timeout)
        ),
    )


def typed_options(ours: Sequence[str]) -> dict[str, str]:
    """``ddpkit run``'s value options typed in ``ours`` (``--opt value``, ``--opt=value``)."""
    typed, i = {}, 0
    while i < len(ours) - 1:  # the last token is the script
        name, eq, value = ours[i].partition("=")
        if name in RUN_VALUE_OPTIONS:
            typed[name] = value if eq else ours[i + 1]
            i += 0 if eq else 1
        i += 1
    return typed


def with_environment_defaults(
    ours: list[str], env: Mapping[str, str]
) -> tuple[list[str], str | None]:
    """``ours`` with the options a platform set in ``env`` (a Kubernetes operator's ``PET_*``,
    JobSet's ``JOB_COMPLETION_INDEX``) added where the user gave none, and the line that says so
    (None if none). A typed value that disagrees with the operator's is refused, naming both."""
    defaults = platforms.launch_defaults(env)
    if not defaults:
        return ours, None
    added, taken = kubernetes.resolve_options(typed_options(ours), defaults)
    extra = [token for option, value in added.items() for token in (option, value)]
    return ours[:-1] + extra + ours[-1:], kubernetes.summary(taken, env) if taken else None
