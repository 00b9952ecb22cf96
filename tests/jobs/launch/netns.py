"""Nodes as network namespaces (``scripts/netns_nodes.sh``): the helpers the multi-node and
Kubernetes jobs share. A node's own ``/etc/hosts`` is ``/etc/netns/<namespace>/hosts``, which
``ip netns exec`` mounts over ``/etc/hosts``: how a pod's names (a headless service's DNS names, its
own host name) are given here."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from tests.jobs.conftest import clean_environ
from tests.trainer_checks import newest_snapshot

ROOT = Path(__file__).resolve().parents[3]
DDPKIT = [sys.executable, "-m", "ddpkit.cli"]
SECRET = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90"


def unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are a Linux feature"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None and shutil.which("apt-get") is None:
        return "needs iproute2 (ip), and apt-get is not there to install it"
    return None


@contextmanager
def two_nodes(name: str) -> Iterator[list[tuple[str, str]]]:
    """[(namespace, address)] of nodes a and b; skips where the machine cannot make them."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    script = str(ROOT / "scripts" / "netns_nodes.sh")
    up = subprocess.run(["bash", script, "up", name], capture_output=True, text=True, timeout=300)
    if up.returncode != 0 and "Operation not permitted" in up.stderr:
        pytest.skip(f"this machine does not allow network namespaces: {up.stderr.strip()}")
    assert up.returncode == 0, up.stderr
    try:
        yield [(line.split()[0], line.split()[1]) for line in up.stdout.splitlines()]
    finally:
        subprocess.run(["bash", script, "down", name], timeout=60)


@contextmanager
def hosts_files(names: dict[str, dict[str, str]]) -> Iterator[None]:
    """``/etc/hosts`` of each namespace: ``{namespace: {host name: address}}``, removed
    afterwards."""
    made = []
    try:
        for ns, entries in names.items():
            folder = Path("/etc/netns") / ns
            folder.mkdir(parents=True, exist_ok=True)
            made.append(folder)
            lines = ["127.0.0.1 localhost"] + [f"{addr} {host}" for host, addr in entries.items()]
            (folder / "hosts").write_text("\n".join(lines) + "\n")
        yield
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


def node_env(threads: int = 1, *, secret: bool = True) -> dict[str, str]:
    """A node's environment: :func:`~tests.jobs.conftest.clean_environ` at ``threads`` intra-op
    threads (the launcher's default splits the node's cores between its processes, which differs
    between one node of 2 processes and two nodes of 1), without what makes a process a pod's or
    names a network interface, output unbuffered; with the job's rendezvous secret unless
    ``secret=False``."""
    env = clean_environ(threads)
    for name in ("KUBERNETES_SERVICE_HOST", "JOB_COMPLETION_INDEX", "GLOO_SOCKET_IFNAME"):
        env.pop(name, None)
    env = {k: v for k, v in env.items() if not k.startswith("PET_")}
    return env | {"PYTHONUNBUFFERED": "1"} | ({"DDPKIT_RDZV_SECRET": SECRET} if secret else {})


def on(
    ns: str, argv: list[str], cwd: Path, log: str, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """``argv`` started on node ``ns`` in a session of its own, its output to ``cwd/log``; ``env``
    defaults to :func:`node_env`."""
    with open(cwd / log, "w") as out:
        return subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv],
            cwd=cwd,
            env=node_env() if env is None else env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def finish(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Exit codes, None for a process still running after ``timeout`` (then killed with all it
    started)."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return codes


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return newest_snapshot(run_dir)[1]
