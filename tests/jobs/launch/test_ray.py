"""Ray Train as the engine, on a real Ray cluster: a head raylet and a worker raylet in two network
namespaces (two nodes with their own addresses), one CPU each, so the two workers of a run are on
different nodes.

Each run trains ``examples/ray_train.py``'s loop. ``ddpkit.init()`` takes Ray's process group and
says launcher ``ray``, node ranks 0 and 1, local rank 0 of 1 on each. A worker SIGKILLed after a
snapshot, and a whole worker raylet stopped and started again, each end on the bits of the
uninterrupted run, the restarted workers counting their restart. A worker node drained for
pre-emption (as a spot instance's reclaim drains it) gets a snapshot from every rank at the
Trainer's next agreement, before the node is lost, and the run ends on the same bits. Needs
``.venv-ray`` (the ``ray`` extra in a venv of its own); skipped, saying so, without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ddpkit.snapshot._folders import MARKER
from ddpkit.testing import read_records, wait_until
from tests.jobs.launch import netns
from tests.jobs.launch.netns import ROOT
from tests.trainer_checks import same_bits

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

JOB = str(ROOT / "tests" / "jobs" / "scripts" / "ray_job.py")
# Ray runs from a venv of its own (.ci/run makes it): ~500 MB that the rest of the suite does not
# need.
PYTHON = ROOT / ".venv-ray" / "bin" / "python"
RAY = str(PYTHON.with_name("ray"))
# The kills act on a run that goes on training: the instant they wait for is polled at this rate,
# not backed off.
SOON = 0.01


def _ray_env(ns: str) -> dict[str, str]:
    env = netns.node_env(secret=False) | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
    # gloo takes a node's address from its host name, which resolves to loopback here: its veth,
    # named.
    env["GLOO_SOCKET_IFNAME"] = ns[: -len("-a")] + ("-va" if ns.endswith("-a") else "-vb")
    # Ray Train's watcher asks for drained nodes every 5 s; every 0.5 s here, for a shorter test.
    return env | {"RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5"}


TOKEN = secrets.token_hex(32)


def _ray(ns: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", "netns", "exec", ns, RAY, *args],
        env=_ray_env(ns),
        capture_output=True,
        text=True,
        timeout=120,
    )


def _start_worker_node(ns: str, addr: str, head: str) -> None:
    out = _ray(ns, "start", f"--address={head}:6379", f"--node-ip-address={addr}", "--num-cpus=1",
               "--disable-usage-stats")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def cluster():
    if not PYTHON.exists():
        pytest.skip("no .venv-ray with Ray: VENV=.venv-ray bash scripts/setup.sh ray,examples")
    with netns.two_nodes(f"dray{os.getpid() % 1000}") as ((ns_a, addr_a), (ns_b, addr_b)):
        head = _ray(
            ns_a,
            "start",
            "--head",
            f"--node-ip-address={addr_a}",
            "--port=6379",
            "--num-cpus=1",
            "--include-dashboard=false",
            "--disable-usage-stats",
        )
        assert head.returncode == 0, head.stderr[-3000:]
        try:
            _start_worker_node(ns_b, addr_b, addr_a)
            yield (ns_a, addr_a), (ns_b, addr_b)
        finally:
            for ns in (ns_b, ns_a):
                _ray(ns, "stop", "--force")


def _kill_node(addr: str) -> int:
    """SIGKILL every Ray process of the node at ``addr`` (its raylet and agents name the address on
    their command line) and all they started; the number killed. ``ray stop`` would end every node
    of this machine."""
    from ddpkit._launch.proctree import descendants

    roots = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            any(arg.endswith(f"={addr}".encode()) for arg in cmdline)
            and b"start" not in cmdline[1:3]
        ):
            roots.append(int(pid))
    victims = set(roots) | {child for pid in roots for child in descendants(pid)}
    for pid in victims:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(victims)


def run(
    cluster, tmp: Path, name: str, *args: str, during=None
) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """The job on the cluster from the head node; ``during(facts folder)`` runs while it trains."""
    (ns_a, addr_a), _ = cluster
    facts = tmp / f"{name}-facts"
    facts.mkdir()
    cmd = [
        str(PYTHON),
        JOB,
        "--address",
        f"{addr_a}:6379",
        "--run-dir",
        str(tmp / name),
        "--facts",
        str(facts),
    ]
    proc = subprocess.Popen(
        ["ip", "netns", "exec", ns_a, *cmd, *args],
        env=_ray_env(ns_a),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        if during is not None:
            during(facts)
        out, _ = proc.communicate(timeout=600)
    except BaseException:
        # The driver's end ends the job's workers: a run left going would hold the cluster's CPUs
        # from the tests after it. Before it, what the run was doing is printed as evidence.
        try:
            _print_where_it_waits(facts, ns_a, addr_a)
        finally:
            proc.kill()
            out, _ = proc.communicate()
            print(out[-20000:])
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, "")
    return done, [json.loads(p.read_text()) for p in sorted(facts.glob("*.json"))]


def _print_where_it_waits(facts: Path, ns: str, addr: str) -> None:
    """Every worker of the run still alive writes its threads' stacks
    (tests/jobs/scripts/ray_job.py), printed with the cluster as Ray sees it: its nodes alive or
    dead, what holds their CPUs."""
    asked = []
    for stacks in facts.glob("stacks-*"):
        pid = int(stacks.name[len("stacks-") :])
        with contextlib.suppress(OSError):  # gone, or its pid now another's
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::"):
                os.kill(pid, signal.SIGUSR2)
                asked.append(stacks)
    with contextlib.suppress(TimeoutError):
        wait_until(lambda: all(s.stat().st_size for s in asked), 10, what="the stacks")
    for stacks in asked:
        print(f"== {stacks.name}\n{stacks.read_text()}")
    try:
        status = _ray(ns, "status", f"--address={addr}:6379")
        print(f"== ray status\n{status.stdout}{status.stderr[-2000:]}")
    except subprocess.TimeoutExpired:
        print("== ray status: no answer in 120 s")


def weights(run_dir: Path):
    return netns.weights(run_dir)


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray")
    started = time.monotonic()
    done, facts = run(cluster, tmp, "uninterrupted")
    print(f"\na 2-raylet Ray Train run of 4 epochs: {time.monotonic() - started:.1f} s")
    assert done.returncode == 0, done.stdout[-5000:]
    return weights(tmp / "uninterrupted"), facts


def test_ddpkit_reads_rays_ranks_across_nodes(cluster, uninterrupted):
    _, facts = uninterrupted
    (ns_a, addr_a), (ns_b, addr_b) = cluster
    assert {f["launcher"] for f in facts} == {"ray"} and sorted(f["rank"] for f in facts) == [0, 1]
    assert {(f["local_rank"], f["local_world_size"], f["world_size"]) for f in facts} == {(0, 1, 2)}
    assert {f["ip"] for f in facts} == {addr_a, addr_b} and sorted(
        f["node_rank"] for f in facts
    ) == [0, 1]
    assert {f["restart_count"] for f in facts} == {0}


def test_a_worker_killed_resumes_to_the_bits_of_the_uninterrupted_run(
    cluster, uninterrupted, tmp_path
):
    done, facts = run(cluster, tmp_path, "killed", "--kill-rank", "1")
    assert done.returncode == 0, done.stdout[-5000:]
    # Ray restarted both
    assert {(f["rank"], f["restart_count"]) for f in facts} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    resumes = [r for r in read_records(tmp_path / "killed") if r.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] >= 10 and resumes[0]["restart_count"] == 1, (
        resumes
    )
    assert same_bits(weights(tmp_path / "killed"), uninterrupted[0])


def test_a_worker_node_lost_and_back_resumes_to_the_same_bits(cluster, uninterrupted, tmp_path):
    (_, addr_a), (ns_b, addr_b) = cluster

    def lose_node_b(facts: Path) -> None:
        marker = tmp_path / "node-lost" / "snapshots" / "step-00000010" / "complete.json"
        wait_until(marker.exists, 240, what="the run's snapshot at step 10", max_interval=SOON)
        # the raylet and every Ray process of node b, workers included
        assert _kill_node(addr_b) > 0
        _start_worker_node(ns_b, addr_b, addr_a)  # the node comes back (a replacement)

    done, facts = run(cluster, tmp_path, "node-lost", during=lose_node_b)
    assert done.returncode == 0, done.stdout[-5000:]
    assert max(f["restart_count"] for f in facts) >= 1
    assert same_bits(weights(tmp_path / "node-lost"), uninterrupted[0])


def _events(run_dir: Path) -> list[dict]:
    return [r for r in read_records(run_dir) if "event" in r]


def _snapshot_whole(run_dir: Path, step: int) -> bool:
    """Whether the snapshot of ``step`` is whole on disk: its marker, which rank 0 writes once every
    rank's files are written (its ``snapshot`` event is recorded before the write, with the state
    it holds)."""
    return (run_dir / "snapshots" / f"step-{step:08d}" / MARKER).exists()


def test_a_node_drained_for_preemption_gets_a_snapshot_at_once_then_resumes_to_the_same_bits(
    cluster, uninterrupted, tmp_path
):
    """Ray's notice reaches the Trainer (its workers train in a thread, where no signal arrives):
    every rank snapshots at the next agreement (step 20; the loop waits at step 11 until the notice
    is out), training goes on, the drained node is lost, and Ray's restart resumes from a snapshot
    at least that new."""
    (_, addr_a), (ns_b, addr_b) = cluster
    run_dir = tmp_path / "drained"

    def drain_node_b(facts: Path) -> None:
        deadline = time.monotonic() + 240
        wait_until(
            (facts / "holding").exists, 240, what="the run to reach step 11", max_interval=SOON
        )
        node_b = next(json.loads(p.read_text())["node_id"] for p in facts.glob("*.json")
                      if json.loads(p.read_text())["ip"] == addr_b)  # fmt: skip
        drained = _ray(
            ns_b,
            "drain-node",
            f"--address={addr_a}:6379",
            f"--node-id={node_b}",
            "--reason=DRAIN_NODE_REASON_PREEMPTION",
            "--reason-message=spot instance reclaimed",
            "--deadline-remaining-seconds=10",
        )
        assert drained.returncode == 0, drained.stderr[-3000:]
        left = max(0.0, deadline - time.monotonic())  # one deadline for both waits
        wait_until(
            lambda: _snapshot_whole(run_dir, 20),
            left,
            what="a snapshot after Ray's pre-emption notice",
            max_interval=SOON,
        )
        assert _kill_node(addr_b) > 0  # the reclaim
        _start_worker_node(ns_b, addr_b, addr_a)  # its replacement

    # Snapshots at epoch ends only (step 22, ...): the one at step 20 is the notice's.
    done, facts = run(cluster, tmp_path, "drained", "--hold-for-notice", "--snapshot-every", "1000",
                      during=drain_node_b)  # fmt: skip
    assert done.returncode == 0, done.stdout[-5000:]
    events = _events(run_dir)
    notices = [(e["step"], e["notice"]) for e in events if e["event"] == "preemption_notice"]
    assert (
        len(notices) == 1
        and notices[0][0] == 20
        and "Ray Train's pre-emption notice" in notices[0][1]
    ), events
    assert [e["step"] for e in events if e["event"] == "snapshot"][0] == 20
    resumes = [e for e in events if e["event"] == "resume"]
    assert len(resumes) == 1 and resumes[0]["step"] >= 20 and resumes[0]["restart_count"] == 1, (
        resumes
    )
    assert same_bits(weights(run_dir), uninterrupted[0])
