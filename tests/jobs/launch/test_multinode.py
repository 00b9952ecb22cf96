"""Several nodes for real: two network namespaces joined by a veth pair are two hosts with their own
addresses.

``ddpkit run --nnodes 2 --rdzv-endpoint HOST:PORT`` on each, with the job's secret in
``DDPKIT_RDZV_SECRET``, and nothing else: which node hosts the rendezvous, each node's own address
and its network interface are worked out by the launcher. Who else gets in: nobody, tested from the
other namespace as an outsider.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from ddpkit.testing import read_records, run_job, wait_until
from tests.jobs.launch import netns
from tests.jobs.launch.netns import DDPKIT, ROOT
from tests.trainer_checks import same_bits

pytestmark = pytest.mark.slow

DIGITS = str(ROOT / "examples" / "digits_trainer.py")


@pytest.fixture(scope="module")
def nodes():
    """[(namespace, address), (namespace, address)]: node a, then node b."""
    with netns.two_nodes(f"dk{os.getpid() % 100000}") as pair:
        yield pair


def test_two_nodes_train_the_digits_to_the_weights_of_one_node(nodes, tmp_path):
    (ns_a, addr_a), (ns_b, _) = nodes
    flags = ["run", "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", f"{addr_a}:29400"]
    job = [DIGITS, "--run-dir", "runs/two", "--epochs", "1"]
    procs = [netns.on(ns, DDPKIT + flags + job, tmp_path, f"{ns}.log") for ns in (ns_a, ns_b)]
    codes = netns.finish(procs, timeout=300)
    logs = {ns: (tmp_path / f"{ns}.log").read_text() for ns in (ns_a, ns_b)}
    assert codes == [0, 0], logs
    assert "test accuracy" in logs[ns_a] + logs[ns_b]

    one = run_job(
        DIGITS, "--run-dir", "runs/one", "--epochs", "1", env=netns.node_env(), cwd=tmp_path,
        timeout=300,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr[-3000:]
    assert same_bits(netns.weights(tmp_path / "runs/two"), netns.weights(tmp_path / "runs/one"))

    # Control: equality is not a given. The same one-node job at another intra-op thread count (all
    # else equal) sums in another order and ends on different weights.
    other = run_job(
        DIGITS, "--run-dir", "runs/threads", "--epochs", "1", env=netns.node_env(2), cwd=tmp_path,
        timeout=300,
    )  # fmt: skip
    assert other.returncode == 0, other.stderr[-3000:]
    assert not same_bits(
        netns.weights(tmp_path / "runs/threads"), netns.weights(tmp_path / "runs/one")
    )


def test_a_wrong_endpoint_fails_fast_with_a_clear_message(nodes, tmp_path):
    (ns_a, addr_a), (ns_b, _) = nodes
    nobody = addr_a.rsplit(".", 1)[0] + ".9"  # in the subnet, but no node has it
    job = ["--nproc", "1", DIGITS, "--epochs", "1"]
    out = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            ns_b,
            *DDPKIT,
            "run",
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            f"{nobody}:29400",
            *job,
        ],
        env=netns.node_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert "rendezvous" in out.stderr and nobody in out.stderr and "Traceback" not in out.stderr
    assert "unreachable" in out.stderr or "did not answer" in out.stderr

    # The right host, but the node that should host the rendezvous was never started.
    out = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            ns_b,
            *DDPKIT,
            "run",
            "--nnodes",
            "2",
            "--join-timeout",
            "3",
            "--rdzv-endpoint",
            f"{addr_a}:29400",
            *job,
        ],
        env=netns.node_env(),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert (
        f"the rendezvous at {addr_a}:29400 did not answer within 3 s (connection refused"
        in out.stderr
    )

    # Control: torchrun given the wrong endpoint keeps trying (its join timeout is 10 minutes).
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{nobody}:29400",
        DIGITS,
        "--epochs",
        "1",
    ]
    assert netns.finish([netns.on(ns_b, torchrun, tmp_path, "torchrun.log")], timeout=20) == [None]


PROBE = str(ROOT / "tests" / "jobs" / "scripts" / "launch_probe.py")


def _iptables() -> str:
    if shutil.which("iptables") is None and shutil.which("apt-get") is not None:
        subprocess.run(
            # one apt-get at a time, as scripts/slurm_cluster.sh and netns_nodes.sh take the same
            # lock
            "flock -w 900 /tmp/ddpkit-apt.lock sh -c 'apt-get update -qq && "
            "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iptables'",
            shell=True,
            capture_output=True,
            timeout=600,
        )
    if shutil.which("iptables") is None:
        pytest.skip("a firewall rule needs iptables, and apt-get could not install it")
    return "iptables"


@pytest.mark.timeout(900)  # apt-get may install iptables first
def test_a_firewall_that_drops_the_rendezvous_port_is_named_within_the_join_timeout(
    nodes, tmp_path
):
    (ns_a, addr_a), (ns_b, _) = nodes
    veth_a = ns_a[: -len("-a")] + "-va"  # scripts/netns_nodes.sh's interface of node a
    port = "29402"
    flags = ["run", "--nnodes", "2", "--nproc", "1", "--rdzv-endpoint", f"{addr_a}:{port}"]
    rule = ["INPUT", "-i", veth_a, "-p", "tcp", "--dport", port, "-j", "DROP"]
    fw = _iptables()
    added = subprocess.run(
        ["ip", "netns", "exec", ns_a, fw, "-A", *rule], capture_output=True, text=True, timeout=30
    )
    if added.returncode != 0:
        pytest.skip(f"iptables cannot add a rule here: {added.stderr.strip()}")
    # hosts the rendezvous, behind the rule
    host = netns.on(ns_a, DDPKIT + flags + [PROBE, "info"], tmp_path, "a.log")
    try:
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns_b,
                *DDPKIT,
                *flags[:1],
                "--join-timeout",
                "3",
                *flags[1:],
                PROBE,
                "info",
            ],
            env=netns.node_env(),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        os.killpg(host.pid, signal.SIGKILL)
        host.wait()
        subprocess.run(["ip", "netns", "exec", ns_a, fw, "-D", *rule], timeout=30)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"the rendezvous at {addr_a}:{port} did not answer within 3 s (no reply" in out.stderr, (
        out.stderr
    )
    assert "firewall" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.timeout(300)
def test_nodes_with_different_process_counts_run_and_say_so(nodes, tmp_path):
    (ns_a, addr_a), (ns_b, _) = nodes
    procs = [
        netns.on(
            ns,
            DDPKIT
            + [
                "run",
                "--nnodes",
                "2",
                "--nproc",
                nproc,
                "--rdzv-endpoint",
                f"{addr_a}:29403",
                PROBE,
                "info",
            ],
            tmp_path,
            f"{ns}.log",
        )
        for ns, nproc in ((ns_a, "2"), (ns_b, "1"))
    ]
    codes = netns.finish(procs, timeout=120)
    logs = {ns: (tmp_path / f"{ns}.log").read_text() for ns in (ns_a, ns_b)}
    assert codes == [0, 0], logs
    assert "rank=0 world=3" in logs[ns_a] and "sum=6" in logs[ns_a]
    assert "3 processes on 2 nodes, 2 of them on this node" in logs[ns_a]


TRAIN_JOB = str(ROOT / "tests" / "jobs" / "scripts" / "train_job.py")


def test_elastic_job_goes_on_without_a_killed_node(nodes, tmp_path):
    """Two nodes in a 1:2 elastic job; node b is killed mid-run. Node a's agent re-forms the job at
    world size 1, the Trainer resumes from the last snapshot, and every sample of every epoch is
    trained exactly once."""
    (ns_a, addr_a), (ns_b, _) = nodes
    samples = tmp_path / "samples"
    samples.mkdir()
    flags = ["run", "--nnodes", "1:2", "--nproc", "1", "--rdzv-endpoint", f"{addr_a}:29400"]
    job = [TRAIN_JOB, "run", "--epochs", "40", "--sample-log", str(samples)]
    node_a = netns.on(ns_a, DDPKIT + flags + job, tmp_path, "a.log")
    # waits for node a's rendezvous if it is first
    node_b = netns.on(ns_b, DDPKIT + flags + job, tmp_path, "b.log")
    # both nodes trained a while, with snapshots every 3 steps
    _wait_while_running(
        lambda: _steps_logged(samples) >= 60,
        [node_a, node_b],
        [tmp_path / "a.log", tmp_path / "b.log"],
        240,
        "60 steps logged",
    )
    # node b's agent; its worker dies with it (parent-death signal)
    os.kill(node_b.pid, signal.SIGKILL)
    node_b.wait()
    code = netns.finish([node_a], timeout=300)[0]
    log_a = (tmp_path / "a.log").read_text()
    assert code == 0, log_a[-5000:]

    events = [
        e
        for e in read_records(tmp_path / "run")
        if e["kind"] == "event" and e["event"] in ("start", "resume", "stop")
    ]
    resume = [e for e in events if e["event"] == "resume"]
    assert events[0]["event"] == "start" and events[-1] == events[-1] | {
        "event": "stop",
        "reason": "epochs",
    }
    assert len(resume) == 1 and resume[0]["world_size"] == 1 and resume[0]["restart_count"] >= 1, (
        events
    )
    resumed_at = resume[0]["step"]

    # The trajectory that counts: steps before the resume point from the two-node attempt, the rest
    # from the one-node attempt; steps node a or b trained after the last snapshot were lost and
    # trained again.
    seen: dict[int, list[int]] = {}
    for path in samples.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if (r["attempt"] == 0) == (r["step"] < resumed_at):
                seen.setdefault(r["epoch"], []).extend(r["idx"])
    assert sorted(seen) == list(range(40))
    for epoch, idx in seen.items():
        assert sorted(idx) == list(range(240)), f"epoch {epoch}: samples not seen exactly once"


EPOCHS_JOINED = 100  # node a alone would take ~30 s: time for node b to start and join


@pytest.mark.timeout(600)
def test_a_node_that_joins_an_elastic_job_is_taken_in_at_a_restart(nodes, tmp_path):
    """Node a runs a 1:2 elastic job alone; node b joins mid-run. The agents form the job again with
    both, and the Trainer resumes at world size 2 from the snapshot it saved when stopped; every
    sample of every epoch once."""
    (ns_a, addr_a), (ns_b, _) = nodes
    samples = tmp_path / "samples"
    samples.mkdir()
    flags = ["run", "--nnodes", "1:2", "--nproc", "1", "--rdzv-endpoint", f"{addr_a}:29404"]
    job = [TRAIN_JOB, "run", "--epochs", str(EPOCHS_JOINED), "--sample-log", str(samples)]
    node_a = netns.on(ns_a, DDPKIT + flags + job, tmp_path, "a.log")
    # node a trained alone a while, with snapshots every 3 steps
    _wait_while_running(
        lambda: _steps_logged(samples) >= 10,
        [node_a],
        [tmp_path / "a.log"],
        240,
        "10 steps logged by node a alone",
    )
    node_b = netns.on(ns_b, DDPKIT + flags + job, tmp_path, "b.log")
    codes = netns.finish([node_a, node_b], timeout=300)
    logs = [(tmp_path / f"{n}.log").read_text()[-3000:] for n in "ab"]
    assert codes == [0, 0], logs

    events = [
        e
        for e in read_records(tmp_path / "run")
        if e["kind"] == "event" and e["event"] in ("start", "resume", "stop")
    ]
    # The agent stops node a's worker with SIGTERM to form the job again: the Trainer saves that
    # step, and the job of two resumes there.
    assert [(e["event"], e.get("reason")) for e in events] == [
        ("start", None),
        ("stop", "signal"),
        ("resume", None),
        ("stop", "epochs"),
    ], events
    assert events[2]["world_size"] == 2
    resumed_at = events[2]["step"]
    assert 0 < events[1]["step"] == resumed_at < EPOCHS_JOINED * 10

    # A membership change is not a failure, so the restart count stays 0: the world size tells the
    # attempts apart, by the samples a rank trains per step (24 alone, 12 each in two). Alone, the
    # steps up to the resume point count; in two, every step.
    lines = [
        json.loads(line)
        for rank in (0, 1)
        for line in (samples / f"rank{rank}.jsonl").read_text().splitlines()
    ]
    first = [r for r in lines if len(r["idx"]) == 24]
    second = [r for r in lines if len(r["idx"]) == 12]
    assert len(first) + len(second) == len(lines)
    seen: dict[int, list[int]] = {}
    for r in [r for r in first if r["step"] < resumed_at] + second:
        seen.setdefault(r["epoch"], []).extend(r["idx"])
    assert sorted(seen) == list(range(EPOCHS_JOINED))
    for epoch, idx in seen.items():
        assert sorted(idx) == list(range(240)), f"epoch {epoch}: samples not seen exactly once"


def _steps_logged(folder: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in folder.glob("rank*.jsonl"))


ATTACKER = str(ROOT / "tests" / "jobs" / "scripts" / "rdzv_attacker.py")


def _attack(ns: str, *args: str) -> str:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, ATTACKER, *args],
        env=netns.node_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.stdout


def _listening(root: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket listening in ``root`` or below it, read from /proc."""
    from ddpkit._launch.proctree import descendants

    inodes = set()
    for pid in [root, *descendants(root)]:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes.add(link[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        # root's network namespace
        for line in Path(f"/proc/{root}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                addr, port = fields[1].split(":")
                raw = bytes.fromhex(addr)
                # The kernel prints each 32-bit word of the address in host (little-endian) order.
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add(
                    (
                        socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw),
                        int(port, 16),
                    )
                )
    return found


def _loopback(addr: str) -> bool:
    return addr in ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def _wait_while_running(
    condition: Callable[[], bool],
    procs: list[subprocess.Popen],
    logs: list[Path],
    timeout: float,
    what: str,
    interval: float = 0.1,
) -> None:
    """Poll ``condition`` until it holds; one of ``procs`` that ends first fails the wait at once.
    Either failure carries the end of every log in ``logs``."""

    def tails() -> str:
        return "\n".join(f"{log.name}: {log.read_text()[-3000:]}" for log in logs)

    def holds() -> bool:
        if condition():
            return True
        assert all(p.poll() is None for p in procs), tails()
        return False

    wait_until(
        holds, timeout, what=lambda: f"{what}\n{tails()}", interval=interval, max_interval=interval
    )


def _wait_for_pids(
    folder: Path, count: int, proc: subprocess.Popen, log: Path, timeout: float = 120
) -> None:
    _wait_while_running(
        lambda: len(list(folder.glob("rank*.pid"))) >= count,
        [proc],
        [log],
        timeout,
        f"{count} pid files in {folder}",
        interval=0.05,
    )


@pytest.mark.timeout(600)
def test_a_single_node_job_listens_on_loopback_only(nodes, tmp_path):
    """Everything a one-node job listens on (rendezvous store, workers' store, gloo) is on
    127.0.0.1: from the other node, every one of its ports is closed. Control: torchrun's own
    one-node job is open from there."""
    (ns_a, addr_a), (ns_b, _) = nodes

    def ports_of(launcher: list[str], tag: str) -> tuple[set[tuple[str, int]], str]:
        folder = tmp_path / tag
        folder.mkdir()
        proc = netns.on(ns_a, launcher + [PROBE, "wait-for", str(folder)], tmp_path, f"{tag}.log")
        try:
            _wait_for_pids(folder, 2, proc, tmp_path / f"{tag}.log")
            listening = _listening(proc.pid)  # `ip netns exec` became the agent: the same pid
            reach = _attack(ns_b, "reach", addr_a, *[str(port) for _, port in sorted(listening)])
            (folder / "go").touch()
            assert netns.finish([proc], timeout=120) == [0], (tmp_path / f"{tag}.log").read_text()[
                -3000:
            ]
        finally:
            netns.finish([proc], timeout=0)
        return listening, reach

    listening, reach = ports_of(DDPKIT + ["run", "--nproc", "2"], "ddpkit")
    assert len(listening) >= 3, listening  # the agent's store, rank 0's store, gloo's
    assert all(_loopback(addr) for addr, _ in listening), listening
    assert "open" not in reach and reach.count("closed") == len(listening), reach

    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    listening, reach = ports_of(torchrun, "torchrun")
    assert any(not _loopback(addr) for addr, _ in listening), listening
    assert " open" in reach, reach


@pytest.mark.timeout(900)
def test_a_multi_node_rendezvous_admits_only_holders_of_the_secret(nodes, tmp_path):
    """Outsiders on node b (a plain store client writing a pickle that would create a file, a
    `ddpkit run` with another secret) are refused; so is a forged state written on node a's
    loopback; the job of both nodes goes on and finishes. Control: the same pickle written to
    torchrun's c10d endpoint runs in its agent."""
    (ns_a, addr_a), (ns_b, addr_b) = nodes
    folder = tmp_path / "job"
    folder.mkdir()
    flags = [
        "run",
        "--nnodes",
        "2",
        "--nproc",
        "1",
        "--rdzv-endpoint",
        f"{addr_a}:29405",
        "--rdzv-id",
        "job",
    ]
    job = [PROBE, "wait-for", str(folder)]
    node_a = netns.on(ns_a, DDPKIT + flags + job, tmp_path, "a.log")
    node_b = None
    try:
        assert (
            subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns_b,
                    sys.executable,
                    ATTACKER,
                    "wait-open",
                    addr_a,
                    "29405",
                ],
                timeout=120,
            ).returncode
            == 0
        ), (tmp_path / "a.log").read_text()[-3000:]
        # A plain TCPStore client from node b, as anyone on the network: refused by the relay,
        # nothing written.
        marker = tmp_path / "pwned-by-b"
        assert _attack(
            ns_b, "forge", addr_a, "29405", "torch.rendezvous.job", str(marker)
        ).startswith("refused")
        # A node with another secret: one clear error, before any worker.
        wrong = netns.node_env() | {"DDPKIT_RDZV_SECRET": "f" * 64}
        out = subprocess.run(
            ["ip", "netns", "exec", ns_b, *DDPKIT, *flags, *job],
            env=wrong,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2, out.stderr[-3000:]
        assert f"the rendezvous at {addr_a}:29405 did not admit this node" in out.stderr
        assert "Traceback" not in out.stderr
        # The node that holds the secret joins; both workers start.
        node_b = netns.on(ns_b, DDPKIT + flags + job, tmp_path, "b.log")
        _wait_for_pids(folder, 2, node_a, tmp_path / "a.log")
        # A process on node a itself (another user of that machine) reaches the store on loopback
        # and writes a pickle where the rendezvous state is: the first agent to read it (either
        # node's) refuses it and puts the state back.
        local = [port for addr, port in _listening(node_a.pid) if _loopback(addr)]
        assert local, _listening(node_a.pid)
        local_marker = tmp_path / "pwned-on-a"
        results = [
            _attack(
                ns_a, "forge", "127.0.0.1", str(port), "torch.rendezvous.job", str(local_marker)
            )
            for port in local
        ]
        assert "written" in "".join(results), results
        _wait_while_running(
            lambda: (
                "ignored a rendezvous state without this job's signature"
                in "".join((tmp_path / f"{n}.log").read_text() for n in "ab")
            ),
            [],
            [tmp_path / "a.log"],
            60,
            "the forged state to be ignored",
        )
        (folder / "go").touch()
        codes = netns.finish([node_a, node_b], timeout=120)
    finally:
        (folder / "go").touch()
        netns.finish([p for p in (node_a, node_b) if p is not None], timeout=0)
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in "ab"}
    assert codes == [0, 0], logs
    # the launcher kept the secret from the workers
    assert "rank=0 world=2 sum=3 secret=False" in logs["a"]
    assert not marker.exists() and not local_marker.exists()
    assert f"refused a connection to the rendezvous from {addr_b}" in logs["a"]

    # Control: torchrun's c10d rendezvous on node a; the same outsider on node b runs its code in
    # the agent.
    folder = tmp_path / "torchrun"
    folder.mkdir()
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{addr_a}:29406",
        "--rdzv-id",
        "job",
        "--rdzv-conf",
        "is_host=1",
    ]  # torchrun cannot tell on its own that it hosts an address of a namespace
    proc = netns.on(ns_a, torchrun + job[:-1] + [str(folder)], tmp_path, "torchrun.log")
    try:
        _wait_for_pids(folder, 1, proc, tmp_path / "torchrun.log")
        marker = tmp_path / "pwned-torchrun"
        assert (
            _attack(ns_b, "forge", addr_a, "29406", "torch.rendezvous.job", str(marker))
            == "written\n"
        )
        # the agent unpickles the state at its next sync
        _wait_while_running(
            marker.exists, [], [tmp_path / "torchrun.log"], 60, "the forged state's code to run"
        )
    finally:
        (folder / "go").touch()
        netns.finish([proc], timeout=0)
