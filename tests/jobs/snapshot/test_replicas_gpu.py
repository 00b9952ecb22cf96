"""Copies in memory from a GPU (marked ``gpu``: ``pytest -m gpu``, ``scripts/gpu_check.sh``; each
skipped, saying why, without one): the copy into a slot's pinned pages on a side stream, ordered
after the step's work and before the next step's; a worker killed and resumed from them bitwise;
with two GPUs, a lost node healed in place from its copies, its NCCL groups aborted and made
again. Jobs run as fresh processes: this process never touches the GPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ddpkit._launch.agent import jobdir
from ddpkit.testing import run_job, wait_until
from tests.device_support import CUDA_MARKS, GPUS, device_env, requires_2_gpus

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = Path(__file__).parents[1] / "scripts"
MEMORY_JOB, REPLICA_JOB = str(SCRIPTS / "memory_job.py"), str(SCRIPTS / "replica_job.py")

pytestmark = CUDA_MARKS

ORDERED = textwrap.dedent("""
    import json, sys, threading, torch
    from ddpkit.snapshot import _codec as codec, _slots as sl

    st = sl.Slots(sys.argv[1], job="id:a", run="run", rank=0, world_size=1)
    t = torch.ones(1 << 22, device="cuda")
    specs, size = codec.layout([t])
    manifest = {"specs": [[s.dtype, list(s.shape), s.offset] for s in specs], "data_size": size}
    side = torch.cuda.Stream()
    torch.cuda._sleep(int(3e8))  # the step's last work, still running when the save is called
    t.fill_(2.0)
    commit = st.save_from_device({"step": 1, "position": [0, 1, 1]}, [t], manifest, "x", side)
    t.fill_(3.0)  # the next step's change, queued after the save
    before = [f.step for f in st.found()]
    thread = threading.Thread(target=commit)
    thread.start()
    thread.join()
    (found,) = st.found()
    got = sl.read_slot(found.path, data=True)
    held = sl.tensors_of(got[3], got[0], got[1])[0]
    out = {"before": before, "twos": bool((held == 2).all()), "pinned": st.last.pinned is not None}
    # Control: the same copy on the side stream, not ordered after the step's work.
    dest = torch.empty(t.shape, pin_memory=True)
    torch.cuda._sleep(int(3e8))
    t.fill_(2.0)
    with torch.cuda.stream(side):
        dest.copy_(t, non_blocking=True)
    side.synchronize()
    out["unordered_twos"] = bool((dest == 2).all())
    torch.cuda.synchronize()
    st.close()
    print(json.dumps(out))
""")


@pytest.mark.timeout(300)
def test_a_copy_from_the_gpu_holds_the_steps_state_not_the_next_ones(tmp_path, clean_env):
    env = device_env(clean_env, "cuda") | {"PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(
        [sys.executable, "-c", ORDERED, str(tmp_path)], env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # not whole until its commit; then the step's values (2), not the step before's (1) or the
    # next one's (3), in pages pinned for the device
    assert out["before"] == [] and out["twos"] and out["pinned"], out
    assert not out["unordered_twos"], out  # Control: unordered, the copy reads the step before


def _memory_job(tmp: Path, name: str, env: dict, *args: str, nproc: int) -> dict:
    (tmp / f"{name}-log").mkdir()
    job = [str(tmp / name), "--log", str(tmp / f"{name}-log"), "--out", str(tmp / f"{name}.pt")]
    proc = run_job(MEMORY_JOB, *job, *args, nproc=nproc, launcher_args=("--max-restarts", "2"),
                   env=env, cwd=tmp, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp / f"{name}.pt", weights_only=False)


@pytest.mark.timeout(900)
def test_a_killed_worker_resumes_from_its_copy_of_the_gpus_state_bitwise(tmp_path, clean_env):
    (tmp_path / "shm").mkdir()
    env = device_env(clean_env, "cuda") | {jobdir.ROOT_ENV: str(tmp_path / "shm")}
    reference = _memory_job(tmp_path, "reference", env, nproc=GPUS)
    kill = ("--kill-rank", "0", "--kill-after-step", "13", "--kill-delay", "0.002")
    final = _memory_job(tmp_path, "killed", env, *kill, nproc=GPUS)
    records = map(json.loads, (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines())
    (resume,) = [r for r in records if r.get("event") == "resume"]
    assert resume["file"] == "memory" and final["attempt"] == 1
    for key, value in reference["model"].items():
        assert torch.equal(final["model"][key], value), key


@requires_2_gpus
@pytest.mark.timeout(900)
def test_a_lost_node_of_one_gpu_is_healed_in_place_from_its_copies_over_nccl(tmp_path, clean_env):
    """Two agents on this machine, one GPU each (fsdp over nccl): node b (its agent and worker)
    SIGKILLed after step 15, a new one started in its place; the survivor's NCCL groups are
    aborted and made again in its own process. Bitwise where the same two nodes end
    uninterrupted."""
    (tmp_path / "shm").mkdir()
    base = device_env(clean_env, "cuda") | {jobdir.ROOT_ENV: str(tmp_path / "shm"),
                                            "DDPKIT_RDZV_SECRET": "a1" * 32}  # fmt: skip

    def two_nodes(name: str, port: int, lose: bool) -> dict:
        log, hold = tmp_path / f"{name}-log", tmp_path / f"{name}-go"
        log.mkdir()
        cmd = [
            sys.executable, "-m", "ddpkit.cli", "run", "--nnodes", "2", "--nproc", "1",
            "--max-restarts", "3", "--recover", "in-place", "--rdzv-endpoint",
            f"127.0.0.1:{port}", REPLICA_JOB, str(tmp_path / name), "--log", str(log), "--out",
            str(tmp_path / f"{name}.pt"), "--strategy", "fsdp", "--no-sync-bn",
            "--hold-after-step", "15", "--hold-file", str(hold),
        ]  # fmt: skip
        if not lose:
            hold.touch()

        def node(gpu: int, label: str) -> subprocess.Popen:
            out = open(tmp_path / f"{name}-{label}.log", "w")  # noqa: SIM115
            env = base | {"CUDA_VISIBLE_DEVICES": str(gpu)}
            return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=out, stderr=out,
                                    start_new_session=True)  # fmt: skip

        a, b = node(0, "a"), node(1, "b")
        if lose:
            steps = [log / f"steps-rank{r}.txt" for r in (0, 1)]
            wait_until(lambda: all(p.exists() and len(p.read_text().splitlines()) >= 15
                                   for p in steps), 300, what="step 15")  # fmt: skip
            os.killpg(b.pid, signal.SIGKILL)
            b.wait()
            b = node(1, "b2")
            hold.touch()
        for p in (a, b):
            assert p.wait(timeout=600) == 0, "\n".join(
                f.read_text()[-3000:] for f in tmp_path.glob(f"{name}-*.log")
            )
        return torch.load(tmp_path / f"{name}.pt", weights_only=False)

    reference = two_nodes("reference", 29471, lose=False)
    final = two_nodes("lost", 29472, lose=True)
    records = map(json.loads, (tmp_path / "lost" / "metrics.jsonl").read_text().splitlines())
    (event,) = [r for r in records if r.get("event") == "recover"]
    print(f"\nnode b (one GPU) lost after step 15, healed in place over nccl: {event}")
    assert event["source"] == "memory (ranks [1] from rank 0)" and event["step"] == 14
    for part in ("model", "optim"):
        for key, value in reference["full"][part].items():
            got = final["full"][part][key]
            assert torch.equal(got, value) if torch.is_tensor(value) else got == value, key
