"""Training on each device: mixed precision killed and resumed bit for bit, a sample's random draws
on the GPU, pinned batches and asynchronous copies, exact evaluation, and the sharding strategies
with their memory.

Tests that take the device as a parameter run with gloo on CPU processes (``cpu``) and with nccl on
the GPUs (``cuda``, marked ``gpu``; one rank per GPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddpkit.testing import run_job
from tests.device_support import CUDA_MARKS, SCRIPTS, device_env, device_params, nprocs
from tests.jobs.scripts.train_job import N_SAMPLES
from tests.trainer_checks import (
    assert_each_sample_once,
    bitwise_equal,
    max_abs_diff,
    resume_steps,
    samples_per_epoch,
)

JOB = str(SCRIPTS / "device_train_job.py")


def _train(tmp: Path, name: str, device: str, env: dict, *args: str) -> dict:
    (tmp / f"{name}-log").mkdir()
    job = [
        str(tmp / name),
        "--out",
        str(tmp / f"{name}.pt"),
        "--sample-log",
        str(tmp / f"{name}-log"),
    ]
    options = ["--max-restarts", "2", "--log-dir", str(tmp / "logs")]
    out = run_job(
        JOB, *job, *args, nproc=nprocs(device), launcher_args=options, env=env, cwd=tmp, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return torch.load(tmp / f"{name}.pt", map_location="cpu", weights_only=False)


@pytest.mark.parametrize(
    "device,precision",
    [
        pytest.param("cpu", "bf16", marks=pytest.mark.slow, id="cpu-bf16"),
        pytest.param("cuda", "bf16", marks=CUDA_MARKS, id="cuda-bf16"),
        pytest.param("cuda", "fp16", marks=CUDA_MARKS, id="cuda-fp16"),
    ],
)
@pytest.mark.timeout(900)  # three jobs, one of them restarted; on 2 CPU cores under load, minutes
def test_mixed_precision_killed_and_resumed_ends_bitwise_where_an_uninterrupted_run_does(
    device, precision, clean_env, tmp_path
):
    # Dropout draws on the device (on a GPU, from the CUDA generator, whose state every snapshot
    # holds), and every sample is perturbed by noise drawn on the device while loading (seeded from
    # (seed, epoch, index)).
    env = device_env(clean_env, device)
    reference = _train(tmp_path, "reference", device, env, "--precision", precision)
    killed = _train(tmp_path, "killed", device, env, "--precision", precision, "--kill-step", "7")
    assert list((tmp_path / "killed-log").glob("killed-*")) and killed["attempt"] >= 1, (
        "no kill, or no restart"
    )
    assert_each_sample_once(
        samples_per_epoch(tmp_path / "killed-log", resume_steps(tmp_path / "killed")), N_SAMPLES, 3
    )
    if precision == "fp16":
        assert killed["scale"] == reference["scale"], (killed["scale"], reference["scale"])
    print(
        f"\n{device} {precision}: killed at step 7, resumed from step {killed['resumed_from']}: "
        f"max |dw| {max_abs_diff(killed, reference):.1e}"
    )
    assert bitwise_equal(killed, reference), f"max |dw| {max_abs_diff(killed, reference):.1e}"
    if device == "cuda" and precision == "bf16":
        # Control: the same kill, resumed with everything but the CUDA generators' states, ends
        # elsewhere (the dropout masks after the resume are not the uninterrupted run's).
        control = _train(
            tmp_path,
            "control",
            device,
            env,
            "--precision",
            precision,
            "--kill-step",
            "7",
            "--drop-cuda-rng",
        )
        print(
            "control, CUDA generators not restored: max |dw| "
            f"{max_abs_diff(control, reference):.1e}"
        )
        assert control["attempt"] >= 1 and not bitwise_equal(control, reference)


_SAMPLE_DRAWS = """
import json
import torch
import ddpkit
from torch.utils.data import Dataset

rt = ddpkit.init()  # a world of one, on the GPU where there is one
# As in training, the model is on the device before any batch.
model = torch.nn.Linear(3, 3).to(rt.device)


class DrawsOnTheDevice(Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.randn(3, device=rt.device).cpu(), i


def draws(seed_samples, cursor=0, bs=4):
    loader = ddpkit.build_loader(
        DrawsOnTheDevice(), bs, seed=5, num_workers=0, seed_samples=seed_samples
    )
    loader.batch_sampler.set_position(0, cursor)  # a run resumed after `cursor` samples of epoch 0
    return {int(i): x.tolist() for xs, idx in loader for x, i in zip(xs, idx)}


def stream_moved(seed_samples):
    torch.manual_seed(1)
    expected = torch.rand(4, device=rt.device).tolist()
    torch.manual_seed(1)
    draws(seed_samples)
    return torch.rand(4, device=rt.device).tolist() != expected  # what dropout would draw next


out = {}
for seeded in (True, False):
    whole, resumed = draws(seeded), draws(seeded, cursor=8)
    out[str(seeded)] = {
        "resumed_equal": all(resumed[i] == whole[i] for i in resumed),
        "resumed": len(resumed),
        "stream_moved": stream_moved(seeded),
    }
# What is not supported: CUDA in a loader worker forked from a process using it.
if rt.device.type == "cuda":
    try:
        next(iter(ddpkit.build_loader(DrawsOnTheDevice(), 4, seed=5, num_workers=2)))
        out["forked_workers"] = "ran"
    except Exception as err:
        out["forked_workers"] = f"{type(err).__name__}: {err}"
print(json.dumps(out))
"""


@pytest.mark.parametrize("device", device_params(cpu_slow=True))
def test_a_samples_draws_on_its_device_follow_the_sample_and_leave_the_training_stream(
    device, clean_env, run_python
):
    out = run_python(_SAMPLE_DRAWS, env=device_env(clean_env, device), timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    seeded, plain = result["True"], result["False"]
    assert seeded == {"resumed_equal": True, "resumed": 4, "stream_moved": False}, seeded
    # Control: drawn from the process's own stream, a resumed epoch draws other noise for the same
    # samples, and loading moves the stream dropout draws from.
    assert plain == {"resumed_equal": False, "resumed": 4, "stream_moved": True}, plain
    # the limit: such a dataset needs num_workers=0 (torch refuses CUDA in a forked worker)
    if device == "cuda":
        assert "Cannot re-initialize CUDA in forked subprocess" in result["forked_workers"], result[
            "forked_workers"
        ]


_PINNED = """
import json, time
import torch
import ddpkit
from torch.utils.data import TensorDataset

rt = ddpkit.init()
data = TensorDataset(torch.randn(64, 256, 256), torch.arange(64))
out = {}
for workers in (0, 2):
    loader = ddpkit.build_loader(data, 8, num_workers=workers)
    batch = next(iter(loader))
    out[f"pinned_{workers}"] = [loader.pin_memory, batch[0].is_pinned(), batch[1].is_pinned()]
unpinned = [t.clone() for t in batch]
plain = ddpkit.build_loader(data, 8, num_workers=0, pin_memory=False)
out["control_pin_false"] = [plain.pin_memory, next(iter(plain))[0].is_pinned()]
if rt.device.type == "cuda":
    # A kernel that keeps the GPU busy (torch's spin kernel; cycles measured first) makes the
    # difference between a copy that waits for the GPU and one that is queued behind its work
    # observable on the host.
    def spin(cycles):
        t0 = time.perf_counter()
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize()
        return time.perf_counter() - t0
    spin(10**6)
    rate = 2 * 10**8 / spin(2 * 10**8)  # cycles per second
    cycles = int(0.5 * rate)
    timed = {}
    for name, source, non_blocking in (("pinned", batch, True), ("pageable", unpinned, True),
                                       ("blocking", batch, False)):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        moved = ddpkit.data.to_device(source, rt.device, non_blocking=non_blocking)
        timed[name] = time.perf_counter() - t0
        torch.cuda.synchronize()
        out[f"equal_{name}"] = all(torch.equal(m.cpu(), s) for m, s in zip(moved, source))
        out[f"device_{name}"] = str(moved[0].device)
    out["spin_s"] = spin(cycles)
    out["copy_s"] = timed
print(json.dumps(out))
"""


@pytest.mark.parametrize("device", device_params(cpu_slow=True))
def test_the_loader_pins_batches_for_a_gpu_and_copies_them_without_waiting(
    device, clean_env, run_python
):
    out = run_python(_PINNED, env=device_env(clean_env, device), timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    pin = device == "cuda"
    assert result["pinned_0"] == [pin, pin, pin] and result["pinned_2"] == [pin, pin, pin], result
    assert result["control_pin_false"] == [False, False]
    if device == "cpu":
        return
    copy_s, spin_s = result["copy_s"], result["spin_s"]
    assert all(result[f"equal_{k}"] and result[f"device_{k}"] == "cuda:0" for k in copy_s), result
    # Pinned, non-blocking (build_loader's batches, to_device's default): queued, the host goes on
    # at once.
    assert copy_s["pinned"] < 0.2 * spin_s, result
    # Control: a blocking copy waits for the busy GPU.
    assert copy_s["blocking"] > 0.5 * spin_s, result
    print(
        f"\nGPU busy {spin_s * 1e3:.0f} ms; host time of the copy: pinned non-blocking "
        f"{copy_s['pinned'] * 1e3:.2f} ms, pageable non-blocking {copy_s['pageable'] * 1e3:.1f} "
        f"ms, blocking {copy_s['blocking'] * 1e3:.1f} ms"
    )


_EVALUATE = """
import json, sys
import torch
import ddpkit
from torch import nn
from torch.utils.data import TensorDataset

g = torch.Generator().manual_seed(0)
x, y = torch.randn(1001, 16, generator=g), torch.randint(0, 5, (1001,), generator=g)
data = TensorDataset(x, y)


def model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 5))


def metric_fn(model, batch):
    inputs, targets = batch
    logits = model(inputs)
    return {"loss": nn.functional.cross_entropy(logits.float(), targets, reduction="none"),
            "accuracy": (logits.argmax(1) == targets).float(),
            "in_bf16": torch.full((len(targets),), float(logits.dtype == torch.bfloat16))}


def rank_job(bf16):
    rt = ddpkit.init()
    m = ddpkit.prepare_model(model())
    m.train()
    # A training forward: BatchNorm's running statistics move.
    m(x[:32].to(rt.device)).sum().backward()
    autocast = (lambda: torch.autocast(rt.device.type, dtype=torch.bfloat16)) if bf16 else None
    metrics = ddpkit.evaluate(m, data, metric_fn, batch_size=64, autocast=autocast)
    return metrics | {"device": str(rt.device), "backend": rt.backend}


n = int(sys.argv[1])
fp32, bf16 = (ddpkit.spawn(rank_job, n, args=(b,)) for b in (False, True))
# The reference: one process, float64, on the CPU, with the statistics the first training forward
# left.
ref = model().double()
ref.train()
ref(x[:32].double())
ref.eval()
with torch.no_grad():
    logits = ref(x.double())
    loss = nn.functional.cross_entropy(logits, y, reduction="none").mean().item()
    accuracy = (logits.argmax(1) == y).double().mean().item()
print(json.dumps({"fp32": fp32, "bf16": bf16, "loss": loss, "accuracy": accuracy}))
"""


@pytest.mark.parametrize("device", device_params(cpu_slow=True))
@pytest.mark.timeout(300)
def test_evaluate_on_the_device_counts_every_sample_once_and_runs_autocast(
    device, clean_env, run_python
):
    n = nprocs(device)
    out = run_python(
        _EVALUATE.replace("int(sys.argv[1])", str(n)),
        env=device_env(clean_env, device),
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    for rank, metrics in enumerate(result["fp32"]):
        assert metrics["device"] == ("cpu" if device == "cpu" else f"cuda:{rank}")
        assert metrics["backend"] == ("gloo" if device == "cpu" else "nccl")
        assert metrics["loss"] == pytest.approx(result["loss"], rel=1e-5), (metrics, result["loss"])
        # A near tie between two logits may fall the other way in float32 than in float64: one
        # sample's worth.
        assert metrics["accuracy"] == pytest.approx(result["accuracy"], abs=1.5 / 1001)
        assert metrics["in_bf16"] == 0.0
    # With the Trainer's autocast every forward of the evaluation runs in bfloat16 (control: without
    # it, none did), and the loss stays within bfloat16's rounding of the exact one.
    for metrics in result["bf16"]:
        assert metrics["in_bf16"] == 1.0, metrics
        assert metrics["loss"] == pytest.approx(result["loss"], rel=1e-2)


_STRATEGIES = """
import gc, json, sys
import torch
import ddpkit
from torch import nn
from ddpkit.strategies import build_strategy, strategy_config
from ddpkit.strategies._fsdp import _local
from ddpkit.demo._models import Block


def state_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def train(name, options):
    rt = ddpkit.get_runtime()
    cuda = rt.device.type == "cuda"
    # What an earlier strategy left is freed before the baseline, not during this one's steps.
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(rt.device)
        torch.cuda.reset_peak_memory_stats(rt.device)
    torch.manual_seed(0)
    model = nn.Sequential(*[Block(256) for _ in range(2)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    strategy = build_strategy(strategy_config(name, options), model, optimizer, runtime=rt)
    del optimizer
    del model
    g = torch.Generator().manual_seed(rt.rank)
    for _ in range(5):
        x = torch.randn(16, 256, generator=g).to(rt.device)
        strategy.model(x).square().mean().backward()
        assert strategy.check_gradients(None).finite
        grads = state_bytes(p.grad for p in strategy.model.parameters() if p.grad is not None)
        after_backward = torch.cuda.memory_allocated(rt.device) - base if cuda else None
        strategy.optimizer.step()
        strategy.optimizer.zero_grad(set_to_none=True)
    optim = getattr(strategy.optimizer, "optim", strategy.optimizer)
    sizes = {
        "params": state_bytes(strategy.model.parameters()),
        "grads": grads,
        "optimizer": state_bytes(
            v for s in optim.state.values() for v in s.values() if torch.is_tensor(v)
        ),
        "peak_cuda": torch.cuda.max_memory_allocated(rt.device) - base if cuda else None,
        "after_backward_cuda": after_backward,
    }
    weights = {k: v.detach().double().cpu() for k, v in strategy.full_state_dict()["model"].items()}
    del strategy
    return sizes, weights


def rel(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item() for k in b)


def rank_job():
    rt = ddpkit.init()
    sizes, weights = {}, {}
    for name, options in (("ddp", {}), ("zero", {}), ("fsdp", {"shard_blocks": ["Block"]}),
                          ("fsdp_bf16", {"shard_blocks": ["Block"], "param_dtype": "bf16"})):
        sizes[name], weights[name] = train(name.split("_")[0], options)
    return {"sizes": sizes, "vs_ddp": {k: rel(w, weights["ddp"]) for k, w in weights.items()},
            "device": str(rt.device), "backend": rt.backend}


print(json.dumps(ddpkit.spawn(rank_job, int(sys.argv[1]))))
"""


@pytest.mark.parametrize("device", device_params(cpu_slow=True))
@pytest.mark.timeout(300)
def test_zero_and_fsdp_train_what_ddp_trains_with_a_share_of_its_memory(
    device, clean_env, run_python
):
    n = nprocs(device)
    code = _STRATEGIES.replace("int(sys.argv[1])", str(n))
    out = run_python(code, env=device_env(clean_env, device), timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    mib = 2**20
    for rank, seen in enumerate(json.loads(out.stdout.splitlines()[-1])):
        assert seen["device"] == ("cpu" if device == "cpu" else f"cuda:{rank}"), seen
        assert seen["backend"] == ("gloo" if device == "cpu" else "nccl")
        vs_ddp, sizes = seen["vs_ddp"], seen["sizes"]
        assert vs_ddp["zero"] < 1e-5 and vs_ddp["fsdp"] < 1e-5, vs_ddp
        # Control: bf16 parameters (fsdp's mixed precision) train measurably elsewhere: the
        # comparison can fail.
        assert vs_ddp["fsdp_bf16"] > 1e-4, vs_ddp
        ddp = sizes["ddp"]
        if n > 1:  # the shares: zero keeps 1/N of the optimizer state, fsdp 1/N of all three
            assert sizes["zero"]["optimizer"] < 0.6 * ddp["optimizer"], sizes
            for part in ("params", "grads", "optimizer"):
                assert sizes["fsdp"][part] < 0.6 * ddp[part], (part, sizes)
        if device == "cuda":
            for name in ("ddp", "zero", "fsdp"):
                r = sizes[name]
                # Lower bounds: parameters and their gradients are on the GPU once backward is done,
                # and parameters and optimizer state while the optimizer steps. (Whether gradients
                # and optimizer state peak together is the allocator's business: fsdp at one rank
                # measured below their sum.)
                assert r["after_backward_cuda"] >= r["params"] + r["grads"], (name, r)
                assert r["peak_cuda"] >= r["params"] + r["optimizer"], (name, r)
            print(
                f"\nrank {rank} of {n}, MiB of max_memory_allocated (of state): "
                + ", ".join(
                    f"{name} {sizes[name]['peak_cuda'] / mib:.2f} "
                    f"({sum(sizes[name][k] for k in ('params', 'grads', 'optimizer')) / mib:.2f})"
                    for name in ("ddp", "zero", "fsdp")
                )
                + ("; one rank: the 1/N shares need 2 GPUs" if n == 1 else "")
            )
