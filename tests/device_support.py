"""What the tests that take the device as a parameter share: the parameters, the skips, each
device's environment for a job, and a command run in a session of its own.

The same test body runs with ``"cpu"`` (gloo, in the CPU suite) and ``"cuda"`` (nccl, marked
``gpu``: left out of the default run, run by ``pytest -m gpu`` and ``scripts/gpu_check.sh``, skipped
with the reason where no GPU is visible). Jobs run as fresh processes: the GPU is never touched by
the pytest process itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).parent / "jobs" / "scripts"
DDPKIT = [sys.executable, "-m", "ddpkit.cli"]


def gpu_count() -> int:
    """GPUs visible to torch. NVML answers it, so this process leaves CUDA alone (and may still
    fork)."""
    return torch.cuda.device_count()


GPUS = gpu_count()
NO_CUDA = (
    f"no CUDA device: torch {torch.__version__} (CUDA build: {torch.version.cuda or 'none'}) sees "
    "no GPU; run on a machine with one (scripts/gpu_check.sh)"
)
requires_cuda = pytest.mark.skipif(GPUS < 1, reason=NO_CUDA)
requires_2_gpus = pytest.mark.skipif(
    GPUS < 2,
    reason=f"needs 2 GPUs, {GPUS} visible: nccl refuses two ranks on one GPU" if GPUS else NO_CUDA,
)


CUDA_MARKS = [pytest.mark.gpu, requires_cuda]
"""The marks of a CUDA parameter: in the GPU tier, and skipped, saying why, without a GPU."""


def device_params(cpu_slow: bool = False) -> list:
    """``["cpu", "cuda"]`` as parameters: the CUDA one marked ``gpu`` and skipped without a GPU; the
    CPU one marked ``slow`` with ``cpu_slow`` (an end-to-end job of several seconds)."""
    return [
        pytest.param("cpu", marks=[pytest.mark.slow] if cpu_slow else [], id="cpu"),
        pytest.param("cuda", marks=CUDA_MARKS, id="cuda"),
    ]


def nprocs(device: str) -> int:
    """Ranks of a job: 2 CPU processes, or one per GPU (nccl refuses two ranks on one GPU)."""
    return 2 if device == "cpu" else GPUS


def device_env(base: Mapping[str, str], device: str) -> dict[str, str]:
    """``base`` (the suite's clean environment, where ``CUDA_VISIBLE_DEVICES=""`` hides any GPU) for
    a job on ``device``: on ``cuda`` the GPUs this process sees, and the cuBLAS workspace that
    deterministic algorithms need on CUDA."""
    env = dict(base)
    env["PYTHONUNBUFFERED"] = "1"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        return env
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        env["CUDA_VISIBLE_DEVICES"] = visible
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return env


def run(
    args: Sequence[str],
    env: Mapping[str, str],
    timeout: float,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess:
    """Run ``args`` in a session of its own; past ``timeout`` it and everything it started are
    killed and the test fails with the end of its output."""
    proc = subprocess.Popen(
        list(args),
        env=dict(env),
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
            f"{' '.join(map(str, args))} did not finish within {timeout}s\n--- "
            f"stdout\n{out[-3000:]}\n--- stderr\n{err[-4000:]}"
        ) from None
    return subprocess.CompletedProcess(list(args), proc.returncode, out, err)


def physical_gpu_uuids() -> list[str]:
    """Every GPU of the machine, by index, as nvidia-smi names them (``GPU-...``), whatever is
    visible to us."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"},
    )
    assert out.returncode == 0, out.stderr
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]
