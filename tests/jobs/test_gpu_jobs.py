"""Jobs on each device: the backend and device a rank gets, its collectives, placement under
CUDA_VISIBLE_DEVICES, nccl's flight recorder on a hang, ``ddpkit env``, ``ddpkit check`` and
``ddpkit bench``.

Tests that take the device as a parameter run with gloo on CPU processes (``cpu``) and with nccl on
the GPUs (``cuda``, marked ``gpu``): one rank per GPU, so one rank where there is one GPU (nccl
refuses two ranks on one GPU). Tests that need two GPUs skip, saying so, where there are fewer.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from ddpkit.testing import run_job
from tests.device_support import (
    DDPKIT,
    GPUS,
    SCRIPTS,
    device_env,
    device_params,
    nprocs,
    physical_gpu_uuids,
    requires_2_gpus,
    requires_cuda,
    run,
)

PROBE = str(SCRIPTS / "device_probe.py")


def _uuid(name: str) -> str:
    return name.lower().removeprefix("gpu-")


@pytest.mark.parametrize("device", device_params(cpu_slow=True))
@pytest.mark.timeout(300)
def test_a_job_gets_its_device_and_backend_and_exact_collectives_there(device, clean_env, tmp_path):
    n = nprocs(device)
    env = device_env(clean_env, device)
    logs = ["--log-dir", str(tmp_path / "logs")]
    out = run_job(
        PROBE, "info", str(tmp_path), nproc=n, launcher_args=logs, env=env, cwd=tmp_path,
        timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    total = n * (n + 1) / 2
    for r, seen in enumerate(ranks):
        where = "cpu" if device == "cpu" else f"cuda:{r}"
        assert seen["backend"] == ("gloo" if device == "cpu" else "nccl"), seen
        assert (
            seen["device"] == where
            and seen["all_reduce_device"] == where
            and seen["gathered_device"] == where
        )
        assert seen["current_device"] == (None if device == "cpu" else r)
        assert seen["all_reduce"] == [total] * 3 and seen["number"] == total
        assert seen["metrics"] == {"loss": 0.5 * total, "n": 2 * n}
        assert seen["gathered"] == [float(i) for k in range(n) for i in range(k + 1)]
        assert seen["broadcast"] == {"from": 0, "device": "cpu" if device == "cpu" else "cuda:0"}
    if device == "cuda":
        # One process per GPU, each on its own: no two ranks share a GPU.
        assert len({seen["uuid"] for seen in ranks}) == n
        # Control: one process more than there are GPUs is refused before any rank trains, naming
        # the fix.
        out = run_job(
            PROBE, "info", str(tmp_path), nproc=n + 1, launcher_args=logs, env=env, cwd=tmp_path,
            timeout=240,
        )  # fmt: skip
        assert out.returncode != 0
        assert f"{n + 1} processes on this node but only {n} GPU(s) visible" in out.stderr, (
            out.stderr[-3000:]
        )


@pytest.mark.gpu
@requires_cuda
def test_a_process_runs_on_the_gpu_cuda_visible_devices_names(clean_env):
    uuids = physical_gpu_uuids()
    last = len(uuids) - 1
    env = device_env(clean_env, "cuda") | {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # nvidia-smi's order
    for visible in (str(last), uuids[last]):  # the last GPU by index, and by UUID
        out = run(
            [sys.executable, PROBE, "where"], env | {"CUDA_VISIBLE_DEVICES": visible}, timeout=120
        )
        assert out.returncode == 0, out.stderr[-3000:]
        seen = json.loads(out.stdout.splitlines()[-1])
        assert (
            seen["device"] == "cuda:0" and seen["tensor"] == "cuda:0" and seen["sum"] == 64.0**3
        ), seen
        assert _uuid(seen["uuid"]) == _uuid(uuids[last]), (visible, seen, uuids)
    # Control: an empty list hides every GPU, and the same script runs on the CPU.
    out = run([sys.executable, PROBE, "where"], env | {"CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1])["device"] == "cpu"


@pytest.mark.gpu
@requires_2_gpus
@pytest.mark.timeout(300)
def test_rank_r_runs_on_the_rth_gpu_of_cuda_visible_devices(clean_env, tmp_path):
    uuids = physical_gpu_uuids()
    order = [1, 0]  # reversed: rank 0 on physical GPU 1
    env = device_env(clean_env, "cuda") | {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(map(str, order)),
    }
    logs = ["--log-dir", str(tmp_path / "logs")]
    out = run_job(
        PROBE, "info", str(tmp_path), launcher_args=logs, env=env, cwd=tmp_path, timeout=240
    )
    assert out.returncode == 0, out.stderr[-4000:]
    for r, physical in enumerate(order):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen["device"] == f"cuda:{r}" and _uuid(seen["uuid"]) == _uuid(uuids[physical])


@pytest.mark.gpu
@requires_cuda
@pytest.mark.timeout(300)
def test_debug_collectives_writes_the_nccl_flight_record_of_a_hang(clean_env, tmp_path):
    # One rank whose all-reduce waits behind a busy GPU: as stuck as one waiting for a peer, and
    # possible on one GPU. The collective times out after 5 s; with --debug-collectives the flight
    # recorder writes its record of the collectives to the run's folder, and the summary says where.
    env = device_env(clean_env, "cuda")

    def hang(*flags: str) -> tuple:
        logs = tmp_path / ("with" if flags else "without")
        options = ["--collective-timeout", "5", "--log-dir", str(logs), *flags]
        out = run_job(
            PROBE, "hang", nproc=1, launcher_args=options, env=env, cwd=tmp_path, timeout=240
        )
        return out, sorted(logs.glob("*/stacks/nccl_trace_rank_*"))

    out, traces = hang("--debug-collectives")
    assert out.returncode != 0, "the hang ended without a failure"
    # The watchdog reports the timeout; tearing the communicator down may wait for the spinning
    # kernel, so the script can still print that its all-reduce finished before the process is
    # ended.
    assert "queued the all-reduce" in out.stdout, out.stdout
    assert re.search(r"timeout|timed out", out.stderr, re.I), out.stderr[-4000:]
    assert traces and all(t.name.startswith("nccl_trace_rank_0") for t in traces), (
        traces,
        out.stderr[-4000:],
    )
    record = max(traces, key=lambda t: t.stat().st_size)
    data = record.read_bytes()
    # the record names the collective (pickled or JSON, as text)
    assert b"all_reduce" in data, data[:2000]
    assert "nccl flight recorder of rank 0" in out.stderr and str(record) in out.stderr, out.stderr[
        -3000:
    ]
    print(f"\nflight record: {record} ({len(data)} bytes); exit code {out.returncode}")
    # Control: the same hang without the option also ends (the timeout), but writes no record there.
    out, traces = hang()
    assert out.returncode != 0 and traces == [], traces
    assert "nccl flight recorder" not in out.stderr


@pytest.mark.parametrize("device", device_params(cpu_slow=True))
@pytest.mark.timeout(300)
def test_ddpkit_env_reports_the_gpus_and_checks_each_backend(device, clean_env):
    out = run([*DDPKIT, "env"], device_env(clean_env, device), timeout=240)
    text = out.stdout
    assert out.returncode == 0, text + out.stderr[-3000:]
    assert re.search(r"^live check \(2 processes, gloo all-reduce\) +ok in ", text, re.M), text
    if device == "cpu":
        assert re.search(r"^cuda available +False$", text, re.M), text
        assert "nccl all-reduce" not in text  # control: no GPU, no nccl check
        return
    n = min(GPUS, 2)
    assert re.search(
        rf"^live check \({n} process{'es' if n > 1 else ''}, nccl all-reduce\) +ok in ", text, re.M
    ), text
    assert re.search(r"^cuda available +True$", text, re.M), text
    names = run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], clean_env, timeout=60
    ).stdout
    gpus = next(line for line in text.splitlines() if line.startswith("gpus "))
    assert (
        names.splitlines()[0].strip() in gpus and "compute capability" in gpus and "GiB" in gpus
    ), (gpus, names)
    assert re.search(r"^nccl +\d+\.\d+\.\d+", text, re.M), text


@pytest.mark.gpu
@requires_cuda
@pytest.mark.timeout(400)
def test_ddpkit_check_runs_on_a_gpu_machine_and_still_names_a_cause(clean_env):
    # The check's ranks run over gloo on the CPU (any number fits one machine; nccl needs a GPU per
    # rank), so a GPU machine must not change its verdicts: a correct script passes, and a mistake
    # is named (control).
    env = device_env(clean_env, "cuda")
    steps = ["--steps", "2"]
    out = run_job(
        SCRIPTS / "check_correct.py", command="check", launcher_args=steps, env=env, timeout=300
    )
    assert out.returncode == 0 and "OK: 2 ranks train the same model" in out.stdout, (
        out.stdout + out.stderr[-2000:]
    )
    assert "gloo" in out.stdout.splitlines()[0]
    out = run_job(
        SCRIPTS / "check_dropout.py", command="check", launcher_args=steps, env=env, timeout=300
    )
    assert out.returncode == 1 and "cause: dropout drawing per rank" in out.stdout, (
        out.stdout + out.stderr[-2000:]
    )


_BENCH_ONE_GPU = """
import functools, json
from types import SimpleNamespace
import torch, torch._dynamo
from ddpkit.distributed._spawn import spawn
from ddpkit.tools._bench import _start_method, compare_data_parallel
from ddpkit.tools._measure import Knobs, measure_steps

# As a workload script may: it initialises the CUDA driver here, which a forked rank then cannot
# use.
assert torch.cuda.is_available()
job = functools.partial(measure_steps, None, Knobs(pin_memory=True), 20, 5, True, True)
one = spawn(job, 1, start_method=_start_method())[0]
dp = compare_data_parallel(SimpleNamespace(script=None, steps=20, warmup=5))
try:  # control: the same rank forked from this process
    spawn(job, 1, start_method="fork")
    forked = "ran"
except Exception as err:
    forked = f"{type(err).__name__}: {err}"
print(json.dumps({"one": one, "dp": dp, "forked": forked, "start_method": _start_method()}))
"""


@pytest.mark.gpu
@requires_cuda
@pytest.mark.timeout(300)
def test_bench_measures_ddp_one_gpu_and_data_parallel_on_cuda(clean_env, run_python):
    out = run_python(_BENCH_ONE_GPU, env=device_env(clean_env, "cuda"), timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.splitlines()[-1])
    one, dp = result["one"], result["dp"]
    assert result["start_method"] == "spawn"
    assert one["backend"] == "nccl" and one["device"] == "cuda:0"
    parts = one["medians"]
    assert parts["step"] > 0 and parts["forward"] > 0 and parts["backward"] > 0
    # The all-reduce span, from CUDA events: on the device's clock, inside the step, not zero.
    assert 0 < parts["allreduce_span"] < parts["step"], parts
    single = dp["single_gpu"]
    assert single["gpus"] == 1 and single["step"] > 0 and single["samples"] == one["batch_size"]
    assert (
        dp["data_parallel"]["gpus"] == GPUS
        and dp["data_parallel"]["samples"] == GPUS * one["batch_size"]
    )
    # Control: a rank forked after is_available() cannot use CUDA; the bench's own ranks are
    # spawned.
    assert "Cannot re-initialize CUDA in forked subprocess" in result["forked"], result["forked"]
    print(
        f"\nDDP on 1 GPU (nccl): step {parts['step'] * 1e3:.3f} ms, all-reduce span "
        f"{parts['allreduce_span'] * 1e3:.3f} ms; one GPU without DDP: {single['step'] * 1e3:.3f} "
        f"ms; DataParallel over {GPUS} GPU(s): {dp['data_parallel']['step'] * 1e3:.3f} ms"
    )


@pytest.mark.gpu
@requires_2_gpus
@pytest.mark.timeout(420)
def test_bench_predicts_nccl_step_times_and_reports_its_error(clean_env, tmp_path):
    options = ["--rounds", "1", "--steps", "20", "--warmup", "5", "--no-knobs"]
    options += ["--out", str(tmp_path / "bench")]
    out = run_job(
        None, command="bench", launcher_args=options, env=device_env(clean_env, "cuda"), timeout=400
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert result["conditions"]["backend"] == "nccl"
    (row,) = result["predictions"]["this_machine"]
    assert row["world_size"] == 2 and row["measured_step_s"] > 0 and abs(row["error"]) < 10, row
    assert "data_parallel" in result["data_parallel"]
    print("\n" + out.stdout)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.timeout(300)
def test_memory_and_snapshot_benches_report_cuda_figures(clean_env, tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = device_env(clean_env, "cuda")
    out = run(
        [
            sys.executable,
            str(root / "bench" / "memory.py"),
            "--width",
            "256",
            "--blocks",
            "2",
            "--rounds",
            "1",
            "--steps",
            "2",
        ],
        env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert "nccl" in lines[1] and f"{GPUS} rank(s)" in lines[1], lines[:3]
    header = lines[2].split()
    assert "CUDA" in header, header
    for line in lines[3:]:
        cells = line.split()
        state_mib, peak_cuda = float(cells[5]), float(cells[8])
        # Parameters, gradients and optimizer state all live on the GPU at the peak: a lower bound.
        assert peak_cuda >= state_mib * 0.99, line
    out = run(
        [
            sys.executable,
            str(root / "bench" / "snapshot_stall.py"),
            "--width",
            "256",
            "--blocks",
            "2",
            "--repeats",
            "1",
            "--dir",
            str(tmp_path),
        ],
        env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    assert "nccl" in out.stdout.splitlines()[1] and "stall / synchronous save" in out.stdout, (
        out.stdout
    )
