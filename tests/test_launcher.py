"""``ddpkit run``: the torchrun command it builds, and real jobs end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.errors import ConfigError
from ddpkit.launcher import LaunchConfig, resolve_nproc, torchrun_argv, worker_env

HELLO = str(Path(__file__).parent / "scripts" / "hello.py")
DDPKIT = [sys.executable, "-m", "ddpkit.cli"]


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


@pytest.fixture
def clean_env() -> dict[str, str]:
    """This environment without any launcher's variables, as a user's shell would have it."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(("TORCHELASTIC", "SLURM"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(args: list[str], env: dict[str, str], timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(DDPKIT + args, env=env, capture_output=True, text=True, timeout=timeout)


# -- the command line it builds (pure logic) --------------------------------------------------------------


def test_single_node_uses_a_free_port_and_shows_rank_zero_only():
    argv = torchrun_argv(LaunchConfig(script="train.py", script_args=["--lr", "1"]), nproc=3)
    assert "--standalone" in argv  # c10d rendezvous on localhost:0
    assert argv[argv.index("--redirects") + 1] == "1:3,2:3"  # local ranks 1, 2 to files; 0 keeps the terminal
    assert argv[-5:] == ["-m", "ddpkit.worker", "train.py", "--lr", "1"]


def test_all_ranks_tees_with_a_rank_prefix():
    cfg = LaunchConfig(script="t.py", all_ranks=True)
    argv = torchrun_argv(cfg, nproc=2)
    assert argv[argv.index("--tee") + 1] == "3" and "--redirects" not in argv
    assert worker_env(cfg, 2)["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] == "[rank ${rank}] "


def test_multi_node_flags_pass_through():
    cfg = LaunchConfig(
        script="t.py", nnodes="2", rdzv_endpoint="node1:29400", rdzv_id="job7", node_rank=1, local_addr="10.0.0.2"
    )
    argv = torchrun_argv(cfg, nproc=4)
    assert "--standalone" not in argv
    for flag, value in [
        ("--nnodes", "2"),
        ("--rdzv-endpoint", "node1:29400"),
        ("--rdzv-id", "job7"),
        ("--rdzv-backend", "c10d"),
        ("--node-rank", "1"),
        ("--local-addr", "10.0.0.2"),
    ]:
        assert argv[argv.index(flag) + 1] == value


def test_module_mode_and_restarts():
    cfg = LaunchConfig(script="pkg.train", module=True, max_restarts=3)
    argv = torchrun_argv(cfg, nproc=1)
    assert argv[argv.index("--max-restarts") + 1] == "3"
    assert argv[-4:] == ["-m", "ddpkit.worker", "-m", "pkg.train"]
    assert worker_env(cfg, 1)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in worker_env(LaunchConfig(script="t.py"), 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nproc": "zero"}, "--nproc"),
        ({"nproc": "0"}, "--nproc"),
        ({"max_restarts": -1}, "--max-restarts"),
        ({"nnodes": "2"}, "--rdzv-endpoint"),
        ({"nnodes": "x", "rdzv_endpoint": "h:1"}, "--nnodes"),
    ],
)
def test_bad_options_name_the_flag(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LaunchConfig(script="t.py", **kwargs)


def test_nproc_resolution_on_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("NSLOTS", "32")
    assert resolve_nproc("auto") == 8
    monkeypatch.setenv("NSLOTS", "3")
    assert resolve_nproc("auto") == 3
    assert resolve_nproc("5") == 5
    with pytest.raises(ConfigError, match="no GPU"):
        resolve_nproc("gpu")


def test_threads_per_worker_split_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("NSLOTS", "16")
    assert worker_env(LaunchConfig(script="t.py"), 4)["OMP_NUM_THREADS"] == "4"
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's choice wins
    assert worker_env(LaunchConfig(script="t.py"), 4)["OMP_NUM_THREADS"] == "2"


# -- real jobs -------------------------------------------------------------------------------------------


def test_rank_zero_output_by_default(clean_env):
    out = run(["run", "--nproc", "2", HELLO, "a", "b"], clean_env)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if line.startswith("hello")]
    assert lines == ["hello rank=0 world=2 attempt=0 sum=3 threads=1 words=['a', 'b']"]


def test_all_ranks_output_is_prefixed(clean_env):
    out = run(["run", "--nproc", "3", "--all-ranks", HELLO], clean_env)
    assert out.returncode == 0, out.stderr
    for r in range(3):
        assert f"[rank {r}] hello rank={r} world=3" in out.stdout


def test_failure_summary_names_rank_exception_and_line(clean_env):
    out = run(["run", "--nproc", "2", HELLO, "--fail-rank", "1"], clean_env)
    assert out.returncode == 1
    summary = out.stderr[out.stderr.index("ddpkit run:") :]
    assert "first: rank 1 (local rank 1" in summary
    assert "ValueError: planned failure on rank 1" in summary
    assert 'hello.py", line' in summary  # the user's frame, not only the launcher's


def test_restart_after_failure_resumes_the_job(clean_env):
    out = run(["run", "--nproc", "2", "--max-restarts", "1", HELLO, "--fail-first-attempt"], clean_env)
    assert out.returncode == 0, out.stderr
    assert "hello rank=0 world=2 attempt=0" in out.stdout
    assert "hello rank=0 world=2 attempt=1" in out.stdout
    # control: without restarts the same job fails
    out = run(["run", "--nproc", "2", HELLO, "--fail-first-attempt"], clean_env)
    assert out.returncode != 0 and "planned failure on the first attempt" in out.stderr


def test_two_jobs_at_once_on_one_machine(clean_env):
    jobs = [
        subprocess.Popen(
            DDPKIT + ["run", "--nproc", "2", HELLO, f"job{i}"],
            env=clean_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for i, job in enumerate(jobs):
        stdout, stderr = job.communicate(timeout=90)
        assert job.returncode == 0, stderr
        assert f"words=['job{i}']" in stdout


def test_bad_flag_is_a_clear_error_not_a_stack(clean_env):
    out = run(["run", "--nproc", "gpu", HELLO], clean_env)
    assert out.returncode == 2
    assert "--nproc gpu but no GPU is visible" in out.stderr and "Traceback" not in out.stderr


def test_env_command_reports_and_checks(clean_env):
    out = run(["env"], clean_env)
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "gloo available" in out.stdout
    assert "live check (2 processes, gloo all-reduce)  ok" in out.stdout
