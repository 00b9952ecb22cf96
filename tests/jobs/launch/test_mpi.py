"""An MPI launch (``mpiexec -n N python train.py``, MPICH from pip) is read like SLURM's: one job of
N ranks."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy

PROBE = str(Path(__file__).parents[1] / "scripts" / "launch_probe.py")
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def _probe(env: dict) -> subprocess.CompletedProcess:
    """``mpiexec -n 2`` of the launch probe's ``info`` (mpiexec and mpi4py from this venv)."""
    pytest.importorskip("mpi4py", reason="pip install -e '.[mpi]'")
    env = env | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"}
    return subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, PROBE, "info"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(
    MPIEXEC is None, reason="no mpiexec: pip install -e '.[mpi]' (MPICH and mpi4py)"
)
def test_mpiexec_ranks_form_one_job(clean_env):
    out = _probe(clean_env)
    assert out.returncode == 0, out.stderr[-3000:]
    # Before, each rank ran as a world of one (both "rank=0 world=1").
    assert sorted(re.findall(r"rank=(\d) world=(\d) launcher=(\w+)", out.stdout)) == [
        ("0", "2", "mpi"),
        ("1", "2", "mpi"),
    ], out.stdout
    assert out.stdout.count("sum=3") == 2


@pytest.mark.skipif(
    MPIEXEC is None, reason="no mpiexec: pip install -e '.[mpi]' (MPICH and mpi4py)"
)
def test_a_busy_master_port_stops_every_rank_with_one_line(clean_env):
    with socket.create_server(("", 0)) as busy:  # MASTER_PORT exported without MASTER_ADDR
        out = _probe(clean_env | {"MASTER_PORT": str(busy.getsockname()[1])})
    assert out.returncode != 0
    # rank 0's error reaches rank 1 too, which would else wait for rank 0's address forever
    assert out.stderr.count("export another MASTER_PORT, or none") == 2, out.stderr[-3000:]


SEARCH_JOB = str(Path(__file__).parents[1] / "scripts" / "search_job.py")


@pytest.mark.slow
@pytest.mark.torch_at_least(2, 7, "snapshots of a group of ranks without the job's rank 0")
@pytest.mark.skipif(
    MPIEXEC is None, reason="no mpiexec: pip install -e '.[mpi]' (MPICH and mpi4py)"
)
def test_a_search_launched_with_mpiexec_runs_one_candidate_per_rank(clean_env, tmp_path):
    pytest.importorskip("mpi4py", reason="pip install -e '.[mpi]'")
    optuna = pytest.importorskip("optuna", reason="pip install -e '.[search]'")
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    env = clean_env | {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{clean_env.get('PATH', '')}"
    }
    out = subprocess.run(
        [
            MPIEXEC,
            "-n",
            "2",
            sys.executable,
            SEARCH_JOB,
            str(tmp_path),
            "--trials",
            "3",
            "--epochs",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    study = optuna.load_study(
        study_name="ddpkit",
        storage=JournalStorage(JournalFileBackend(str(tmp_path / "study.journal"))),
    )
    assert [t.state.name for t in study.trials] == ["COMPLETE"] * 3
    # One job of two groups of one rank (two worlds of one would both be group 0), both taking
    # candidates.
    assert "[group 0]" in out.stdout and "[group 1]" in out.stdout, out.stdout[-2000:]
    assert len(list(tmp_path.glob("trial-*"))) == 3
