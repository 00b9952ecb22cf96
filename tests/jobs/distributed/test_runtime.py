"""``ddpkit.init``: plain python, real process groups under ``ddpkit.spawn``, and the errors a user
can act on."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ddpkit
from ddpkit.distributed._runtime import DEFAULT_TIMEOUT, NotInitializedError

PLAIN_PYTHON = """
import json, os
import torch.distributed as dist
import ddpkit

launch_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")
out = {"leaked": sorted(k for k in launch_vars if k in os.environ)}
try:
    ddpkit.init(backend="nccl")
    out["nccl"] = "no error"
except ddpkit.ConfigError as err:
    out["nccl"] = "ConfigError: " + str(err)
except Exception as err:
    out["nccl"] = type(err).__name__ + ": " + str(err)
rt = ddpkit.init()
out.update(
    rank=rt.rank, local_rank=rt.local_rank, world_size=rt.world_size,
    local_world_size=rt.local_world_size, device=str(rt.device), backend=rt.backend,
    launcher=rt.launcher, distributed=rt.distributed, is_main=rt.is_main,
    same_on_second_call=ddpkit.init() is rt, get_runtime_same=ddpkit.get_runtime() is rt,
    process_group=dist.is_initialized(),
    helpers=[
        ddpkit.get_runtime().rank, ddpkit.get_runtime().world_size, ddpkit.all_reduce(5),
        ddpkit.all_gather_object("x"),
    ],
)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def plain_python(run_python):
    proc = run_python(PLAIN_PYTHON)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_plain_python_is_a_world_of_one(plain_python):
    out = plain_python
    assert out["leaked"] == []
    assert (out["rank"], out["local_rank"], out["world_size"], out["local_world_size"]) == (
        0,
        0,
        1,
        1,
    )
    assert out["device"] == "cpu"
    assert out["backend"] is None
    assert out["launcher"] == "none"
    assert out["distributed"] is False and out["process_group"] is False
    assert out["is_main"] is True
    assert out["same_on_second_call"] and out["get_runtime_same"]
    assert out["helpers"] == [0, 1, 5, ["x"]]


def test_nccl_without_gpu_says_use_gloo(plain_python):
    message = plain_python["nccl"]
    assert message.startswith("ConfigError: "), message
    assert "gloo" in message
    assert "ProcessGroupNCCL" not in message and "only supported with GPUs" not in message


PORT_IN_USE = """
import os, socket, time
import ddpkit

start = time.monotonic()
try:
    ddpkit.init()
    print("BUSY-PORT: no error")
except ddpkit.ConfigError as err:
    print(f"BUSY-PORT: ConfigError after {time.monotonic() - start:.2f}s: {err}")
except Exception as err:
    print(f"BUSY-PORT: {type(err).__name__}: {err}")

# Control: the same launch on a free port starts (a world of one needs no other process). The
# port is below the range the system gives outgoing connections, which would take one found free.
low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
for port in range(low - 1, 1024, -1):
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) != 0:
            break
os.environ["MASTER_PORT"] = str(port)
rt = ddpkit.init()
print(f"FREE-PORT: backend={rt.backend} world={rt.world_size} sum={ddpkit.all_reduce(2)}")
"""


@pytest.mark.heavy
def test_port_in_use_fails_fast_with_explanation(run_python):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = run_python(
            PORT_IN_USE,
            extra_env={
                "RANK": "0",
                "WORLD_SIZE": "1",
                "LOCAL_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
            timeout=60,
        )
    assert proc.returncode == 0, proc.stderr
    lines = dict(
        line.split(": ", 1)
        for line in proc.stdout.splitlines()
        if line.startswith(("BUSY", "FREE"))
    )
    busy_line = lines["BUSY-PORT"]
    assert busy_line.startswith("ConfigError after"), busy_line
    assert f"port {port}" in busy_line and "in use" in busy_line
    assert lines["FREE-PORT"] == "backend=gloo world=1 sum=2"


def _bad_env_worker() -> dict[str, str]:
    """World of one under spawn; breaks its own environment before init to see what init says."""
    good = dict(os.environ)
    seen = {}
    cases = {
        "rank_outside": {"RANK": "3", "WORLD_SIZE": "2"},
        "no_master_addr": {"MASTER_ADDR": None},
        "partial": {"WORLD_SIZE": None},
        "not_integer": {"LOCAL_RANK": "zero"},
    }
    for name, changes in cases.items():
        for key, value in changes.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
        try:
            ddpkit.init()
            seen[name] = "no error"
        except ddpkit.ConfigError as err:
            seen[name] = "ConfigError: " + str(err)
        assert not dist.is_initialized()
        os.environ.clear()
        os.environ.update(good)
    rt = ddpkit.init()  # control: the untouched environment starts
    seen["control"] = f"{rt.backend} {rt.world_size}"
    return seen


def test_inconsistent_environment_is_a_config_error():
    (seen,) = ddpkit.spawn(_bad_env_worker, 1)
    assert seen["rank_outside"].startswith("ConfigError: rank 3 is outside the world of 2")
    assert (
        seen["no_master_addr"].startswith("ConfigError: ")
        and "MASTER_ADDR" in seen["no_master_addr"]
    )
    assert seen["partial"].startswith("ConfigError: ") and "WORLD_SIZE" in seen["partial"]
    assert seen["not_integer"].startswith("ConfigError: LOCAL_RANK='zero'")
    assert seen["control"] == "gloo 1"


def _fields_worker() -> dict:
    out = {}
    if not torch.cuda.is_available():
        try:
            ddpkit.init(backend="nccl")
            out["nccl"] = "no error"
        except ddpkit.ConfigError as err:
            out["nccl"] = "ConfigError: " + str(err)
        out["nccl_left_group"] = dist.is_initialized()
    rt = ddpkit.init()
    out |= {
        "rank": rt.rank,
        "local_rank": rt.local_rank,
        "world_size": rt.world_size,
        "local_world_size": rt.local_world_size,
        "device": str(rt.device),
        "backend": rt.backend,
        "launcher": rt.launcher,
        "restart_count": rt.restart_count,
        "is_main": rt.is_main,
        "is_local_main": rt.is_local_main,
        "distributed": rt.distributed,
        "same_on_second_call": ddpkit.init() is rt and ddpkit.get_runtime() is rt,
        "dist": (dist.get_rank(), dist.get_world_size(), dist.get_backend()),
        # What the process group itself was configured with (no public accessor; the gloo backend's
        # options).
        "pg_timeout": dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout,
        "sum": ddpkit.all_reduce(rt.rank + 1),
    }
    ddpkit.shutdown()
    try:
        ddpkit.get_runtime()
        refused = "no error"
    except NotInitializedError as err:
        refused = str(err)
    # Shut down, the process is no longer part of the job, but the launcher's variables still say it
    # was.
    out["after_shutdown"] = (dist.is_initialized(), "call ddpkit.init()" in refused)
    return out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_runtime_fields_under_spawn(nprocs):
    results = ddpkit.spawn(_fields_worker, nprocs)
    assert [r["rank"] for r in results] == list(range(nprocs))
    for r, out in enumerate(results):
        assert out["local_rank"] == r
        assert out["world_size"] == out["local_world_size"] == nprocs
        assert out["device"] == "cpu"
        assert out["backend"] == "gloo"
        assert out["launcher"] == "torchrun"
        assert out["restart_count"] == 0
        assert out["is_main"] is (r == 0) and out["is_local_main"] is (r == 0)
        assert out["distributed"] is True
        assert out["same_on_second_call"]
        assert out["dist"] == (r, nprocs, "gloo")
        assert out["sum"] == nprocs * (nprocs + 1) // 2
        assert out["pg_timeout"] == DEFAULT_TIMEOUT
        assert out["after_shutdown"] == (False, True)
        if "nccl" in out:  # no GPU on this machine
            assert out["nccl"].startswith("ConfigError: ") and "gloo" in out["nccl"], out["nccl"]
            assert "ProcessGroupNCCL" not in out["nccl"]
            assert out["nccl_left_group"] is False
    assert timedelta(0) < DEFAULT_TIMEOUT < timedelta(minutes=30)


REINIT = """
import json
from datetime import timedelta
import ddpkit

def worker(rounds):
    # A failed rendezvous must not cost the default 5 minutes; 20 s leaves room for the occasional
    # 5 s stall seen on this machine when a TCPStore client connects.
    short = timedelta(seconds=20)
    ddpkit.init(timeout=short)
    sums = [ddpkit.all_reduce(1)]
    for _ in range(rounds):
        ddpkit.shutdown()
        ddpkit.init(timeout=short)
        sums.append(ddpkit.all_reduce(1))
    return sums

if __name__ == "__main__":
    print("RESULT", json.dumps(ddpkit.spawn(worker, 3, (5,))))
"""


@pytest.mark.timeout(120)
@pytest.mark.heavy
def test_init_again_after_shutdown(run_python):
    # shutdown() promises that init() may be called again. Under ddpkit.spawn (and torchrun) the
    # rendezvous store outlives the group, so a second group must not read the first group's
    # keys. The broken case can hang beyond the group timeout, so it runs in a subprocess that is
    # killed with its ranks after 45 s.
    proc = run_python(REINIT, timeout=45)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert json.loads(result[-1][len("RESULT ") :]) == [[3] * 6] * 3


def _timeout_worker(timeout: timedelta) -> dict:
    rt = ddpkit.init(timeout=timeout)
    store = dist.distributed_c10d._get_default_store()
    out = {"pg_timeout": dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout}
    if rt.rank == 0:
        # Rank 1 never joins this collective: it must fail after the group's timeout, not hang.
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            out["error"] = None
        except Exception as err:  # gloo raises RuntimeError("Timed out waiting ...")
            out["error"] = str(err)
        out["elapsed"] = time.monotonic() - start
        store.set("rank0_done", "1")
    else:
        store.wait(["rank0_done"], timedelta(seconds=60))
    return out


def test_timeout_reaches_the_process_group():
    results = ddpkit.spawn(_timeout_worker, 2, (timedelta(seconds=2),))
    assert [r["pg_timeout"] for r in results] == [timedelta(seconds=2)] * 2
    rank0 = results[0]
    assert rank0["error"] is not None and "timed out" in rank0["error"].lower()
    assert 1.5 <= rank0["elapsed"] < 30


def _without_init_worker() -> str:
    try:
        ddpkit.get_runtime()
        return "a world of one"
    except NotInitializedError as err:
        return str(err)


def test_get_runtime_without_init_refuses_when_the_launcher_says_several_ranks():
    # Before, every rank got a world of one here and trained its own copy on the whole data set.
    messages = ddpkit.spawn(_without_init_worker, 2)
    for r, message in enumerate(messages):
        assert f"this is rank {r} of 2" in message and "call ddpkit.init()" in message


@pytest.mark.heavy
def test_get_runtime_without_init_in_plain_python_is_a_world_of_one(run_python):
    proc = run_python(
        "import ddpkit; rt = ddpkit.get_runtime(); print(rt.world_size, rt.distributed)"
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["1", "False"], proc.stderr


def _init_twice_worker() -> dict:
    rt = ddpkit.init()
    out = {"same": ddpkit.init(backend="gloo") is rt and ddpkit.init(device="cpu") is rt}
    for kwargs in ({"backend": "mpi"}, {"device": "meta"}):
        try:
            ddpkit.init(**kwargs)
            out[str(kwargs)] = "no error"
        except ddpkit.ConfigError as err:
            out[str(kwargs)] = str(err)
    return out


def test_init_again_with_another_backend_or_device_raises():
    for out in ddpkit.spawn(_init_twice_worker, 2):
        assert out["same"]
        assert (
            "init(backend='mpi') but this process already runs with backend 'gloo'"
            in out["{'backend': 'mpi'}"]
        )
        assert (
            "init(device='meta') but this process already runs on cpu" in out["{'device': 'meta'}"]
        )


def _seeds_train(rank: int, world_size: int, lr: float = 0.1) -> tuple[int, int, int, int, float]:
    """The DDP tutorials' entry point, written for ``mp.spawn``: the rank comes first."""
    rt = ddpkit.init()
    return rank, world_size, rt.rank, ddpkit.all_reduce(rank + 1), lr


def test_spawn_passes_the_rank_first_as_mp_spawn_does():
    results = ddpkit.spawn(_seeds_train, args=(2,), nprocs=2, pass_rank=True)
    # each process got its own rank, as init() says
    assert results == [(0, 2, 0, 3, 0.1), (1, 2, 1, 3, 0.1)]
    # ddpkit's own form calls fn(*args): the rank is init()'s to tell.
    assert ddpkit.spawn(_seeds_train, nprocs=2, args=(5, 2, 0.5)) == [
        (5, 2, 0, 12, 0.5),
        (5, 2, 1, 12, 0.5),
    ]


def test_spawn_says_pass_rank_when_the_function_takes_a_rank():
    from ddpkit._errors import ConfigError

    # The DDP tutorials' train(rank, world_size) called the ddpkit way would fail in every child
    # with a TypeError.
    with pytest.raises(ConfigError, match=r"takes the rank first.*pass_rank=True"):
        ddpkit.spawn(_seeds_train, args=(2,), nprocs=2)
    with pytest.raises(ConfigError, match="takes no rank: drop pass_rank=True"):
        ddpkit.spawn(_without_init_worker, nprocs=2, pass_rank=True)
    with pytest.raises(ConfigError, match="pass both by name"):
        ddpkit.spawn(_seeds_train, (2,), 2)  # mp.spawn's positional order


@pytest.mark.gpu
def test_on_a_gpu_the_default_group_is_bound_to_the_ranks_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    found = ddpkit.spawn(_bound_device_id, 1)[0]
    assert found == (str(torch.device("cuda", 0)), 1.0)


def _bound_device_id() -> tuple[str, float]:
    import torch.distributed as dist

    rt = ddpkit.init()
    one = torch.ones(1, device=rt.device)
    dist.all_reduce(one)  # the bound NCCL group really reduces
    return str(dist.group.WORLD.bound_device_id), one.item()
