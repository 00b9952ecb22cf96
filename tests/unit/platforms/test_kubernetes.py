"""What Kubernetes' operators set in a pod, read as ddpkit reads it (mocked environments; the jobs
themselves, pods as network namespaces, are in ``tests/jobs/launch/test_kubernetes.py``)."""

from __future__ import annotations

import os

import pytest
import torch.distributed as dist

import ddpkit
from ddpkit._errors import ConfigError
from ddpkit._launch.cli.options import typed_options, with_environment_defaults
from ddpkit.distributed import _runtime as runtime
from ddpkit.distributed._environment import read_launch_env
from ddpkit.platforms import _kubernetes as k8s
from tests.unit.platforms.pods import ELASTIC_WORKER, POD, PYTORCHJOB_WORKER, TRAINJOB_NODE

SCRIPT = ["train.py"]


def test_a_pytorchjob_pod_without_torchrun_is_local_rank_0_of_1():
    info = read_launch_env(PYTORCHJOB_WORKER)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (2, 0, 3, 1)
    assert (info.launcher, info.master_addr, info.master_port) == (
        "pytorchjob",
        "digits-master-0",
        23456,
    )


def test_a_pytorchjob_pod_of_v19s_default_nproc_auto_is_one_process_a_pod():
    """training-operator v1.9 defaults nprocPerNode to "auto" and counts a word as one process a pod
    in WORLD_SIZE (envvar.go, getNprocPerNodeInt); a number above 1 stays refused (the next
    test)."""
    info = read_launch_env(PYTORCHJOB_WORKER | {"PET_NPROC_PER_NODE": "auto"})
    assert (info.rank, info.local_rank, info.world_size, info.launcher) == (2, 0, 3, "pytorchjob")


def _init_in(monkeypatch, env: dict[str, str]):
    """ddpkit.init() in a process whose environment is ``env`` alone (no launcher: no process group
    made)."""
    monkeypatch.setattr(os, "environ", dict(env))
    try:
        return ddpkit.init()
    finally:
        runtime.forget()


def test_a_plain_python_process_in_a_pod_set_for_torchrun_is_refused_not_left_to_train_alone(
    monkeypatch,
):
    """A TrainJob's pod (PET_* and no RANK) started as `python train.py` would be rank 0 of 1 in
    every pod."""
    with pytest.raises(ConfigError, match=r"PET_NNODES=2.*`ddpkit run train.py`"):
        _init_in(monkeypatch, TRAINJOB_NODE)
    with pytest.raises(ConfigError, match="PET_NNODES=1:3"):
        _init_in(monkeypatch, ELASTIC_WORKER)
    # Controls: one pod of one process is a world of one; the same variables outside a pod are
    # torchrun's own options, which a plain process does not read.
    assert _init_in(monkeypatch, TRAINJOB_NODE | {"PET_NNODES": "01"}).world_size == 1
    outside = {k: v for k, v in TRAINJOB_NODE.items() if not k.startswith("KUBERNETES_")}
    assert _init_in(monkeypatch, outside).world_size == 1


def test_a_process_group_the_script_made_itself_is_not_refused_in_such_a_pod(monkeypatch):
    """The tutorials' mp.spawn children make their group with init_process_group and carry no
    RANK."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert _init_in(monkeypatch, TRAINJOB_NODE).world_size == 1
        monkeypatch.setattr(os, "environ", dict(TRAINJOB_NODE))
        assert runtime.get_runtime().world_size == 1  # and without init
    finally:
        dist.destroy_process_group()


def test_the_same_variables_outside_kubernetes_stay_an_error():
    """Control: RANK and WORLD_SIZE without LOCAL_RANK on a machine that is not a pod (a leftover
    export)."""
    outside = {k: v for k, v in PYTORCHJOB_WORKER.items() if not k.startswith("KUBERNETES_")}
    with pytest.raises(ConfigError, match="RANK, WORLD_SIZE set but LOCAL_RANK not"):
        read_launch_env(outside)


def test_ddpkit_run_in_a_pytorchjob_pod_takes_the_operators_nodes_rank_and_master():
    ours, _ = with_environment_defaults(SCRIPT, PYTORCHJOB_WORKER | {"PET_NPROC_PER_NODE": "2"})
    assert ours == [
        "--nnodes", "3", "--nproc", "2", "--node-rank", "2", "--rdzv-endpoint",
        "digits-master-0:23456", "train.py",
    ]  # fmt: skip


def test_torchrun_in_a_pod_is_still_torchrun():
    env = PYTORCHJOB_WORKER | {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    assert read_launch_env(env).launcher == "torchrun"


def test_a_lone_process_in_a_pod_meant_for_several_is_refused():
    env = PYTORCHJOB_WORKER | {"PET_NPROC_PER_NODE": "4", "WORLD_SIZE": "12"}
    with pytest.raises(ConfigError, match=r"PET_NPROC_PER_NODE=4.*`ddpkit run train.py`"):
        read_launch_env(env)


def test_a_pytorchjob_rank_outside_its_world_names_the_job():
    with pytest.raises(ConfigError, match="outside the world of 3 processes set by a PyTorchJob"):
        read_launch_env(PYTORCHJOB_WORKER | {"RANK": "3"})


def test_a_trainjob_nodes_variables_become_ddpkit_run_options():
    ours, line = with_environment_defaults(SCRIPT, TRAINJOB_NODE)
    assert ours == [
        "--nnodes", "2", "--nproc", "1", "--node-rank", "1",
        "--rdzv-endpoint", "digits-node-0-0.digits:29500", "train.py",
    ]  # fmt: skip
    assert (
        line is not None
        and "--rdzv-endpoint digits-node-0-0.digits:29500 (PET_MASTER_ADDR:PET_MASTER_PORT)" in line
    )


def test_a_one_pod_job_runs_on_its_node_without_a_rendezvous_endpoint():
    """A TrainJob or PyTorchJob of one pod still gets the master's address; a networked rendezvous
    there would ask the lone pod for a secret that ``ddpkit k8s`` does not mount for one node."""
    one_pod = TRAINJOB_NODE | {"PET_NNODES": "1", "PET_NODE_RANK": "0", "JOB_COMPLETION_INDEX": "0"}
    ours, line = with_environment_defaults(SCRIPT, one_pod)
    assert ours == ["--nnodes", "1", "--nproc", "1", "train.py"]
    assert line is not None and "PET_MASTER_ADDR" not in line
    # Control: two pods keep the endpoint (the same variables, PET_NNODES=2).
    two, _ = with_environment_defaults(SCRIPT, one_pod | {"PET_NNODES": "2"})
    assert "--rdzv-endpoint" in two
    # A typed endpoint stands, and so does an elastic job that may grow past one node.
    typed = ["--rdzv-endpoint", "digits-node-0-0.digits:29500", *SCRIPT]
    assert "--node-rank" in with_environment_defaults(typed, one_pod)[0]
    assert (
        "--rdzv-endpoint"
        in with_environment_defaults(SCRIPT, ELASTIC_WORKER | {"PET_NNODES": "1:2"})[0]
    )


def test_an_elastic_pytorchjobs_variables_become_ddpkit_run_options():
    ours, _ = with_environment_defaults(SCRIPT, ELASTIC_WORKER)
    assert ours == [
        "--nnodes", "1:3", "--nproc", "2", "--rdzv-endpoint", "digits-worker-0:29400",
        "--rdzv-id", "digits", "--max-restarts", "3", "train.py",
    ]  # fmt: skip


def test_a_user_option_that_agrees_is_kept_and_one_that_disagrees_is_refused_naming_both():
    ours, _ = with_environment_defaults(["--nnodes=2", "--nproc", "1", *SCRIPT], TRAINJOB_NODE)
    assert (
        ours[:3] == ["--nnodes=2", "--nproc", "1"]
        and "--nnodes" not in ours
        and ours.count("--nproc") == 1
    )
    with pytest.raises(ConfigError, match="--nnodes 4 disagrees with PET_NNODES=2"):
        with_environment_defaults(["--nnodes", "4", *SCRIPT], TRAINJOB_NODE)


def test_a_rendezvous_backend_ddpkit_cannot_stand_in_for_is_refused():
    with pytest.raises(ConfigError, match="PET_RDZV_BACKEND='etcd-v2'.*c10d"):
        with_environment_defaults(SCRIPT, ELASTIC_WORKER | {"PET_RDZV_BACKEND": "etcd-v2"})


def test_jobsets_completion_index_is_the_node_rank_of_a_fixed_size_job_only():
    jobset_pod = POD | {"JOB_COMPLETION_INDEX": "1"}
    ours, line = with_environment_defaults(
        ["--nnodes", "2", "--rdzv-endpoint", "j-node-0-0.j:29400", *SCRIPT], jobset_pod
    )
    assert ours[-3:] == ["--node-rank", "1", "train.py"] and "(JOB_COMPLETION_INDEX)" in (
        line or ""
    )
    elastic, _ = with_environment_defaults(
        ["--nnodes", "1:2", "--rdzv-endpoint", "j:29400", *SCRIPT], jobset_pod
    )
    # an elastic job's node ranks are handed out at each rendezvous
    assert "--node-rank" not in elastic
    one_node, line = with_environment_defaults(SCRIPT, jobset_pod)
    assert one_node == SCRIPT and line is None
    # A JobSet of several Jobs: the index counts pods within one Job, so a typed node rank stands.
    typed = ["--nnodes", "4", "--node-rank", "3", "--rdzv-endpoint", "j:29500", *SCRIPT]
    assert with_environment_defaults(typed, jobset_pod) == (typed, None)


def test_the_jobs_rendezvous_settings_are_taken_and_its_join_timeout_is_ddpkit_runs():
    env = ELASTIC_WORKER | {"PET_RDZV_CONF": "join_timeout=1800, last_call_timeout=60"}
    ours, line = with_environment_defaults(SCRIPT, env)
    assert ours[-5:] == [
        "--join-timeout",
        "1800",
        "--rdzv-conf",
        "last_call_timeout=60",
        "train.py",
    ]
    assert (
        line is not None and "(PET_RDZV_CONF)" in line and "(PET_RDZV_CONF's join_timeout)" in line
    )
    # --rdzv-conf is repeatable: a typed one is added to the job's; a typed --join-timeout must
    # agree.
    typed, _ = with_environment_defaults(
        ["--rdzv-conf", "read_timeout=9", "--join-timeout", "1800.0", *SCRIPT], env
    )
    assert typed.count("--rdzv-conf") == 2 and typed.count("--join-timeout") == 1
    with pytest.raises(
        ConfigError, match="--join-timeout 60 disagrees with PET_RDZV_CONF's join_timeout=1800"
    ):
        with_environment_defaults(["--join-timeout", "60", *SCRIPT], env)


@pytest.mark.parametrize("conf", ["join_timeout=abc", "read_timeout=", "last_call_timeout"])
def test_a_wrong_rdzv_conf_is_named_as_the_variable(conf):
    with pytest.raises(ConfigError, match="PET_RDZV_CONF"):
        with_environment_defaults(SCRIPT, ELASTIC_WORKER | {"PET_RDZV_CONF": conf})


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "PET_NNODES",
            "two",
            "PET_NNODES='two', set in this pod's environment: use a number of nodes",
        ),
        (
            "PET_NODE_RANK",
            "x",
            "PET_NODE_RANK='x', set in this pod's environment: use this node's rank",
        ),
        ("PET_NPROC_PER_NODE", "-1", "PET_NPROC_PER_NODE='-1', set in this pod's environment"),
    ],
)
def test_a_wrong_operator_variable_is_named_as_the_variable(name, value, message):
    with pytest.raises(ConfigError, match=message):
        with_environment_defaults(SCRIPT, TRAINJOB_NODE | {name: value})


def test_a_typed_number_agrees_with_the_operators_in_any_spelling():
    ours, _ = with_environment_defaults(["--node-rank", "01", *SCRIPT], TRAINJOB_NODE)
    assert ours[:2] == ["--node-rank", "01"] and ours.count("--node-rank") == 1
    # control
    with pytest.raises(ConfigError, match="--node-rank 0 disagrees with PET_NODE_RANK=1"):
        with_environment_defaults(["--node-rank", "0", *SCRIPT], TRAINJOB_NODE)


def test_the_launch_line_says_kubernetes_only_in_a_pod():
    outside = {k: v for k, v in TRAINJOB_NODE.items() if not k.startswith("KUBERNETES_")}
    assert "from the environment: --nnodes 2" in (
        with_environment_defaults(SCRIPT, outside)[1] or ""
    )
    assert "(Kubernetes)" in (with_environment_defaults(SCRIPT, TRAINJOB_NODE)[1] or "")


def test_no_operator_variables_change_nothing():
    assert with_environment_defaults(["--nproc", "2", *SCRIPT], POD) == (
        ["--nproc", "2", *SCRIPT],
        None,
    )


def test_torchruns_cpu_process_count_is_one_per_core():
    # the cores this pod may use: here a scheduler's grant
    defaults = k8s.launch_defaults({"PET_NPROC_PER_NODE": "cpu", "NSLOTS": "6"})
    assert [(d.option, d.value) for d in defaults] == [("--nproc", "6")]


def test_typed_options_reads_both_spellings_and_stops_at_the_script():
    assert typed_options(["--nnodes=2", "--rdzv-id", "x", "--all-ranks", "train.py"]) == {
        "--nnodes": "2",
        "--rdzv-id": "x",
    }
