"""``ddpkit k8s``: the Kubernetes manifests that train a script on several pods, one ``ddpkit run``
per pod (a TrainJob and its TrainingRuntime, a PyTorchJob, or a JobSet), written to a file to apply
with kubectl; nothing is sent to a cluster. What each holds and why: docs/kubernetes-and-ray.md.
"""

from __future__ import annotations

import math
import posixpath
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from ddpkit import _fs as fs
from ddpkit._errors import PREEMPTED_EXIT_CODE, ConfigError
from ddpkit._launch.cli import options
from ddpkit._launch.cli.options import argument
from ddpkit._launch.rendezvous.auth import MAKE_SECRET, SECRET_ENV, SECRET_FILE_ENV

Kind = Literal["trainjob", "pytorchjob", "jobset"]
KINDS: tuple[str, ...] = get_args(Kind)
PORT = 29500  # the rendezvous port on pod 0: torchrun's default, and Trainer's
SECRET_KEY = "rdzv-secret"
SECRET_DIR = "/etc/ddpkit/rdzv"
SECRET_MODE = 0o440  # with the pods' fsGroup: their containers' alone, as load_secret accepts
FS_GROUP = 2000
# The operators set their variables in the container of this name only.
CONTAINER = {"trainjob": "node", "pytorchjob": "pytorch", "jobset": "node"}
PYTORCHJOB_PREEMPTED = 128 + 15  # SIGTERM's code, which a PyTorchJob's ExitCode policy retries
JOIN_TIMEOUT = 600  # seconds the nodes wait for a recreated pod (scheduled, its image pulled)
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_SCALE = {"m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
_SCALE |= {f"{p}i": 1024.0 ** (i + 1) for i, p in enumerate("KMGTPE")}
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(
    r"(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)


def quantity(option: str, value: str, *, whole: bool = False) -> float:
    """A Kubernetes quantity's value (``7500m``: 7.5); ``whole``: bytes, refused in millis."""
    match = _QUANTITY.fullmatch(value)
    if not match or whole and match[2] == "m":
        example = "32Gi, 512Mi" if whole else "8, 7500m"
        raise ConfigError(f"{option} {value[:40]!r}: use a Kubernetes quantity ({example})")
    return float(match[1]) * _SCALE[match[2] or ""]


@dataclass(kw_only=True)
class ManifestConfig:
    """What ``ddpkit k8s`` writes."""

    script: str
    """The training script, as the container sees it."""
    script_args: list[str] = field(default_factory=list)
    image: str
    kind: Kind = "trainjob"
    name: str | None = None
    """The job's name (a DNS label); the script's file name by default."""
    namespace: str | None = None
    nodes: int = 1
    nproc: str = "auto"
    gpus_per_node: int = 0
    cpu: str | None = None
    memory: str | None = None
    shm_size: str | None = None
    """The ``/dev/shm`` volume's size limit: 8Gi, or half of ``memory`` below 16Gi, by default."""
    secret: str | None = None
    """The Secret holding the rendezvous secret (nodes > 1); ``<name>-rdzv`` by default."""
    pvc: str | None = None
    run_mount: str = "/runs"
    max_restarts: int = 3
    grace_period: int = 120
    env: list[str] = field(default_factory=list)
    fs_group: int = FS_GROUP
    runtime: str = "torch-distributed"
    """TrainJob: the ClusterTrainingRuntime its own runtime starts from (named in a label)."""

    def __post_init__(self) -> None:
        self._check_names()
        self._check_sizes()
        self._check_env()
        self._check_mounts()

    def _check_names(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"--kind {self.kind!r}: use one of {', '.join(KINDS)}")
        named = self.name is not None
        self.name = self.name or _dns_label(Path(self.script).stem)
        if not re.fullmatch(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?", self.name):
            given = (
                f"--name {self.name[:60]!r}"
                if named
                else f"the script's name gives {self.name[:60]!r}; pass --name"
            )
            raise ConfigError(
                f"{given}: use 1 to 40 lowercase letters, digits or '-', starting with a letter "
                "(the pods' host names are built from it)"
            )
        if self.namespace is not None and not _DNS_LABEL.fullmatch(self.namespace):
            raise ConfigError(
                f"--namespace {self.namespace[:70]!r}: use lowercase letters, digits and '-' (63 "
                "at most)"
            )
        for flag, value in (("--secret", self.secret), ("--pvc", self.pvc)):
            if value is not None and not _DNS_SUBDOMAIN.fullmatch(value):
                raise ConfigError(
                    f"{flag} {value[:70]!r}: a Kubernetes object's name: lowercase letters, "
                    "digits, '-' and '.'"
                )
        if not self.image.strip() or any(c.isspace() for c in self.image):
            raise ConfigError(
                f"--image {self.image[:70]!r}: give the container image, as registry/name:tag"
            )

    def _check_sizes(self) -> None:
        if not 1 <= self.nodes <= 10_000:
            raise ConfigError(f"--nodes {self.nodes}: use 1 to 10000")
        if not (self.nproc in ("auto", "gpu") or re.fullmatch("[1-9][0-9]{0,3}", self.nproc)):
            raise ConfigError(
                f"--nproc {self.nproc[:20]!r}: use auto, gpu, or a number of processes per node"
            )
        if self.cpu is not None:
            quantity("--cpu", self.cpu)
        memory = None if self.memory is None else quantity("--memory", self.memory, whole=True)
        given = self.shm_size is not None
        if self.shm_size is None:  # within the memory it counts against
            half = None if memory is None else memory / 2
            self.shm_size = (
                "8Gi" if half is None or half >= 8 * 2**30 else f"{max(1, int(half // 2**20))}Mi"
            )
        # (half of a tiny --memory rounds up to 1Mi, more than the limit itself)
        shm = quantity("--shm-size", self.shm_size, whole=True)
        if memory is not None and shm > memory:
            raise ConfigError(
                f"--shm-size {self.shm_size} is more than --memory {self.memory}, which /dev/shm "
                "counts against: raise --memory or lower --shm-size"
                if given
                else f"--memory {self.memory} is less than the default /dev/shm of "
                f"{self.shm_size}, which counts against it: raise --memory, or give a smaller "
                "--shm-size"
            )
        if not 0 <= self.gpus_per_node <= 64:
            raise ConfigError(f"--gpus-per-node {self.gpus_per_node}: use 0 to 64")
        if self.nproc == "gpu" and not self.gpus_per_node:
            raise ConfigError(
                "--nproc gpu: give --gpus-per-node N (the pods get no GPU without it)"
            )
        if not 0 <= self.max_restarts <= 1000:
            raise ConfigError(f"--max-restarts {self.max_restarts}: use 0 to 1000")
        if not 10 <= self.grace_period <= 86_400:
            raise ConfigError(f"--grace-period {self.grace_period}: 10 to 86400 seconds")
        if not 1 <= self.fs_group < 2**31:
            raise ConfigError(f"--fs-group {self.fs_group}: a group id, 1 to 2147483647")

    def _check_mounts(self) -> None:
        if not self.run_mount.startswith("/"):
            raise ConfigError(f"--run-mount {self.run_mount!r}: an absolute path in the container")
        # --pvc's mount may not overlap another volume: one inside the other would hide it
        mount = posixpath.normpath("/" + self.run_mount.lstrip("/"))
        others = ["/dev/shm"] + ([SECRET_DIR] if self.nodes > 1 else [])
        for other in others if self.pvc else []:
            if (
                mount == other
                or (mount + "/").startswith(other + "/")
                or (other + "/").startswith(mount + "/")
            ):
                raise ConfigError(
                    f"--run-mount {self.run_mount!r}: overlaps the volume at {other}; mount the "
                    "runs elsewhere (default /runs)"
                )
        self.run_mount = mount

    @property
    def secret_name(self) -> str:
        return self.secret or f"{self.name}-rdzv"

    def _check_env(self) -> None:
        """Each ``--env`` a NAME=VALUE, not the secret, each name once (ours included)."""
        ours = {SECRET_FILE_ENV: f"{SECRET_DIR}/{SECRET_KEY}"} if self.nodes > 1 else {}
        seen: set[str] = set()
        for item in self.env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", item):
                raise ConfigError(f"--env {item[:60]!r}: use NAME=VALUE")
            name = item.partition("=")[0]
            if name == SECRET_ENV:  # never in a manifest, which whoever can `get` it reads
                raise ConfigError(
                    f"--env {name}=...: the manifest would hold the rendezvous secret in clear, "
                    "for anyone who can read the job; drop it: the pods read the secret from the "
                    f"Secret {self.secret_name} that ddpkit mounts (kubectl create secret, printed "
                    "with the manifest)"
                )
            if name in ours:
                raise ConfigError(
                    f"--env {name}: ddpkit sets it to {ours[name]}, where the Secret "
                    f"{self.secret_name} is mounted; drop it (--secret NAME names another Secret)"
                )
            if name in seen:
                raise ConfigError(f"--env {name} is given twice: give each name once")
            seen.add(name)


def _dns_label(text: str) -> str:
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:40].rstrip("-")
    return label if label[:1].isalpha() else f"job-{label}".rstrip("-")


def node0_host(cfg: ManifestConfig) -> str:
    """Pod 0's name as the other pods resolve it: the operator's service, or JobSet's host name."""
    if cfg.kind == "pytorchjob":
        return f"{cfg.name}-master-0"
    # JobSet (and Trainer's JobSet): <jobset>-<job>-<index>-<pod>
    return f"{cfg.name}-node-0-0.{cfg.name}"


def command(cfg: ManifestConfig) -> list[str]:
    """The container's command: ``ddpkit run`` with what the operator does not hand over."""
    argv = ["ddpkit", "run", "--max-restarts", str(cfg.max_restarts)]
    if cfg.kind == "pytorchjob":
        argv += ["--preempted-exit-code", str(PYTORCHJOB_PREEMPTED)]
    if cfg.kind == "jobset":
        argv += ["--nnodes", str(cfg.nodes), "--nproc", cfg.nproc]
        if cfg.nodes > 1:
            argv += ["--rdzv-endpoint", f"{node0_host(cfg)}:{PORT}"]
    if cfg.nodes > 1:
        argv += ["--join-timeout", str(JOIN_TIMEOUT)]
    return argv + [cfg.script, *cfg.script_args]


def _resources(cfg: ManifestConfig) -> dict[str, Any]:
    given = {"cpu": cfg.cpu, "memory": cfg.memory, "nvidia.com/gpu": cfg.gpus_per_node}
    amounts = {name: value for name, value in given.items() if value}
    return {"limits": amounts, "requests": dict(amounts)} if amounts else {}


def volumes(cfg: ManifestConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the pod's volumes, the container's mounts)."""
    vols: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.shm_size}}
    ]
    mounts: list[dict[str, Any]] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if cfg.nodes > 1:
        secret = {"secretName": cfg.secret_name, "defaultMode": SECRET_MODE}
        vols.append({"name": "rdzv-secret", "secret": secret})
        mounts.append({"name": "rdzv-secret", "mountPath": SECRET_DIR, "readOnly": True})
    if cfg.pvc:
        vols.append({"name": "runs", "persistentVolumeClaim": {"claimName": cfg.pvc}})
        mounts.append({"name": "runs", "mountPath": cfg.run_mount})
    return vols, mounts


def environment(cfg: ManifestConfig) -> list[dict[str, str]]:
    pairs = (item.partition("=") for item in cfg.env)
    env = [{"name": name, "value": value} for name, _, value in pairs]
    if cfg.nodes > 1:
        env.append({"name": SECRET_FILE_ENV, "value": f"{SECRET_DIR}/{SECRET_KEY}"})
    return env


def container(cfg: ManifestConfig) -> dict[str, Any]:
    spec: dict[str, Any] = {"name": CONTAINER[cfg.kind], "image": cfg.image}
    spec["command"] = command(cfg)
    if env := environment(cfg):
        spec["env"] = env
    # the operator takes MASTER_PORT from the master's port of this name
    if cfg.kind == "pytorchjob":
        spec["ports"] = [{"name": "pytorchjob-port", "containerPort": PORT}]
    elif cfg.nodes > 1 and cfg.kind == "jobset":  # Trainer adds its own
        spec["ports"] = [{"name": "rdzv", "containerPort": PORT}]
    if resources := _resources(cfg):
        spec["resources"] = resources
    spec["volumeMounts"] = volumes(cfg)[1]
    return spec


def pod_spec(cfg: ManifestConfig) -> dict[str, Any]:
    spec: dict[str, Any] = {"restartPolicy": "Never"}  # a Job's pod failure policy needs it
    if cfg.kind == "pytorchjob":  # the operator sets it from the replica's own restart policy
        spec = {}
    if cfg.nodes > 1:  # the group that reads the Secret; a --pvc claim given it once, not per file
        spec["securityContext"] = {"fsGroup": cfg.fs_group, "fsGroupChangePolicy": "OnRootMismatch"}
    return spec | {
        "terminationGracePeriodSeconds": cfg.grace_period,
        "containers": [container(cfg)],
        "volumes": volumes(cfg)[0],
    }


def pod_failure_policy(cfg: ManifestConfig) -> dict[str, Any]:
    """The Job's: 75 and disruption recreate the pod uncounted; the script's error fails it."""

    def on_codes(action: str, operator: str, values: list[int]) -> dict[str, Any]:
        on = {"containerName": CONTAINER[cfg.kind], "operator": operator, "values": values}
        return {"action": action, "onExitCodes": on}

    return {
        "rules": [
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
            on_codes("Ignore", "In", [PREEMPTED_EXIT_CODE]),
            on_codes("FailJob", "NotIn", [0, PREEMPTED_EXIT_CODE]),
        ]
    }


def jobset_spec(cfg: ManifestConfig) -> dict[str, Any]:
    """A JobSet of one indexed Job of ``nodes`` pods: the script's error fails it, else restarts."""
    job = {
        "parallelism": cfg.nodes,
        "completions": cfg.nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "podFailurePolicy": pod_failure_policy(cfg),
        "template": {"spec": pod_spec(cfg)},
    }
    script_error = {
        "name": "script-error",
        "action": "FailJobSet",
        "onJobFailureReasons": ["PodFailurePolicy"],
    }
    return {
        "network": {"enableDNSHostnames": True},
        "failurePolicy": {"maxRestarts": cfg.max_restarts, "rules": [script_error]},
        "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": job}}],
    }


def _resource(
    cfg: ManifestConfig, api: str, kind: str, spec: Any, name: str = "", **labels: str
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name or cfg.name,
        "labels": {"app.kubernetes.io/created-by": "ddpkit", **labels},
    }
    if cfg.namespace:
        meta["namespace"] = cfg.namespace
    return {"apiVersion": api, "kind": kind, "metadata": meta, "spec": spec}


def manifests(cfg: ManifestConfig) -> list[dict[str, Any]]:
    """The resources to apply, in order."""
    if cfg.kind == "jobset":
        return [_resource(cfg, "jobset.x-k8s.io/v1alpha2", "JobSet", jobset_spec(cfg))]
    if cfg.kind == "pytorchjob":
        return [pytorchjob(cfg)]
    return trainjob(cfg)


def pytorchjob(cfg: ManifestConfig) -> dict[str, Any]:
    # ExitCode: a pod is recreated for codes from 128 (PYTORCHJOB_PREEMPTED), else the job fails
    replica = {"restartPolicy": "ExitCode", "template": {"spec": pod_spec(cfg)}}
    specs = {"Master": {"replicas": 1} | replica}
    if cfg.nodes > 1:
        specs["Worker"] = {"replicas": cfg.nodes - 1} | replica
    spec = {
        "nprocPerNode": cfg.nproc,
        "runPolicy": {"backoffLimit": cfg.max_restarts, "cleanPodPolicy": "None"},
        "pytorchReplicaSpecs": specs,
    }
    return _resource(cfg, "kubeflow.org/v1", "PyTorchJob", spec)


TRAINER = "trainer.kubeflow.org"


def trainjob(cfg: ManifestConfig) -> list[dict[str, Any]]:
    """A TrainingRuntime of the job's own (volumes, failure policies) and its TrainJob."""
    runtime_name = f"{cfg.name}-ddpkit"
    jobset = jobset_spec(cfg)
    # Trainer sizes the node Job from the TrainJob, and finds it by the ancestor label
    node_job = jobset["replicatedJobs"][0]
    for key in ("parallelism", "completions", "completionMode"):
        del node_job["template"]["spec"][key]
    del node_job["replicas"]
    node_job["template"]["metadata"] = {"labels": {f"{TRAINER}/trainjob-ancestor-step": "trainer"}}
    runtime_spec = {"mlPolicy": {"numNodes": cfg.nodes, "torch": {}}, "template": {"spec": jobset}}
    runtime = _resource(
        cfg, f"{TRAINER}/v1alpha1", "TrainingRuntime", runtime_spec, runtime_name,
        **{f"{TRAINER}/framework": "torch"},
    )  # fmt: skip
    trainer: dict[str, Any] = {"image": cfg.image, "command": command(cfg), "numNodes": cfg.nodes}
    if cfg.nproc.isdigit():
        trainer["numProcPerNode"] = int(cfg.nproc)
    elif cfg.nproc == "auto" and not cfg.gpus_per_node and cfg.cpu:
        # ddpkit run's auto (one per core up to 8), not Trainer's (one per requested CPU)
        trainer["numProcPerNode"] = max(1, min(math.ceil(quantity("--cpu", cfg.cpu)), 8))
    if resources := _resources(cfg):
        trainer["resourcesPerNode"] = resources
    if env := environment(cfg):
        trainer["env"] = env
    ref = {"name": runtime_name, "apiGroup": TRAINER, "kind": "TrainingRuntime"}
    spec = {"runtimeRef": ref, "trainer": trainer}
    return [runtime, _resource(cfg, f"{TRAINER}/v1alpha1", "TrainJob", spec)]


def to_yaml(docs: list[dict[str, Any]]) -> str:
    """The manifests as one YAML stream, keys in the order written (PyYAML, the ``k8s`` extra)."""
    try:
        import yaml
    except ImportError:
        raise ConfigError("writing a manifest needs PyYAML: pip install 'ddpkit[k8s]'") from None

    class Dumper(yaml.SafeDumper):
        # a part shared by two places is written at each: an alias would tie their edits together
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(docs, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=100)


def notes(cfg: ManifestConfig, path: str | None) -> list[str]:
    """What to do with the manifest, as comment lines."""
    lines = []
    if cfg.nodes > 1:
        lines.append(
            f"once: kubectl create secret generic {cfg.secret_name} "
            f'--from-literal={SECRET_KEY}="$({MAKE_SECRET})"'
            + (f" -n {cfg.namespace}" if cfg.namespace else "")
        )
    if path:
        lines.append(f"then: kubectl apply -f {path}")
    if not cfg.pvc:
        lines.append(
            "no --pvc: the run directory is in the container, so a recreated pod starts from its "
            "memory snapshot only if it kept it, else from the beginning; give a ReadWriteMany "
            "claim for disk snapshots"
        )
    return lines


DESCRIPTION = """Write the Kubernetes manifest that trains SCRIPT on NODES pods, one `ddpkit run`
per pod.

TrainJob (Kubeflow Trainer v2) by default; PyTorchJob (training-operator v1) or JobSet with --kind.
Each pod gets a /dev/shm volume for the snapshots in memory and, across nodes, the job's secret from
a Kubernetes Secret. A pod stopped by a signal after its snapshot (exit code 75) or disrupted (a
node drained or lost) is recreated and the job resumes; the script's error fails the job. Nothing is
sent to a cluster: apply the file with kubectl. Everything after SCRIPT is passed to the script."""

EXAMPLES = """examples:
  ddpkit k8s --image registry/train:1 --nodes 4 --gpus-per-node 8 --pvc runs train.py --lr 0.1
  ddpkit k8s --kind jobset --image registry/train:1 --nodes 2 --cpu 8 --memory 32Gi train.py
  ddpkit k8s --dry-run --image registry/train:1 train.py     # print, write nothing"""

OPTIONS = [
    argument("--kind", default="trainjob", help="trainjob (default), pytorchjob or jobset"),
    argument("--image", required=True,
             help="the container image, with ddpkit and the script's dependencies"),
    argument("--name", default=None, help="the job's name (default: the script's name)"),
    argument("--namespace", default=None, help="the namespace (default: kubectl's)"),
    argument("--nodes", type=int, default=1, help="pods, one per node (default 1)"),
    argument("--nproc", default="auto",
             help="processes per node: auto (default), gpu, or a number"),
    argument("--gpus-per-node", type=int, default=0,
             help="GPUs per node (nvidia.com/gpu; default 0)"),
    argument("--cpu", default=None, help="CPU per node, e.g. 8 or 7500m"),
    argument("--memory", default=None, help="memory per node, e.g. 32Gi (includes /dev/shm)"),
    argument("--shm-size", default=None,
             help="/dev/shm for the snapshots in memory (default 8Gi, or half of --memory below "
             "16Gi)"),
    argument("--secret", default=None,
             help="the Secret with the rendezvous secret (default NAME-rdzv)"),
    argument("--pvc", default=None,
             help="a ReadWriteMany claim mounted on every pod, for the run directory"),
    argument("--run-mount", default="/runs", help="where --pvc is mounted (default /runs)"),
    argument("--max-restarts", type=int, default=3,
             help="restarts in place, and of the whole job (default 3)"),
    argument("--grace-period", type=int, default=120,
             help="seconds to save a snapshot after SIGTERM (default 120)"),
    argument("--env", action="append", default=[],
             help="NAME=VALUE for the container (repeatable; not the secret)"),
    argument("--fs-group", type=int, default=FS_GROUP,
             help="the pods' fsGroup, which may read the mounted Secret (nodes > 1; default "
             f"{FS_GROUP})"),
    argument("-o", "--output", default=None, help="the file to write (default NAME.k8s.yaml)"),
    argument("--dry-run", action="store_true", help="print the manifest, write nothing"),
    argument("script", help="training script, as the container sees it"),
]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    usage = "ddpkit k8s --image IMAGE [options] SCRIPT [ARGS...]"
    parser = options.command_parser("ddpkit k8s", usage, DESCRIPTION, EXAMPLES, OPTIONS)
    ns, script_args = options.parse_command(parser, OPTIONS, sys.argv[1:] if argv is None else argv)
    cfg = options.config_from(ManifestConfig, ns, script_args)
    path = None if ns.dry_run else Path(ns.output or f"{cfg.name}.k8s.yaml")
    said = notes(cfg, None if path is None else str(path))
    text = "".join(f"# {line}\n" for line in said) + to_yaml(manifests(cfg))
    if path is None:
        print(text, end="")
        return 0
    try:
        fs.write_atomic(path, text.encode())
    except OSError as err:
        raise ConfigError(
            f"--output {str(path)[:80]!r}: cannot write there ({err.strerror or err})"
        ) from None
    print(f"manifest: {path}")
    for line in said:
        print(f"  {line}")
    return 0
