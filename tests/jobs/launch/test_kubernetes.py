"""Kubernetes pods as network namespaces: each pod's environment is exactly what its operator sets,
its names are what the cluster's DNS gives (a headless service's names, the pod's own host name),
and its command is the one the job's spec runs.

- PyTorchJob (training-operator v1.9), one process per pod: ``python train.py`` with ``MASTER_ADDR``
  (the master replica's service), ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` and their ``PET_*``
  names;
- the same PyTorchJob with ``nprocPerNode``, and a TrainJob (Trainer v2's torch plugin: torchrun's
  ``PET_*``), each with the command ``ddpkit k8s`` writes: ``ddpkit run`` takes its options from the
  ``PET_*``;
- JobSet: ``ddpkit run --nnodes 2 --rdzv-endpoint <jobset>-node-0-0.<jobset>:29500 train.py`` (as
  ``ddpkit k8s`` writes it), the node rank from the indexed Job's ``JOB_COMPLETION_INDEX``.

Each trains to the bits of the same job on one node. Pods killed and recreated (a new, empty
``/dev/shm``) resume from the disk snapshot to the same bits; a pod with a wrong secret is refused.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit._launch.cli import k8s
from ddpkit.testing import read_records, run_job, wait_until
from tests.jobs.launch import netns
from tests.jobs.launch.netns import DDPKIT, ROOT
from tests.trainer_checks import bitwise_equal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

JOB = str(ROOT / "tests" / "jobs" / "scripts" / "memory_job.py")
SECRET = "9f" * 32
# the operators' service names for pod 0
MASTER, NODE0 = "digits-master-0", "digits-node-0-0.digits"
WORKER = "digits-worker-0"
POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    """[(namespace, address)] of pods a and b, with the cluster's names in each one's /etc/hosts."""
    with netns.two_nodes(f"dk8s{os.getpid() % 10000}") as pair:
        (ns_a, addr_a), (ns_b, addr_b) = pair
        services = {MASTER: addr_a, NODE0: addr_a, WORKER: addr_b, "digits-node-0-1.digits": addr_b}
        # The kubelet writes the pod's own host name with the pod's address into its /etc/hosts.
        me = socket.gethostname()
        with netns.hosts_files({ns_a: services | {me: addr_a}, ns_b: services | {me: addr_b}}):
            yield pair


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job on one node of two processes: the bits every Kubernetes job must end on."""
    tmp = tmp_path_factory.mktemp("reference")
    (tmp / "log").mkdir()
    job = [str(tmp / "run"), "--log", str(tmp / "log"), "--out", "ref.pt"]
    out = run_job(JOB, *job, env=netns.node_env(secret=False), cwd=tmp, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return torch.load(tmp / "ref.pt", weights_only=False)


def operator_env(kind: str, index: int) -> dict[str, str]:
    """What the operator sets in pod ``index`` of a 2-pod job named ``digits``, one process per
    pod."""
    if kind.startswith("pytorchjob"):  # training-operator v1.9: envvar.go, master.go
        env = {"PYTHONUNBUFFERED": "1", "MASTER_PORT": "29500", "PET_MASTER_PORT": "29500"}
        env |= {
            "MASTER_ADDR": MASTER,
            "PET_MASTER_ADDR": MASTER,
            "WORLD_SIZE": "2",
            "RANK": str(index),
        }
        env |= {"PET_NODE_RANK": str(index), "PET_NNODES": "2"}
        # nprocPerNode: "1" as `ddpkit k8s` writes it, else v1.9's default "auto"
        # (pytorch_defaults.go).
        return env | {"PET_NPROC_PER_NODE": "1" if kind == "pytorchjob-run" else "auto"}
    env = {"JOB_COMPLETION_INDEX": str(index)}  # every indexed Job's pod
    if kind == "trainjob":  # Trainer v2's torch plugin
        env |= {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(index)}
        env |= {"PET_MASTER_ADDR": NODE0, "PET_MASTER_PORT": "29500"}
    return env


def pod(
    kind: str, index: int, tmp: Path, name: str, *job_args: str, secret: str = SECRET
) -> tuple[list, dict]:
    """(command, environment) of pod ``index`` of a 2-pod job of ``kind``: the operator's variables,
    and the command ``ddpkit k8s`` writes (plain ``python`` for a PyTorchJob of one process per
    pod)."""
    env = netns.node_env(secret=False) | POD | operator_env(kind, index)
    env["DDPKIT_MEMORY_ROOT"] = str(tmp / f"shm-{name}-{index}")
    Path(env["DDPKIT_MEMORY_ROOT"]).mkdir(exist_ok=True)
    (tmp / f"{name}-log").mkdir(exist_ok=True)
    job = [
        str(tmp / name),
        "--log",
        str(tmp / f"{name}-log"),
        "--out",
        str(tmp / f"{name}.pt"),
        *job_args,
    ]
    if kind == "pytorchjob":
        return [sys.executable, JOB, *job], env
    env["DDPKIT_RDZV_SECRET"] = secret  # an env var from a Kubernetes Secret (secretKeyRef)
    manifest_kind = "pytorchjob" if kind == "pytorchjob-run" else kind
    cfg = k8s.ManifestConfig(
        script=JOB,
        script_args=job,
        image="-",
        kind=manifest_kind,
        name="digits",
        nodes=2,
        nproc="1",
        max_restarts=2,
    )
    argv = k8s.command(cfg)
    assert argv[:2] == ["ddpkit", "run"]
    return [*DDPKIT, *argv[1:]], env


def start(pods, kind: str, tmp: Path, name: str, *job_args: str) -> list[subprocess.Popen]:
    procs = []
    for index, (ns, _) in enumerate(pods):
        cmd, env = pod(kind, index, tmp, name, *job_args)
        procs.append(netns.on(ns, cmd, tmp, f"{name}-{index}.log", env))
    return procs


def logs(tmp: Path, name: str) -> list[str]:
    return [(tmp / f"{name}-{i}.log").read_text()[-3000:] for i in (0, 1)]


def resumes(run_dir: Path) -> list[dict]:
    return [r for r in read_records(run_dir) if r.get("event") == "resume"]


@pytest.mark.parametrize("kind", ["pytorchjob", "pytorchjob-run", "trainjob", "jobset"])
def test_two_pods_train_to_the_bits_of_one_node(pods, reference, kind, tmp_path):
    codes = netns.finish(start(pods, kind, tmp_path, kind), timeout=300)
    assert codes == [0, 0], logs(tmp_path, kind)
    final = torch.load(tmp_path / f"{kind}.pt", weights_only=False)
    assert bitwise_equal(final, reference)
    if kind == "trainjob":  # the launch says where its options came from
        assert "--node-rank 1 (PET_NODE_RANK)" in logs(tmp_path, kind)[1]
        assert (
            f"--rdzv-endpoint {NODE0}:29500 (PET_MASTER_ADDR:PET_MASTER_PORT)"
            in logs(tmp_path, kind)[0]
        )
    if kind == "pytorchjob-run":
        assert (
            f"--rdzv-endpoint {MASTER}:29500 (PET_MASTER_ADDR:PET_MASTER_PORT)"
            in logs(tmp_path, kind)[0]
        )
    if kind == "jobset":
        assert "--node-rank 1 (JOB_COMPLETION_INDEX)" in logs(tmp_path, kind)[1]
    if kind == "pytorchjob":  # no agent in the pod: no memory folder, said once
        assert "snapshots in memory are off" in logs(tmp_path, kind)[0]


@pytest.mark.parametrize("kind", ["trainjob", "pytorchjob"])
def test_a_one_pod_job_of_two_processes_trains_without_a_secret(pods, reference, kind, tmp_path):
    """The manifest ``ddpkit k8s --nodes 1 --nproc 2`` writes mounts no secret; its operator still
    sets the master's address (the pod's own name). The pod trains on its own, to the bits of one
    node."""
    (ns_a, _), _ = pods
    master = NODE0 if kind == "trainjob" else MASTER
    env = (
        netns.node_env(secret=False)
        | POD
        | {"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0"}
    )
    env |= {
        "PET_MASTER_ADDR": master,
        "PET_MASTER_PORT": "29500",
        "DDPKIT_MEMORY_ROOT": str(tmp_path / "shm"),
    }
    if kind == "trainjob":
        env["JOB_COMPLETION_INDEX"] = "0"
    else:  # training-operator v1.9 (envvar.go) sets these beside the PET_* names
        env |= {"MASTER_ADDR": master, "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "0"}
    (tmp_path / "shm").mkdir()
    (tmp_path / "log").mkdir()
    job = [str(tmp_path / "run"), "--log", str(tmp_path / "log"), "--out", str(tmp_path / "one.pt")]
    cfg = k8s.ManifestConfig(
        script=JOB, script_args=job, image="-", kind=kind, name="digits", nproc="2"
    )
    assert k8s.environment(cfg) == []  # no secret named
    argv = k8s.command(cfg)
    codes = netns.finish(
        [netns.on(ns_a, [*DDPKIT, *argv[1:]], tmp_path, "one.log", env)], timeout=300
    )
    assert codes == [0], (tmp_path / "one.log").read_text()[-3000:]
    assert bitwise_equal(torch.load(tmp_path / "one.pt", weights_only=False), reference)
    assert "--rdzv-endpoint" not in (tmp_path / "one.log").read_text()


def _recreated(pods, tmp: Path, name: str, disk_every: int) -> tuple[dict, list[dict]]:
    """Both pods of a TrainJob SIGKILLed while every rank holds after step 15 (a JobSet restart
    deletes every pod), then recreated with a new, empty /dev/shm; returns the final state and the
    resume events."""
    args = (
        "--disk-every-steps",
        str(disk_every),
        "--hold-after-step",
        "15",
        "--hold-file",
        str(tmp / f"{name}-go"),
    )
    first = start(pods, "trainjob", tmp, name, *args)
    log = tmp / f"{name}-log"
    # Disk snapshots are written in the background: the newest one before the hold (step 10 of
    # every 5) may still be in flight when the ranks reach step 15. The pods are killed once its
    # marker is there.
    due = (14 // disk_every) * disk_every
    marker = tmp / name / "snapshots" / f"step-{due:08d}" / "complete.json"

    def held() -> bool:
        assert all(p.poll() is None for p in first), logs(tmp, name)
        steps = [log / f"steps-rank{r}.txt" for r in (0, 1)]
        ranks_held = all(f.exists() and len(f.read_text().splitlines()) >= 15 for f in steps)
        return ranks_held and (due == 0 or marker.exists())

    wait_until(held, 240, what=lambda: f"every rank held after step 15\n{logs(tmp, name)}")
    for p in first:  # the pod: its agent and all it started
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    (tmp / f"{name}-go").touch()
    second = []
    for index, (ns, _) in enumerate(pods):
        cmd, env = pod("trainjob", index, tmp, name, *args)
        # the old pod's memory is gone
        env["DDPKIT_MEMORY_ROOT"] = str(tmp / f"shm-{name}-{index}-recreated")
        Path(env["DDPKIT_MEMORY_ROOT"]).mkdir()
        second.append(netns.on(ns, cmd, tmp, f"{name}-{index}.log", env))
    codes = netns.finish(second, timeout=300)
    assert codes == [0, 0], logs(tmp, name)
    return torch.load(tmp / f"{name}.pt", weights_only=False), resumes(tmp / name)


def test_pods_killed_and_recreated_resume_from_the_disk_snapshot_to_the_same_bits(
    pods, reference, tmp_path
):
    final, events = _recreated(pods, tmp_path, "recreated", disk_every=5)
    (event,) = events
    # Every rank held after step 15 before that step's snapshot: the newest on disk is step 10's.
    assert event["file"] == "step-00000010" and event["step"] == 10, event
    assert bitwise_equal(final, reference)
    # Control: with no disk snapshot before the kill, the recreated pods have nothing to resume from
    # (their memory is new) and start again at step 0, yet end on the same bits.
    final, events = _recreated(pods, tmp_path, "no-disk", disk_every=1000)
    assert events == [] and bitwise_equal(final, reference)


def test_a_pod_with_a_wrong_secret_is_refused(pods, tmp_path):
    (ns_a, _), (ns_b, _) = pods
    good_cmd, good_env = pod("trainjob", 0, tmp_path, "secret")
    bad_cmd, bad_env = pod("trainjob", 1, tmp_path, "secret", secret="e" * 64)
    pod_a = netns.on(ns_a, good_cmd, tmp_path, "secret-0.log", good_env)
    try:
        out = subprocess.run(
            ["ip", "netns", "exec", ns_b, *bad_cmd], env=bad_env, cwd=tmp_path, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
    finally:
        netns.finish([pod_a], timeout=0)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "host does not accept this node's secret" in out.stderr and NODE0 in out.stderr, (
        out.stderr
    )
    assert "Traceback" not in out.stderr
