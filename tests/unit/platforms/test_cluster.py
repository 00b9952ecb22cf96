"""Reading the launcher's environment: pure logic, tested with mocked environments (no process is
started)."""

from __future__ import annotations

import os
import re

import pytest

from ddpkit import ConfigError
from ddpkit.distributed._environment import read_launch_env
from ddpkit.platforms import scheduler
from ddpkit.platforms._base import LaunchEnv
from ddpkit.platforms._cpus import cpu_count
from ddpkit.platforms._slurm import expand_hostlist
from ddpkit.platforms._torchrun import uneven_nodes

TORCHRUN_CORE = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node7",
    "MASTER_PORT": "29511",
}


def changed(base: dict[str, str], **changes: str | None) -> dict[str, str]:
    """``base`` with variables set, or removed where the value is None."""
    env = dict(base)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def torchrun(**changes: str | None) -> dict[str, str]:
    return changed(TORCHRUN, **changes)


# ----------------------------------------------------------------------------------------- torchrun


def test_torchrun_variables_are_read():
    info = read_launch_env(TORCHRUN)
    assert info == LaunchEnv(
        rank=3,
        local_rank=1,
        world_size=8,
        local_world_size=2,
        launcher="torchrun",
        master_addr="node7",
        master_port=29511,
    )


def test_torchrun_restart_count():
    assert read_launch_env(TORCHRUN).restart_count == 0
    assert read_launch_env(torchrun(TORCHELASTIC_RESTART_COUNT="2")).restart_count == 2
    with pytest.raises(ConfigError, match="TORCHELASTIC_RESTART_COUNT='x' is not an integer"):
        read_launch_env(torchrun(TORCHELASTIC_RESTART_COUNT="x"))


@pytest.mark.parametrize("value", ["inf", "nan", "1e300", "1e-300", "0", "-5", "soon"])
def test_a_collective_timeout_outside_one_second_to_thirty_days_is_refused_by_the_worker_too(value):
    # Outside `ddpkit run` (torchrun, SLURM) the worker is the first to read it: torch keeps the
    # timeout in milliseconds, and inf or 1e300 would overflow rather than mean "never".
    with pytest.raises(ConfigError, match="DDPKIT_COLLECTIVE_TIMEOUT.*from 1 to 2592000"):
        read_launch_env(torchrun(DDPKIT_COLLECTIVE_TIMEOUT=value))
    # control
    assert read_launch_env(torchrun(DDPKIT_COLLECTIVE_TIMEOUT="30")).collective_timeout == 30.0


def test_nodes_with_different_process_counts_are_named():
    # 2 nodes of 2 make the 4 of the world: nothing to say. 3 in all on 2 nodes, 2 here: one node
    # differs.
    assert (
        uneven_nodes(torchrun(GROUP_WORLD_SIZE="4", WORLD_SIZE="8", LOCAL_WORLD_SIZE="2")) is None
    )
    message = uneven_nodes(
        torchrun(GROUP_WORLD_SIZE="2", WORLD_SIZE="3", LOCAL_WORLD_SIZE="2", LOCAL_RANK="0")
    )
    assert "3 processes on 2 nodes, 2 of them on this node" in message and "--nproc" in message
    assert (
        uneven_nodes(torchrun(GROUP_WORLD_SIZE="1", WORLD_SIZE="3", LOCAL_WORLD_SIZE="3")) is None
    )
    assert uneven_nodes({}) is None  # not under torchrun


def test_torchrun_without_local_world_size_means_one_node():
    info = read_launch_env(torchrun(LOCAL_WORLD_SIZE=None, LOCAL_RANK="3"))
    assert info.local_world_size == 8
    assert info.local_rank == 3


@pytest.mark.parametrize(
    "present, missing",
    [
        (("RANK",), ("WORLD_SIZE", "LOCAL_RANK")),
        (("RANK", "WORLD_SIZE"), ("LOCAL_RANK",)),
        (("WORLD_SIZE", "LOCAL_RANK"), ("RANK",)),
        (("LOCAL_RANK",), ("RANK", "WORLD_SIZE")),
    ],
)
def test_partial_torchrun_set_names_the_missing_variables(present, missing):
    env = {name: TORCHRUN[name] for name in present} | {"MASTER_ADDR": "a", "MASTER_PORT": "1"}
    with pytest.raises(ConfigError) as err:
        read_launch_env(env)
    # "<present> set but <missing> not: ..." -- the part naming what is absent lists exactly the
    # missing ones.
    absent_part = str(err.value).split("set but", 1)[1].split(":", 1)[0]
    for name in TORCHRUN_CORE:
        assert bool(re.search(rf"\b{name}\b", absent_part)) == (name in missing), (
            name,
            str(err.value),
        )


@pytest.mark.parametrize(
    "name", ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"]
)
@pytest.mark.parametrize("value", ["two", "1.5", ""])
def test_non_integer_variable_is_named(name, value):
    with pytest.raises(ConfigError, match=rf"{name}=.*not an integer"):
        read_launch_env(torchrun(**{name: value}))


@pytest.mark.parametrize("rank", ["8", "9", "-1"])
def test_rank_outside_world(rank):
    with pytest.raises(ConfigError, match=rf"rank {rank} is outside the world of 8"):
        read_launch_env(torchrun(RANK=rank))


def test_rank_equal_to_world_size_minus_one_is_fine():
    # Control for the check above: the boundary itself is a valid rank.
    assert read_launch_env(torchrun(RANK="7")).rank == 7


@pytest.mark.parametrize("local_rank", ["2", "5"])
def test_local_rank_outside_local_world(local_rank):
    with pytest.raises(ConfigError, match=rf"local rank {local_rank} is outside the 2 processes"):
        read_launch_env(torchrun(LOCAL_RANK=local_rank))


def test_local_world_larger_than_world():
    with pytest.raises(ConfigError, match="local world size must be between 1 and the world size"):
        read_launch_env(torchrun(LOCAL_WORLD_SIZE="16"))


def test_world_size_zero():
    with pytest.raises(ConfigError, match="world size 0"):
        read_launch_env(torchrun(WORLD_SIZE="0", RANK="0"))


@pytest.mark.parametrize("name", ["MASTER_ADDR", "MASTER_PORT"])
def test_missing_rendezvous_address(name):
    with pytest.raises(ConfigError, match=rf"{name} is not"):
        read_launch_env(torchrun(**{name: None}))


def test_torchrun_wins_over_slurm():
    env = TORCHRUN | SLURM
    assert read_launch_env(env).launcher == "torchrun"


# -------------------------------------------------------------------------------------------- SLURM

SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "7",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_ID": "123456",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NODELIST": "gpu[01-03],cpu7",
    "SLURM_TASKS_PER_NODE": "2(x3),1",
    "SLURM_NODEID": "2",
}


def slurm(**changes: str | None) -> dict[str, str]:
    return changed(SLURM, **changes)


def test_slurm_task_is_read():
    info = read_launch_env(SLURM)
    assert info == LaunchEnv(
        rank=5,
        local_rank=1,
        world_size=7,
        local_world_size=2,
        launcher="slurm",
        master_addr="gpu01",  # the first host of the expanded node list
        master_port=20000 + (123456 % 750) * 16,  # step 0
    )


def test_slurm_tasks_per_node_repeat_syntax_last_node():
    # "2(x3),1": nodes 0-2 run two tasks each, node 3 runs one.
    info = read_launch_env(slurm(SLURM_PROCID="6", SLURM_LOCALID="0", SLURM_NODEID="3"))
    assert info.local_world_size == 1
    for node in range(3):
        assert (
            read_launch_env(slurm(SLURM_NODEID=str(node), SLURM_LOCALID="0")).local_world_size == 2
        )


def test_slurm_local_rank_outside_node():
    with pytest.raises(ConfigError, match="local rank 1 is outside the 1 processes"):
        read_launch_env(slurm(SLURM_PROCID="6", SLURM_NODEID="3"))


def test_slurm_port_from_job_id_differs_between_jobs_and_master_port_overrides():
    a = read_launch_env(slurm(SLURM_JOB_ID="1000")).master_port
    b = read_launch_env(slurm(SLURM_JOB_ID="1001")).master_port
    assert a != b
    assert read_launch_env(slurm(MASTER_PORT="29999")).master_port == 29999
    assert read_launch_env(slurm(MASTER_ADDR="head")).master_addr == "head"


def test_slurm_concurrent_steps_of_one_job_get_different_ports():
    # Two `srun ... &` in one batch script: same job id, step ids 0 and 1. Keyed on the job id
    # alone, both steps' rank 0 bound the same port and the second step failed (or joined the first
    # one's store).
    ports = {read_launch_env(slurm(SLURM_STEP_ID=str(step))).master_port for step in range(16)}
    assert len(ports) == 16


@pytest.mark.parametrize(
    "job_id", ["0", "1", "749", "750", "19999", "123456", "987654321", "4294967294"]
)
@pytest.mark.parametrize("step_id", ["0", "3", "15", "40"])
def test_slurm_port_stays_below_the_ephemeral_range(job_id, step_id):
    # Linux hands out 32768-60999 as source ports of outgoing connections: a port derived there can
    # be taken.
    port = read_launch_env(slurm(SLURM_JOB_ID=job_id, SLURM_STEP_ID=step_id)).master_port
    assert 1024 < port < 32768


def test_slurm_jobs_close_in_id_never_share_a_port():
    ports = {read_launch_env(slurm(SLURM_JOB_ID=str(1000 + j))).master_port for j in range(750)}
    assert len(ports) == 750


def test_slurm_requeue_count_is_the_restart_count():
    assert read_launch_env(SLURM).restart_count == 0
    assert read_launch_env(slurm(SLURM_RESTART_COUNT="2")).restart_count == 2
    # `srun ddpkit run`: the agent's restarts and the scheduler's requeues add up.
    assert (
        read_launch_env(
            torchrun(TORCHELASTIC_RESTART_COUNT="1") | {"SLURM_RESTART_COUNT": "2"}
        ).restart_count
        == 3
    )


def test_slurm_step_variables_take_precedence():
    info = read_launch_env(
        slurm(
            SLURM_STEP_NUM_TASKS="4",
            SLURM_STEP_TASKS_PER_NODE="3,1",
            SLURM_STEP_NODELIST="step[5-6]",
            SLURM_NODEID="0",
            SLURM_PROCID="2",
        )
    )
    assert (info.world_size, info.local_world_size, info.master_addr) == (4, 3, "step5")


def test_slurm_without_node_list():
    env = slurm(SLURM_JOB_NODELIST=None)
    with pytest.raises(ConfigError, match="no SLURM node list"):
        read_launch_env(env)


def test_slurm_bad_tasks_per_node():
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE"):
        read_launch_env(slurm(SLURM_TASKS_PER_NODE="two"))


def test_slurm_rank_outside_world():
    with pytest.raises(
        ConfigError, match="rank 7 is outside the world of 7 processes set by SLURM"
    ):
        read_launch_env(slurm(SLURM_PROCID="7"))


@pytest.mark.parametrize("name", ["bash", "interactive", "sh", "zsh", "train"])
def test_slurm_job_name_does_not_turn_slurm_off(name):
    # `srun -n2 bash -c "python train.py"` is a job named bash; `salloc -n2` names its job
    # interactive. Their srun tasks are one job of two ranks, not two worlds of one.
    info = read_launch_env(slurm(SLURM_JOB_NAME=name))
    assert (info.launcher, info.rank, info.world_size) == ("slurm", 5, 7)


def test_slurm_pty_variable_does_not_turn_slurm_off():
    # `srun --pty bash` exports SLURM_PTY_PORT, and every `srun -n2 python ...` started from that
    # shell inherits it (seen on SLURM 22.05), so it cannot mark a process as outside a job.
    assert read_launch_env(slurm(SLURM_PTY_PORT="42059")).world_size == 7


def test_slurm_without_step_id_is_a_world_of_one():
    # A batch script or salloc shell carries SLURM_PROCID/SLURM_NTASKS but is no srun task.
    assert read_launch_env(slurm(SLURM_STEP_ID=None)) == LaunchEnv()
    # Control: the same variables with the step id are a SLURM task.
    assert read_launch_env(SLURM).launcher == "slurm"


# ---------------------------------------------------------------------------------------------- MPI

OPEN_MPI = {
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}
MPICH = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}


def test_open_mpi_is_read():
    info = read_launch_env(OPEN_MPI)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        "mpi",
        2,
        4,
        0,
        2,
    )
    assert (info.master_addr, info.master_port) == (None, None)  # agreed over MPI at init
    assert (
        read_launch_env(OPEN_MPI | {"MASTER_ADDR": "h", "MASTER_PORT": "23456"}).master_port
        == 23456
    )


def test_mpich_is_read():
    info = read_launch_env(MPICH)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        "mpi",
        3,
        4,
        1,
        2,
    )


def test_mpi_inside_slurm_counts_ranks_not_nodes():
    # mpiexec in a batch job starts one srun task per node (SLURM_PROCID counts nodes) and the ranks
    # inside it.
    info = read_launch_env(
        MPICH | slurm(SLURM_PROCID="0", SLURM_NTASKS="1", SLURM_LOCALID="0", SLURM_NODEID="0")
    )
    assert (info.launcher, info.rank, info.world_size) == ("mpi", 3, 4)


def test_mpi_rank_outside_world():
    with pytest.raises(
        ConfigError, match="rank 4 is outside the world of 4 processes set by mpiexec"
    ):
        read_launch_env(MPICH | {"PMI_RANK": "4"})


def test_no_variables_is_a_world_of_one():
    info = read_launch_env({})
    assert info == LaunchEnv()
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (0, 0, 1, 1)
    assert (info.launcher, info.master_addr, info.master_port) == ("none", None, None)
    # Unrelated variables change nothing.
    assert (
        read_launch_env({"PATH": "/bin", "SLURM_JOB_ID": "5", "OMP_NUM_THREADS": "4"})
        == LaunchEnv()
    )


# --------------------------------------------------------------------------------------- host lists


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("gpu[01-03,07],login1", ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]),
        ("node1", ["node1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("cn[0001-0002]", ["cn0001", "cn0002"]),
        ("rack-a[1,3]-ib,head-0", ["rack-a1-ib", "rack-a3-ib", "head-0"]),
        ("x[5]", ["x5"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


# --------------------------------------------------------------------------------- cores, scheduler


def test_cpu_count_scheduler_grant():
    assert cpu_count({"NSLOTS": "6"}) == 6
    assert cpu_count({"SLURM_CPUS_ON_NODE": "12"}) == 12
    assert cpu_count({"NSLOTS": "3", "SLURM_CPUS_ON_NODE": "12"}) == 3


@pytest.mark.parametrize("bad", ["0", "", "four", "-2"])
def test_cpu_count_ignores_unusable_grant(bad):
    assert cpu_count({"NSLOTS": bad}) == len(os.sched_getaffinity(0))


def test_cpu_count_default_is_affinity():
    assert cpu_count({}) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        ({"SLURM_JOB_ID": "17"}, "slurm"),
        ({"SLURM_JOB_ID": "17", "NSLOTS": "4"}, "slurm"),
        ({"NSLOTS": "4"}, "sge"),
        ({"SGE_TASK_ID": "2"}, "sge"),
        ({"JOB_ID": "9", "SGE_ROOT": "/opt/sge"}, "sge"),
        ({"JOB_ID": "9"}, None),
        ({"SGE_ROOT": "/opt/sge"}, None),
    ],
)
def test_scheduler(env, expected):
    assert scheduler(env) == expected


def test_a_cgroup_cpu_quota_bounds_the_cores(tmp_path):
    """A pod limited to 1.5 CPUs (cgroup v2 ``cpu.max`` 150000/100000), under a parent limited to 4:
    1.5. Control: no quota anywhere on the path (``max``) is no bound."""
    from ddpkit.platforms._cpus import cgroup_cpu_quota

    pod = tmp_path / "kubepods" / "pod1" / "ctr"
    pod.mkdir(parents=True)
    (tmp_path / "kubepods" / "cpu.max").write_text("400000 100000\n")
    (pod / "cpu.max").write_text("150000 100000\n")
    membership = tmp_path / "cgroup"
    membership.write_text("0::/kubepods/pod1/ctr\n")
    assert cgroup_cpu_quota(str(tmp_path), str(membership)) == 1.5
    (pod / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path), str(membership)) == 4.0
    (tmp_path / "kubepods" / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path), str(membership)) is None
    membership.write_text("4:memory:/x\n1:cpu:/\n")  # cgroup v1 only: not read
    assert cgroup_cpu_quota(str(tmp_path), str(membership)) is None


def test_cpu_count_takes_the_quota_under_the_affinity(monkeypatch):
    from ddpkit.platforms import _cpus as cpus

    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: 0.5)
    assert cpu_count({}) == 1  # half a CPU: one process's worth
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: 10_000.0)
    assert cpu_count({}) == len(os.sched_getaffinity(0))  # a quota above the cores bounds nothing
    assert cpu_count({"NSLOTS": "6"}) == 6  # a scheduler's grant comes first
