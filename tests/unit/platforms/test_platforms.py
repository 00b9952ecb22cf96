"""The platforms behind one interface, asked in the documented order (their readings:
test_cluster.py, test_kubernetes.py, test_pet_values.py, test_ray_env.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddpkit import platforms
from ddpkit.platforms import _kubernetes as kubernetes
from ddpkit.platforms import _mpi as mpi
from ddpkit.platforms import _ray as ray
from ddpkit.platforms import _slurm as slurm
from ddpkit.platforms import _torchrun as torchrun
from ddpkit.platforms import none
from ddpkit.platforms._base import Platform

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "h",
    "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_ID": "7",
    "SLURM_JOB_NODELIST": "n1",
}
MPICH = {"PMI_RANK": "3", "PMI_SIZE": "4"}
POD = {
    "KUBERNETES_SERVICE_HOST": "10.96.0.1",
    "RANK": "1",
    "WORLD_SIZE": "2",
    "MASTER_ADDR": "m",
    "MASTER_PORT": "1",
}
RAY = TORCHRUN | {"RAY_RAYLET_PID": "2912"}

# Each platform's own environment, and those that also carry another platform's variables.
CASES = [
    ({}, none),
    (TORCHRUN, torchrun),
    (SLURM, slurm),
    (MPICH, mpi),
    (POD, kubernetes),
    (RAY, ray),
    (TORCHRUN | SLURM, torchrun),  # srun ddpkit run: torchrun's ranks
    (MPICH | SLURM, mpi),  # mpiexec in a SLURM job: one srun task per node
    (RAY | {"TORCHELASTIC_RUN_ID": "x"}, torchrun),  # torchrun started inside a Ray task
]


def test_the_order_is_as_documented():
    assert [platform.NAME for platform in platforms.PLATFORMS] == [
        "pytorchjob",
        "ray",
        "torchrun",
        "mpi",
        "slurm",
        "none",
    ]


def test_every_platform_module_has_the_interface():
    for platform in platforms.PLATFORMS:
        assert isinstance(platform, Platform), platform.__name__


@pytest.mark.parametrize(
    ("env", "expected"), CASES, ids=[p.NAME + str(i) for i, (_, p) in enumerate(CASES)]
)
def test_the_current_platform_reads_a_world_of_its_own_name(env, expected):
    assert platforms.current(env) is expected
    assert platforms.read_world(env).launcher == expected.NAME


def test_asked_in_another_order_mpi_inside_slurm_is_misread(monkeypatch):
    """Control: with SLURM asked before MPI, ``mpiexec`` in a SLURM job would read SLURM's node
    count as the world; the documented order is what gets it right."""
    monkeypatch.setattr(platforms, "PLATFORMS", (kubernetes, ray, torchrun, slurm, mpi, none))
    assert platforms.current(MPICH | SLURM) is slurm
    assert platforms.read_world(MPICH | SLURM).world_size == 1


def test_only_kubernetes_sets_launch_defaults_here():
    env = SLURM | MPICH | RAY | {"PET_NNODES": "2"}
    assert [d.option for d in platforms.launch_defaults(env)] == ["--nnodes"]


@pytest.mark.heavy
def test_importing_ddpkit_and_its_platforms_imports_neither_ray_nor_mpi4py():
    code = (
        "import sys, ddpkit, ddpkit.platforms; print(sorted({'ray', 'mpi4py'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
