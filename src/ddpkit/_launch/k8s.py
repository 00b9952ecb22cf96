"""``ddpkit k8s``: write the Kubernetes manifest that trains a script on several pods (TrainJob,
PyTorchJob or JobSet; what each holds: :mod:`ddpkit._launch.manifests`). Nothing is sent to a
cluster: the file is applied with kubectl, after the job's secret is made.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._launch.manifests import FS_GROUP, SECRET_KEY, ManifestConfig, manifests
from ddpkit._launch.rendezvous.auth import MAKE_SECRET


def to_yaml(docs: list[dict[str, Any]]) -> str:
    """The manifests as one YAML stream, keys in the order written (PyYAML, the ``k8s`` extra)."""
    try:
        import yaml
    except ImportError:
        raise ConfigError("writing a manifest needs PyYAML: pip install 'ddpkit[k8s]'") from None

    class Dumper(yaml.SafeDumper):
        # A part shared by two places of the manifest (a PyTorchJob's Master and Worker templates)
        # is written out at each: an anchor and alias would make an edit of one silently change the
        # other.
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

_VALUE_OPTIONS = {
    "--kind", "--image", "--name", "--namespace", "--nodes", "--nproc", "--gpus-per-node", "--cpu",
    "--memory", "--shm-size", "--secret", "--pvc", "--run-mount", "--max-restarts",
    "--grace-period", "--env", "--fs-group", "--output", "-o",
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpkit k8s",
        usage="ddpkit k8s --image IMAGE [options] SCRIPT [ARGS...]",
        description=DESCRIPTION,
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    add = parser.add_argument
    add("--kind", default="trainjob", help="trainjob (default), pytorchjob or jobset")
    add(
        "--image",
        required=True,
        help="the container image, with ddpkit and the script's dependencies",
    )
    add("--name", default=None, help="the job's name (default: the script's name)")
    add("--namespace", default=None, help="the namespace (default: kubectl's)")
    add("--nodes", type=int, default=1, help="pods, one per node (default 1)")
    add("--nproc", default="auto", help="processes per node: auto (default), gpu, or a number")
    add("--gpus-per-node", type=int, default=0, help="GPUs per node (nvidia.com/gpu; default 0)")
    add("--cpu", default=None, help="CPU per node, e.g. 8 or 7500m")
    add("--memory", default=None, help="memory per node, e.g. 32Gi (includes /dev/shm)")
    add(
        "--shm-size",
        default=None,
        help="/dev/shm for the snapshots in memory (default 8Gi, or half of --memory below 16Gi)",
    )
    add("--secret", default=None, help="the Secret with the rendezvous secret (default NAME-rdzv)")
    add(
        "--pvc",
        default=None,
        help="a ReadWriteMany claim mounted on every pod, for the run directory",
    )
    add("--run-mount", default="/runs", help="where --pvc is mounted (default /runs)")
    add(
        "--max-restarts",
        type=int,
        default=3,
        help="restarts in place, and of the whole job (default 3)",
    )
    add(
        "--grace-period",
        type=int,
        default=120,
        help="seconds to save a snapshot after SIGTERM (default 120)",
    )
    add(
        "--env",
        action="append",
        default=[],
        help="NAME=VALUE for the container (repeatable; not the secret)",
    )
    add(
        "--fs-group",
        type=int,
        default=FS_GROUP,
        help="the pods' fsGroup, which may read the mounted Secret (nodes > 1; default "
        f"{FS_GROUP})",
    )
    add("-o", "--output", default=None, help="the file to write (default NAME.k8s.yaml)")
    add("--dry-run", action="store_true", help="print the manifest, write nothing")
    add("script", help="training script, as the container sees it")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from ddpkit._launch.options import split_argv

    ours, script_args = split_argv(sys.argv[1:] if argv is None else argv, _VALUE_OPTIONS)
    ns = build_parser().parse_args(ours)
    cfg = ManifestConfig(
        script=ns.script,
        script_args=script_args,
        image=ns.image,
        kind=ns.kind,
        name=ns.name,
        namespace=ns.namespace,
        nodes=ns.nodes,
        nproc=ns.nproc,
        gpus_per_node=ns.gpus_per_node,
        cpu=ns.cpu,
        memory=ns.memory,
        shm_size=ns.shm_size,
        secret=ns.secret,
        pvc=ns.pvc,
        run_mount=ns.run_mount,
        max_restarts=ns.max_restarts,
        grace_period=ns.grace_period,
        env=ns.env,
        fs_group=ns.fs_group,
    )
    text = to_yaml(manifests(cfg))
    if ns.dry_run:
        print("".join(f"# {line}\n" for line in notes(cfg, None)) + text, end="")
        return 0
    path = Path(ns.output or f"{cfg.name}.k8s.yaml")
    try:
        fs.write_atomic(
            path, ("".join(f"# {line}\n" for line in notes(cfg, str(path))) + text).encode()
        )
    except OSError as err:
        raise ConfigError(
            f"--output {str(path)[:80]!r}: cannot write there ({err.strerror or err})"
        ) from None
    print(f"manifest: {path}")
    for line in notes(cfg, str(path)):
        print(f"  {line}")
    return 0
