"""Shared helpers for the core tests: a launcher-free environment and a way to run ``python -c`` in it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Variables through which a launcher or a scheduler tells a process where it sits in a job. A subprocess that
# must run as "plain python" gets none of them, whatever the shell running pytest exported.
_LAUNCH_VARS = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NSLOTS",
    "SGE_TASK_ID",
    "SGE_ROOT",
    "JOB_ID",
}
_LAUNCH_PREFIXES = ("SLURM_", "TORCHELASTIC_", "PMI_", "PMIX_", "OMPI_")


def _clean_environ() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(_LAUNCH_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SRC), env.get("PYTHONPATH", "")) if p)
    # "No GPU" must hold for the subprocess even when the suite runs on a machine that has one.
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@pytest.fixture
def clean_env() -> dict[str, str]:
    """A copy of ``os.environ`` without any launcher or scheduler variable (safe to modify)."""
    return _clean_environ()


@pytest.fixture(scope="session")
def run_python(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., subprocess.CompletedProcess]:
    """``run_python(code, env=None, extra_env=None, timeout=90)``: run ``python -c code`` as a fresh process.

    ``env`` defaults to the clean environment; ``extra_env`` is added on top. Output is captured as text. Past
    ``timeout`` the process and all its descendants are killed and the test fails.
    """
    cwd = tmp_path_factory.mktemp("subprocess_cwd")

    def run(
        code: str,
        env: Mapping[str, str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        timeout: float = 90,
    ) -> subprocess.CompletedProcess:
        full_env = dict(_clean_environ() if env is None else env)
        full_env.update(extra_env or {})
        args = [sys.executable, "-c", code]
        # A session of its own, so that on timeout the process and everything it started (ranks forked by
        # ddpkit.spawn, loader workers) can be killed together and nothing outlives the test.
        proc = subprocess.Popen(
            args,
            env=full_env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(
                f"python -c ... did not finish within {timeout}s\n--- stdout\n{out}\n--- stderr (end)\n{err[-4000:]}"
            ) from None
        return subprocess.CompletedProcess(args, proc.returncode, out, err)

    return run
