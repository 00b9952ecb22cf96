"""``ddpkit run``: an argument builder over torchrun's elastic agent (docs/launcher.md)."""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._launch import proctree, say
from ddpkit._launch.agent import agent, failure
from ddpkit._launch.cli import tail
from ddpkit._launch.cli.options import (
    LaunchConfig,
    build_parser,
    check_script,
    config_from_args,
    parse_seconds,
    resolve_nproc,
    shown,
    split_argv,
    with_environment_defaults,
)
from ddpkit._launch.recover import inplace as recover
from ddpkit._launch.rendezvous import NodeAddress, interface_of, node_address, wait_reachable
from ddpkit._launch.watch import stall as watch
from ddpkit.platforms import _slurm as slurm
from ddpkit.platforms import _torchrun as torchrun
from ddpkit.platforms._cpus import cpu_count

LOOPBACK = "127.0.0.1"


def rdzv_id(cfg: LaunchConfig) -> str:
    """``--rdzv-id``, else ``SLURM_JOB_ID`` or ``ddpkit`` across nodes, else this process's own."""
    if cfg.rdzv_id:
        return cfg.rdzv_id
    if cfg.networked:
        job = slurm.job_id(os.environ)
        return "ddpkit" if job is None else job
    return f"ddpkit-{os.getpid()}"


def torchrun_argv(
    cfg: LaunchConfig, nproc: int, run_log_dir: str | None = None, node: NodeAddress | None = None
) -> list[str]:
    """The torchrun command line (without the program name) that carries out ``cfg``, on ddpkit's
    rendezvous (:mod:`ddpkit._launch.rendezvous.backend`): on one node at a free port of 127.0.0.1;
    across nodes at the endpoint, ``node`` being this node's address there."""
    from ddpkit._launch.rendezvous.backend import BACKEND

    argv = ["--nproc-per-node", str(nproc), "--max-restarts", str(cfg.restarts)]
    argv += ["--rdzv-backend", BACKEND, "--rdzv-id", rdzv_id(cfg)]
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
    if cfg.local_addr or node is not None or not cfg.networked:  # the workers' MASTER_ADDR
        argv += ["--local-addr", cfg.local_addr or (node.local_addr if node else LOOPBACK)]
    if run_log_dir:
        argv += ["--log-dir", run_log_dir]
    if cfg.all_ranks:
        argv += ["--tee", "3"]
    worker = ["-m", "ddpkit._launch.agent.worker", *(["-m"] if cfg.module else [])]
    return argv + worker + [cfg.script, *cfg.script_args]


def torchrun_args(
    torchrun: Any, cfg: LaunchConfig, nproc: int, run_dir: Path, node: NodeAddress | None
) -> Any:
    """torchrun's parsed arguments for ``cfg`` (of :func:`torchrun_argv`)."""
    argv = torchrun_argv(cfg, nproc, str(run_dir), node)
    # the script's arguments set after parsing: torchrun would read `--log 5` as its --log-dir
    args = torchrun.parse_args(argv[: len(argv) - len(cfg.script_args)])
    args.training_script_args += list(cfg.script_args)
    if hasattr(args, "signals_to_handle"):  # torchrun's SIGTERM handling would stop the workers
        args.signals_to_handle = agent.TORCHRUN_SIGNALS
    return args


def _run_torchrun(torchrun: Any, args: Any, quiet: range) -> None:
    """``torchrun.run(args)``, with the local ranks ``quiet`` writing to files in the log folder
    (local rank 0 keeps the terminal). The map goes to the logs spec: ``--redirects`` takes
    one-digit ranks only."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import elastic_launch

    config, entrypoint, cmd_args = torchrun.config_from_args(args)
    if len(quiet):
        config.logs_specs = DefaultLogsSpecs(
            log_dir=args.log_dir, redirects=dict.fromkeys(quiet, Std.ALL)
        )
    elastic_launch(config=config, entrypoint=entrypoint)(*cmd_args)


def flight_recorder_vars() -> tuple[str, str]:
    """The variables naming the flight recorder's buffer size and dump file: torch 2.8 renamed them
    (``TORCH_FR_*``) and warns at every process start when the old names are set."""
    from ddpkit._internals.versions import FLIGHT_RECORDER_NAMES, torch_at_least

    if torch_at_least(FLIGHT_RECORDER_NAMES):
        return "TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE"
    return "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"


def worker_env(cfg: LaunchConfig, nproc: int, node: NodeAddress | None = None) -> dict[str, str]:
    """Variables the agent passes to the workers."""
    # the user's OMP_NUM_THREADS wins, and MKL follows it (it reads its own variable first)
    omp = os.environ.get("OMP_NUM_THREADS") or str(max(1, cpu_count() // nproc))
    env = {
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": omp,
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS") or omp,
    }
    # else gloo and nccl take the host name's interface: often unrouted (the first collective hangs)
    if node is not None:
        interface = node.interface
    else:
        interface = None if cfg.networked else interface_of(LOOPBACK)
    if interface:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env[name] = os.environ.get(name, interface)
    if cfg.collective_timeout is not None:
        env["DDPKIT_COLLECTIVE_TIMEOUT"] = str(cfg.collective_timeout)
    if cfg.debug_collectives:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        buffer = flight_recorder_vars()[0]
        env[buffer] = os.environ.get(buffer, "2000")
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    if cfg.all_ranks:
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank ${rank}] "
    # the agent serves a fresh store each round (WorkersStoreHandler): none of a dead peer's address
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def new_run_log_dir(root: str) -> Path:
    """``ROOT/<date>-<time>-<pid>``: one folder per run, created now."""
    path = Path(root).absolute() / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        fs.make_dirs(path)
    except OSError as err:
        raise ConfigError(
            f"cannot create the log folder {path} ({err.strerror}): pass --log-dir DIR"
        ) from None
    return path


def tidy_log_dirs(root: str, run: Path, keep: int = 20) -> None:
    """Remove this run's folder if no rank wrote anything, and all but the newest ``keep``."""
    if run.is_dir() and not any(f.stat().st_size for f in run.rglob("*") if f.is_file()):
        fs.remove_tree(run)
    ours = sorted(
        p
        for p in Path(root).glob("*-*-*")
        if p.is_dir() and re.fullmatch(r"\d{8}-\d{6}-\d+", p.name)
    )
    for old in ours[:-keep]:
        fs.remove_tree(old)
    with contextlib.suppress(OSError):
        fs.remove_empty_dir(Path(root))


_DETAIL_PROBE = """
import os, sys, tempfile, torch, torch.distributed as dist
device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
path = os.path.join(tempfile.mkdtemp(), "store")
backend = "nccl" if device.type == "cuda" else "gloo"
dist.init_process_group(backend, init_method="file://" + path, rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2).to(device))
model(torch.randn(3, 4, device=device)).sum().backward()
dist.destroy_process_group()
"""


def check_debug_collectives() -> None:
    """Refuse ``--debug-collectives`` where its mode crashes DDP, tried first in a process alone on
    the device the ranks take by default (a GPU where one is visible, over nccl)."""
    import subprocess

    from ddpkit.platforms import without_launch_env

    env = without_launch_env(os.environ)
    env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    try:
        done = subprocess.run(
            [sys.executable, "-c", _DETAIL_PROBE], env=env, capture_output=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        code, how = None, "did not finish in 120 s"
    else:
        code = done.returncode
        how = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with {code}"
    if code == 0:
        return
    import torch

    raise ConfigError(
        f"--debug-collectives: with TORCH_DISTRIBUTED_DEBUG=DETAIL, DDP on torch "
        f"{torch.__version__} {how} (a world of one, tried before the job); leave "
        "--debug-collectives out: the stall watch names ranks that wait in different collectives "
        "(op, number and size) without it"
    )


def signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def check_target(cfg: LaunchConfig) -> None:
    """Fail before any worker starts when the script or module does not exist."""
    if cfg.module:
        import importlib.util

        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(cfg.script) is not None
        except (ImportError, ValueError, OSError):  # OSError: a name too long for a file
            found = False
        finally:
            sys.path.pop(0)
        if not found:
            raise ConfigError(
                f"no module named {shown(cfg.script)} (run with -m): check the name and PYTHONPATH"
            )
        return
    module_like = "/" not in cfg.script and not cfg.script.endswith(".py")
    check_script(cfg.script, "; to run a module, pass -m" if module_like else "")


def launch(cfg: LaunchConfig) -> int:
    """Run ``cfg`` under torchrun's agent; return the process exit code."""
    agent.ignore_requests()  # until the agent handles them, and after it (agent.uninstall)
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher import api as launcher_api

    from ddpkit._launch.rendezvous import backend

    check_target(cfg)
    if cfg.debug_collectives:
        check_debug_collectives()
    # $DDPKIT_STALL_TIMEOUT and $DDPKIT_COLLECTIVE_TIMEOUT checked before any start
    stall = watch.policy_from(
        cfg.stall_timeout, cfg.on_stall, collective_timeout=collective_seconds(cfg)
    )
    nproc = resolve_nproc(cfg.nproc, cfg.oversubscribe)
    access, node = job_access(cfg)
    run_id = rdzv_id(cfg)
    run_dir = prepare_workers(cfg, nproc, node)
    in_place = in_place_recovery(cfg, nproc)
    backend.register(run_id, access, in_place)
    proctree.become_subreaper()  # the orphans of the workers' children stay the agent's to end
    args = torchrun_args(torchrun, cfg, nproc, run_dir, node)
    display = [cfg.script, *cfg.script_args]
    agent.install(
        launcher_api, cfg.uses_fork_server, cfg.preload, display, stall, in_place, cfg.node_timeout,
        run_dir,
    )  # fmt: skip
    if cfg.all_ranks:
        tail.install()
    try:
        _run_torchrun(torchrun, args, quiet=range(1, nproc) if not cfg.all_ranks else range(0))
    except ChildFailedError as err:
        return report_failure(cfg, err, run_dir)
    except RendezvousError as err:
        if in_place is not None and in_place.left_job():
            say(f"this node left the job, which goes on without it: {in_place.fallback}")
            return 1
        say(
            f"the nodes did not come together at {cfg.rdzv_endpoint} ({type(err).__name__}: "
            f"{err or 'no detail'}): start the same command on every node within --join-timeout "
            f"({cfg.join_timeout:.0f} s), with the same --nnodes, --rdzv-endpoint and --rdzv-id"
        )
        return 1
    except SignalException as err:  # Ctrl-C, or a scheduler's SIGTERM to the agent
        say(f"stopped by {err.sigval.name}; the workers were stopped too (their output: {run_dir})")
        return 128 + int(err.sigval)
    finally:
        agent.uninstall()
        backend.unregister(run_id)
        proctree.kill_descendants()  # whatever the workers left behind, however the job ended
    tidy_log_dirs(cfg.log_dir, run_dir)
    return 0


def in_place_recovery(cfg: LaunchConfig, nproc: int = 1) -> recover.InPlace | None:
    """The agent's side of ``--recover in-place``, where it applies; else None."""
    if cfg.recover != "in-place":
        return None
    if cfg.restarts < 1:
        raise ConfigError(
            "--recover in-place recovers as many failures as --max-restarts allows: pass "
            "--max-restarts N (N >= 1)"
        )
    return recover.prepare(cfg.join_timeout, nproc, cfg.node_timeout)


def collective_seconds(cfg: LaunchConfig) -> float:
    """The workers' collective timeout: the option's, the variable's (checked once), or init()'s."""
    if cfg.collective_timeout is not None:
        return cfg.collective_timeout
    if "DDPKIT_COLLECTIVE_TIMEOUT" in os.environ:
        return parse_seconds("DDPKIT_COLLECTIVE_TIMEOUT", os.environ["DDPKIT_COLLECTIVE_TIMEOUT"])
    from ddpkit.distributed._runtime import DEFAULT_TIMEOUT  # imports torch: here, not at start

    return DEFAULT_TIMEOUT.total_seconds()


def job_access(cfg: LaunchConfig) -> tuple[Any, NodeAddress | None]:
    """This job's rendezvous access and, across nodes, this node's address, once admitted."""
    from ddpkit._launch.rendezvous.auth import SECRET_ENV, check_host, derive, load_secret
    from ddpkit._launch.rendezvous.backend import JobAccess

    node = None
    if cfg.networked:
        secret = load_secret(cfg.rdzv_secret_file)
        node = node_address(str(cfg.rdzv_endpoint))
        if not node.is_host:
            wait_reachable(node.host_ip, node.port, cfg.join_timeout)
            check_host((node.host_ip, node.port), derive(secret, "relay"))
        access = JobAccess(secret, node.host_ip)
    else:
        access = JobAccess(secrets.token_bytes(32), None)  # known to this process alone
    os.environ.pop(SECRET_ENV, None)  # the workers, and all they start, have no use for it
    return access, node


def prepare_workers(cfg: LaunchConfig, nproc: int, node: NodeAddress | None) -> Path:
    """The run's log folder and the job's folder on this node (:func:`agent.open_job_folder`),
    made now, and the workers' variables set in this process."""
    run_dir = new_run_log_dir(cfg.log_dir)
    agent.open_job_folder(run_dir)
    os.environ.update(worker_env(cfg, nproc, node))
    if cfg.debug_collectives:  # where nccl's flight recorder writes each rank's record on a timeout
        fs.make_dirs(run_dir / "stacks", root=run_dir)
        os.environ.setdefault(
            flight_recorder_vars()[1], str(run_dir / "stacks" / "nccl_trace_rank_")
        )
    return run_dir


def report_failure(cfg: LaunchConfig, err: Any, run_dir: Path) -> int:
    """Say how the job failed (a torchrun ``ChildFailedError``); the code to exit with."""
    if failure.preempted(err.failures):
        say(
            f"stopped by a signal after saving a snapshot (exit code {cfg.preempted_exit_code}); "
            "run the same command again to resume"
        )
        return cfg.preempted_exit_code
    ours = agent.Agent.current
    named = ours.stall if ours is not None else None
    lines = [ours.summary(err) if ours is not None else failure.summarize_failure(err)]
    # the stacks the running workers wrote at the first failure (the stall watch showed its own)
    if named is None:
        lines += agent.stacks(agent.answered_ranks())
    for trace in sorted(run_dir.glob("stacks/nccl_trace_rank_*")):  # --debug-collectives, nccl
        lines.append(f"  nccl flight recorder of rank {trace.name.rsplit('_', 1)[-1]}: {trace}")
    lines.append(f"  output of every rank: {run_dir}")
    for line in lines:
        print(line, file=sys.stderr, flush=True)
    return failure.exit_code(err, stall=named)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ours, script_args = split_argv(sys.argv[1:] if argv is None else argv)
    if ours and not ours[-1].startswith("-"):  # a script named: else argparse says what is missing
        ours, from_env = with_environment_defaults(ours, os.environ)
        if from_env:
            print(from_env, file=sys.stderr, flush=True)
    # torchrun reads any PET_* as an option's default: ddpkit run's options hold what they meant
    for name in torchrun.option_variables(os.environ):
        del os.environ[name]
    return launch(config_from_args(parser.parse_args(ours), script_args))
