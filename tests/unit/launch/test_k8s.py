"""``ddpkit k8s``: the manifests it writes, against golden files and against the resources'
published schemas (the CRDs of Kubeflow Trainer, the training-operator and JobSet, with Kubernetes'
own Pod fields checked through them; kept in ``tests/unit/launch/k8s/``, see its SOURCES.md),
offline with ``jsonschema``."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpkit._errors import ConfigError
from ddpkit._launch.cli import k8s

HERE = Path(__file__).resolve().parent / "k8s"
SCHEMAS = {
    "TrainJob": "trainjob.json",
    "TrainingRuntime": "trainingruntime.json",
    "PyTorchJob": "pytorchjob.json",
    "JobSet": "jobset.json",
}
CASES = {  # golden file -> command line
    "trainjob-2-nodes": ["--image", "reg/train:1", "--nodes", "2", "--gpus-per-node", "8",
                         "--pvc", "runs", "train.py", "--lr", "0.1"],
    "pytorchjob-3-nodes": ["--kind", "pytorchjob", "--image", "reg/train:1", "--nodes", "3",
                           "--nproc", "2", "--cpu", "8", "--memory", "32Gi", "train.py"],
    "jobset-2-nodes": ["--kind", "jobset", "--image", "reg/train:1", "--nodes", "2",
                       "--namespace", "ml", "--env", "OMP_NUM_THREADS=4", "train.py"],
    "jobset-1-node": ["--kind", "jobset", "--image", "reg/train:1", "--name", "solo", "train.py"],
    "trainjob-1-node-cpu": ["--image", "reg/train:1", "--cpu", "6", "--memory", "16Gi",
                            "--shm-size", "2Gi", "train.py"],
}  # fmt: skip


def written(args: list[str], capsys) -> str:
    assert k8s.main(["--dry-run", *args]) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_manifest_is_the_golden_one(case, capsys):
    text = written(CASES[case], capsys)
    golden = HERE / f"{case}.yaml"
    # after a deliberate change: write, then read the diff
    if os.environ.get("DDPKIT_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), (
        f"rerun with DDPKIT_UPDATE_GOLDEN=1 if the change in {golden} is meant"
    )


def _closed(schema: Any) -> Any:
    """The schema with unknown fields refused: a CRD's structural schema prunes them on the server
    (a misspelt field vanishes silently there), so here every object that lists its ``properties``
    is closed unless it says it keeps unknown fields."""
    if isinstance(schema, dict):
        schema = {key: _closed(value) for key, value in schema.items()}
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema.setdefault("additionalProperties", False)
        return schema
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    return schema


def validator(kind: str):
    import jsonschema

    schema = json.loads((HERE / SCHEMAS[kind]).read_text())
    return jsonschema.Draft7Validator(_closed(schema))


def errors(doc: dict) -> list[str]:
    found = validator(doc["kind"]).iter_errors(doc)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in found)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_manifest_is_valid_against_the_published_schemas(case, capsys):
    docs = list(yaml.safe_load_all(written(CASES[case], capsys)))
    assert docs and all(errors(doc) == [] for doc in docs), [errors(doc) for doc in docs]


def test_the_schemas_refuse_a_misspelt_field_and_a_wrong_type():
    """Controls: the check can fail. A field misspelt deep in the pod, a count written as text."""
    cfg = k8s.ManifestConfig(script="train.py", image="reg/train:1", kind="jobset", nodes=2)
    (jobset,) = k8s.manifests(cfg)
    broken = copy.deepcopy(jobset)
    pod = broken["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    pod["containers"][0]["volumeMount"] = pod["containers"][0].pop("volumeMounts")
    broken["spec"]["replicatedJobs"][0]["replicas"] = "1"
    found = errors(broken)
    assert any("volumeMount" in e and "Additional properties" in e for e in found), found
    assert any(e.startswith("spec/replicatedJobs/0/replicas") for e in found), found
    trainjob = k8s.manifests(k8s.ManifestConfig(script="t.py", image="i", nodes=2))[1]
    trainjob["spec"]["trainer"]["numNodes"] = "two"
    assert any("numNodes" in e for e in errors(trainjob))


def test_the_failure_policy_recreates_preempted_and_disrupted_pods_and_fails_on_the_scripts_error():
    cfg = k8s.ManifestConfig(script="train.py", image="reg/train:1", kind="jobset", nodes=2)
    rules = k8s.pod_failure_policy(cfg)["rules"]
    assert rules[0] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert rules[1]["action"] == "Ignore" and rules[1]["onExitCodes"]["values"] == [75]
    assert rules[2]["action"] == "FailJob" and rules[2]["onExitCodes"] == {
        "containerName": "node",
        "operator": "NotIn",
        "values": [0, 75],
    }


def test_pods_mount_shared_memory_and_the_secret_read_only_by_their_group():
    cfg = k8s.ManifestConfig(
        script="train.py", image="reg/train:1", kind="jobset", nodes=2, shm_size="16Gi"
    )
    vols, mounts = k8s.volumes(cfg)
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}} in vols
    assert {
        "name": "rdzv-secret",
        "secret": {"secretName": "train-rdzv", "defaultMode": 0o440},
    } in vols
    assert k8s.pod_spec(cfg)["securityContext"] == {
        "fsGroup": 2000,
        "fsGroupChangePolicy": "OnRootMismatch",
    }
    assert {
        "name": "DDPKIT_RDZV_SECRET_FILE",
        "value": "/etc/ddpkit/rdzv/rdzv-secret",
    } in k8s.environment(cfg)
    one = k8s.ManifestConfig(script="train.py", image="reg/train:1", kind="jobset")
    assert [v["name"] for v in k8s.volumes(one)[0]] == ["dshm"]  # one node: no rendezvous to guard
    assert "securityContext" not in k8s.pod_spec(one)  # ...and no group to give a claim


def test_a_pytorchjobs_preempted_pod_exits_with_a_code_its_exit_code_policy_retries():
    """The operator's ExitCode policy retries codes from 128 and fails 1-127: 75 would fail the
    job."""
    cfg = k8s.ManifestConfig(script="train.py", image="reg/train:1", kind="pytorchjob", nodes=2)
    (job,) = k8s.manifests(cfg)
    master = job["spec"]["pytorchReplicaSpecs"]["Master"]
    argv = master["template"]["spec"]["containers"][0]["command"]
    assert (
        master["restartPolicy"] == "ExitCode"
        and argv[argv.index("--preempted-exit-code") + 1] == "143"
    )
    # the operator's to set from the replica's
    assert "restartPolicy" not in master["template"]["spec"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kind", "mpijob"], "--kind 'mpijob': use one of trainjob, pytorchjob, jobset"),
        (["--name", "Train_Job"], "--name 'Train_Job': use 1 to 40 lowercase letters"),
        (["--memory", "32GB"], "--memory '32GB': use a Kubernetes quantity"),
        (["--nproc", "0"], "--nproc '0': use auto, gpu, or a number"),
        (["--env", "1X=2"], "--env '1X=2': use NAME=VALUE"),
        (["--memory", "500m"], "--memory '500m': use a Kubernetes quantity (32Gi"),  # half a byte
        (["--shm-size", "1500m"], "--shm-size '1500m': use a Kubernetes quantity"),
        (["--memory", "4Gi", "--shm-size", "8Gi"], "--shm-size 8Gi is more than --memory 4Gi"),
        (["--namespace", "My NS"], "--namespace 'My NS': use lowercase letters"),
        (["--secret", "Bad_Secret"], "--secret 'Bad_Secret': a Kubernetes object's name"),
        (["--pvc", "runs pvc"], "--pvc 'runs pvc': a Kubernetes object's name"),
        (["--image", ""], "--image '': give the container image"),
        (
            ["--pvc", "runs", "--run-mount", "//dev/shm"],
            "--run-mount '//dev/shm': overlaps the volume at /dev/shm",
        ),
        (["--pvc", "runs", "--run-mount", "/runs/../dev/shm/x"], "overlaps the volume at /dev/shm"),
        (
            ["--pvc", "runs", "--nodes", "2", "--run-mount", "/etc/ddpkit"],
            "overlaps the volume at /etc/ddpkit/rdzv",
        ),
        (["--kind", "jobset", "--nproc", "gpu"], "--nproc gpu: give --gpus-per-node N"),
        (["--gpus-per-node", "-1"], "--gpus-per-node -1: use 0 to 64"),
        (["--max-restarts", "-1"], "--max-restarts -1: use 0 to 1000"),
    ],
)
def test_bad_options_name_what_to_change(args, message):
    image = [] if "--image" in args else ["--image", "reg/train:1"]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        k8s.main(["--dry-run", *image, *args, "train.py"])


def test_shm_defaults_within_memory_and_run_mount_is_checked_only_with_a_claim():
    def cfg(**kw):
        return k8s.ManifestConfig(script="t.py", image="i", **kw)

    assert cfg().shm_size == "8Gi" and cfg(memory="32Gi").shm_size == "8Gi"
    assert cfg(memory="4Gi").shm_size == "2048Mi"  # 8Gi would be more than the pod may use
    assert cfg(run_mount="/dev/shm").run_mount == "/dev/shm"  # no --pvc: nothing is mounted there
    assert cfg(pvc="runs", run_mount="/data//runs/").run_mount == "/data/runs"
    # a neighbour, not inside
    assert cfg(pvc="runs", run_mount="/dev/shmx").run_mount == "/dev/shmx"


def test_a_name_made_from_the_script_is_blamed_on_the_script_not_on_name():
    with pytest.raises(ConfigError, match="the script's name gives 'job-1234.*pass --name"):
        k8s.main(
            ["--dry-run", "--image", "reg/train:1", "1234567890123456789012345678901234567890.py"]
        )


def test_a_trainjob_on_cpus_runs_ddpkit_runs_auto_not_one_process_per_cpu():
    """Trainer's own "auto" without GPUs is one process per requested CPU; ddpkit run's, up to 8."""

    def procs(*args: str) -> int | None:
        cfg = k8s.ManifestConfig(
            script="t.py", image="i", nodes=2, **dict(zip(args[::2], args[1::2]))
        )
        return k8s.manifests(cfg)[1]["spec"]["trainer"].get("numProcPerNode")

    assert (procs("cpu", "32"), procs("cpu", "7500m"), procs("cpu", "500m")) == (8, 8, 1)
    # typed; or no CPU given: Trainer's one
    assert procs("nproc", "3", "cpu", "32") == 3 and procs() is None


def test_the_file_is_written_whole_with_the_commands_to_apply_it(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert k8s.main(["--image", "reg/train:1", "--nodes", "2", "--kind", "jobset", "train.py"]) == 0
    out = capsys.readouterr().out
    assert "manifest: train.k8s.yaml" in out and "kubectl apply -f train.k8s.yaml" in out
    assert "kubectl create secret generic train-rdzv --from-literal=rdzv-secret=" in out
    assert os.listdir(tmp_path) == ["train.k8s.yaml"]
    (doc,) = yaml.safe_load_all((tmp_path / "train.k8s.yaml").read_text())
    assert doc["kind"] == "JobSet" and errors(doc) == []
