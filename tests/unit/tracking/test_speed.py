"""The pieces of a run's speed, without processes: FLOPs per sample, the GPU peak table, which rank
is slow."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ddpkit.tracking._curves import RANKS_PANEL, panels, read_curves
from ddpkit.tracking._speed import (
    PHASES,
    RankTimes,
    RunSpeed,
    Speed,
    StepTimings,
    device_peak,
    peak_flops,
)


def _forward_backward(model: nn.Module, x: torch.Tensor) -> None:
    model(x).sum().backward()


def _counting_speed() -> Speed:
    """A run's speed on the CPU with a peak given: its first micro-batch's FLOPs are counted."""
    model, cpu = nn.Linear(1, 1), torch.device("cpu")
    return Speed(model, cpu, enabled=True, precision="fp32", world_size=1, peak_flops=1e12)


def test_flops_per_sample_of_linear_layers_are_about_six_times_the_weights():
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 8, bias=False))
    x = torch.randn(5, 32)
    speed = _counting_speed()
    assert speed.flops_per_sample is None  # nothing counted yet
    with speed.counting(x):
        _forward_backward(model, x)
    with FlopCounterMode(display=False) as own:  # the counter's own count of the same work
        _forward_backward(model, x)
    assert speed.flops_per_sample == own.get_total_flops() / 5
    weights = 32 * 64 + 64 * 8
    # Forward 2 per weight, the weights' gradients 2, the inputs' gradients 2, except the first
    # layer's input (the data), which needs none: 6 x weights less 2 x the first layer's.
    assert speed.flops_per_sample == 6 * weights - 2 * 32 * 64
    assert 4 * weights < speed.flops_per_sample <= 6 * weights
    assert isinstance(speed.counting(x), contextlib.nullcontext)  # the first micro-batch only


@pytest.mark.parametrize(
    ("name", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "tf32", 417.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA A100-SXM4-40GB", "tf32", 156.0),
        ("NVIDIA A100 80GB PCIe", "fp16", 312.0),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA A10G", "fp32", 31.2),
        ("Tesla V100-SXM2-16GB", "fp16", 125.0),
        ("Tesla V100-PCIE-32GB", "fp32", 14.0),
        ("Tesla T4", "fp16", 65.0),
        ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
        ("NVIDIA GeForce RTX 3090", "tf32", 35.6),
    ],
)
def test_the_peak_table_finds_gpus_by_name(name, dtype, tflops):
    assert peak_flops(name, dtype) == pytest.approx(tflops * 1e12)


def test_unknown_devices_and_dtypes_get_no_peak(monkeypatch):
    # another card, not the 3090's peak
    assert peak_flops("NVIDIA GeForce RTX 3090 Ti", "bf16") is None
    assert peak_flops("Tesla T4", "bf16") is None  # no bf16 on Turing
    assert peak_flops("Some Accelerator 9000", "fp32") is None
    assert device_peak(torch.device("cpu"), "fp32") is None  # the CPU: no MFU rather than a guess
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert device_peak(torch.device("cuda", 0), "fp32") == pytest.approx(494.7e12)  # TF32 allowed
    assert device_peak(torch.device("cuda", 0), "bf16") == pytest.approx(989.4e12)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert device_peak(torch.device("cuda", 0), "fp32") == pytest.approx(66.9e12)  # no TF32


def test_mfu_is_the_flops_the_samples_needed_over_the_devices_peak():
    ms = {p: [1.0, 1.0] for p in PHASES}  # a window of 1 s in which the ranks read 100 samples
    times = RankTimes(ms=ms, step_ms=[10.0, 10.0], wall=1.0, samples=100.0, items=0.0)
    speed = _counting_speed()  # a peak of 1e12 FLOP/s, nothing counted yet: no MFU
    assert "mfu" not in speed.rates(times, tokens=False)
    speed.flops_per_sample, speed.world_size = 1e9, 2
    assert speed.rates(times, tokens=False) == {"samples_per_s": 100.0, "mfu": pytest.approx(0.05)}


def _times(busy: dict[str, list[float]], step: float = 100.0) -> RankTimes:
    ranks = len(next(iter(busy.values())))
    ms = {p: busy.get(p, [0.0] * ranks) for p in PHASES}
    return RankTimes(ms=ms, step_ms=[step] * ranks, wall=1.0, samples=0.0, items=0.0)


def test_the_slowest_rank_is_named_with_its_excess_and_phase():
    times = _times({"data": [10.0, 10.0, 40.0, 10.0], "compute": [50.0, 52.0, 50.0, 51.0]})
    slowest = times.slowest()
    assert (slowest.rank, slowest.phase, slowest.slow) == (2, "data", True)
    assert slowest.excess_ms == pytest.approx(90.0 - 61.0)  # over the other ranks' median
    assert slowest.text() == "rank 2 +29ms (data)"
    record = times.record()
    assert record["busy_ms"] == [60.0, 62.0, 90.0, 61.0] and record["slowest_phase"] == "data"


def test_a_rank_slower_than_the_other_of_two_by_more_than_the_ratio_is_named():
    """At 2 ranks the rank is compared with the other (a median that holds it would be the mean of
    the two: 1.37x the other read as 1.16x, 'ranks even'); at 3 the median of the two others."""
    two = _times({"compute": [20.0, 27.4]}).slowest()
    assert (two.rank, two.slow) == (1, True) and two.ratio == pytest.approx(1.37)
    three = _times({"compute": [20.0, 21.0, 27.0]}).slowest()
    assert three.slow and three.ratio == pytest.approx(27.0 / 20.5)
    # control: within the ratio of the other, nobody is named
    assert not _times({"compute": [20.0, 23.0]}).slowest().slow
    assert _times({"compute": [10.0]}).slowest().ratio == 1.0  # one rank: nobody to compare


def test_control_ranks_within_the_thresholds_are_not_named():
    assert not _times({"compute": [50.0, 55.0, 50.0, 58.0]}).slowest().slow  # 1.1x the median
    # 1.5x the median, but the excess is 1% of the step's wall time: a tiny phase's noise.
    assert not _times({"optimizer": [2.0, 2.0, 3.0]}, step=100.0).slowest().slow
    assert _times({"optimizer": [2.0, 2.0, 30.0]}, step=100.0).slowest().slow


def test_the_run_summary_names_the_slowest_rank_over_all_windows():
    run = RunSpeed()
    for _ in range(3):
        run.add(_times({"compute": [10.0, 30.0]}), steps=5)
    assert (
        run.summary()
        == "  slowest rank 1: 3.00x the other ranks' median busy time, mostly compute; slow in 3 "
        "of 3 windows"
    )
    single = RunSpeed()
    single.add(_times({"compute": [10.0]}), steps=5)
    assert single.summary() is None  # one rank: nobody to compare


def test_plot_reads_each_ranks_busy_time_into_one_panel(tmp_path):
    records = [
        {"kind": "train", "step": 5, "train/loss": 0.9, "samples_per_s": 100.0},
        {"kind": "ranks", "step": 5, "busy_ms": [10.0, 30.0], "slow": True},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    curves = read_curves(tmp_path)
    assert curves["busy_ms/rank1"] == {5: 30.0}
    assert panels(curves)[-2:] == [
        ("samples_per_s", ["samples_per_s"]),
        (RANKS_PANEL, ["busy_ms/rank0", "busy_ms/rank1"]),
    ]


def test_counting_flops_leaves_the_gradients_bitwise_the_same():
    grads = []
    for count in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
        x = torch.randn(8, 16)
        with _counting_speed().counting(x) if count else contextlib.nullcontext():
            _forward_backward(model, x)
        grads.append([p.grad.clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


PAUSE = 0.3


class _SlowBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps ``seconds``, before any parameter's gradient is
    ready."""

    @staticmethod
    def forward(ctx, x, seconds=PAUSE):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def _taken(timings: StepTimings, batches: list[torch.Tensor]):
    """The batches, each handed over to the step timings as the Trainer's step takes it."""
    for batch in batches:
        timings.data(0.0, batch.shape[0])
        yield batch


def _timed_step(mark: bool, communicates: bool = True) -> dict[str, float]:
    """One step of a model whose backward sleeps PAUSE in its middle (compute), and where a callback
    queued by a hook on the model's output sleeps PAUSE more, as FSDP queues its wait for the
    gradients' collectives there and DDP at the last gradient, later."""
    from ddpkit._internals.compiler import at_backward_end

    first, second = nn.Linear(4, 4), nn.Linear(4, 1)
    model = nn.Sequential(first, nn.Tanh(), second)
    timings = StepTimings(model, torch.device("cpu"), communicates=communicates)

    def queue_the_wait(_grad: torch.Tensor) -> None:
        at_backward_end(lambda: time.sleep(PAUSE))

    timings.start_step()
    for x in _taken(timings, [torch.randn(2, 4)]):
        out = second(_SlowBackward.apply(torch.tanh(first(x))))
        out.register_hook(queue_the_wait)
        loss = out.square().mean()
        if mark:
            timings.sync_backward(loss)
        loss.backward()
    timings.before_optimizer()
    timings.after_optimizer()
    return dict(zip(PHASES, timings.row(wall=1.0, items=0.0)))


def test_comm_is_the_wait_after_the_last_gradient_and_compute_the_backward_before_it():
    seconds = _timed_step(mark=True)
    # the callback's sleep, queued at a gradient: after the mark (which the engine runs first)
    assert PAUSE <= seconds["comm"] < 1.8 * PAUSE, seconds
    # the backward's own sleep, before the gradients were ready
    assert PAUSE <= seconds["compute"] < 1.8 * PAUSE, seconds
    # Control: with the step's backward not marked, both sleeps are compute.
    seconds = _timed_step(mark=False)
    assert seconds["comm"] == 0 and seconds["compute"] >= 2 * PAUSE, seconds


def test_in_a_world_of_one_the_backward_is_compute_and_no_hook_is_registered(tmp_path):
    """Nothing communicates in a world of one, DDP-wrapped or not (``ddpkit run --nproc 1`` makes a
    process group): no hook is registered (none to pay for, in the backward or around DDP's
    forward), the step's backward is not marked, and all of it is compute. Controls: the same steps
    where ranks communicate, in the tests just before and after this one, put the queued wait in
    comm."""
    seconds = _timed_step(mark=True, communicates=False)
    assert seconds["comm"] == 0 and seconds["compute"] >= 2 * PAUSE, seconds
    model, cpu = nn.Linear(2, 1), torch.device("cpu")
    speed = Speed(model, cpu, enabled=True, precision="fp32", world_size=1)
    assert not speed.timings._communicates
    # DDP in a world of one, with a buffer DDP would broadcast before each forward
    first, second = nn.Linear(4, 4), nn.Linear(4, 1)
    module = nn.Sequential(first, nn.BatchNorm1d(4), _Short(), second)
    timings, steps, _ = _ddp_steps(tmp_path, module, first, communicates=False)
    assert timings._hooks == []
    for seconds in steps:  # the wait queued at the last gradient is compute too
        assert seconds["comm"] == 0 and seconds["compute"] >= 3 * SHORT, seconds


SHORT = 0.1


def _ddp_steps(
    tmp_path, module: nn.Module, last: nn.Linear, communicates: bool = True, **ddp: Any
) -> tuple[StepTimings, list[dict[str, float]], nn.Module]:
    """Two steps of ``module`` under DDP (a world of one), each a ``no_sync`` micro-batch and a
    synchronising one. Every backward sleeps SHORT before the gradients are ready
    (``_SlowBackward``); the synchronising one also queues a wait of SHORT once ``last``'s
    gradient, the last one ready, is accumulated, as DDP queues its own (registered before the
    timings, as DDP's is). Returns the timings, each step's phases and the DDP model."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddpkit._internals.compiler import at_backward_end

    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    model = DistributedDataParallel(module, **ddp)
    syncing = [False]

    def queue_the_wait(_param: torch.Tensor) -> None:
        if syncing[0]:
            at_backward_end(lambda: time.sleep(SHORT))

    last.weight.register_post_accumulate_grad_hook(queue_the_wait)
    timings = StepTimings(model, torch.device("cpu"), communicates=communicates)
    steps = []
    for _ in range(2):
        timings.start_step()
        for i, x in enumerate(_taken(timings, [torch.randn(2, 4), torch.randn(2, 4)])):
            syncing[0] = i == 1
            with model.no_sync() if i == 0 else contextlib.nullcontext():
                loss = model(x).square().mean()
                if syncing[0]:
                    timings.sync_backward(loss)
                loss.backward()
        timings.before_optimizer()
        timings.after_optimizer()
        steps.append(dict(zip(PHASES, timings.row(wall=1.0, items=0.0))))
    return timings, steps, model


@pytest.mark.parametrize("unused", [False, True], ids=["anchored", "find_unused_parameters"])
def test_under_ddp_the_step_is_marked_by_a_hook_on_a_parameters_accumulation(tmp_path, unused):
    """Under DDP (which requires every parameter's gradient) the mark is a hook registered once on
    one parameter's gradient accumulation, armed for the step's synchronising backward (checked
    against the hook on the loss's node at the first), and queued ahead of DDP's wait, queued at the
    last gradient: that wait is comm, the no_sync micro-batch's backward is compute. With
    ``find_unused_parameters`` (a parameter may get no gradient) the hook on the loss's node marks
    the step the same. Control: a backward through the model outside a step is not marked."""
    first, second = nn.Linear(4, 4), nn.Linear(4, 1)
    timings, steps, model = _ddp_steps(
        tmp_path,
        nn.Sequential(first, _Short(), second),
        first,
        find_unused_parameters=unused,
    )
    # anchored, and checked at the first step: the second was marked by the anchor alone
    assert (timings._anchor is not None and timings._anchor_checked) == (not unused)
    for seconds in steps:
        # a sleep counted in the other phase would leave this one short of it
        assert seconds["comm"] >= SHORT and seconds["compute"] >= 2 * SHORT, seconds
    # outside a step (a callback's own backward through the model): nothing marked
    model(torch.randn(2, 4)).sum().backward()
    assert timings._last_grad is None and not timings._armed
    timings.close()


class _Short(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SlowBackward.apply(torch.tanh(x), SHORT)


class _Checkpointed(nn.Module):
    """A first layer, a middle block under activation checkpointing (its parameters named first:
    the anchor), a head."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.middle, self.first, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = checkpoint(self.middle, self.first(x), use_reentrant=self.reentrant)
        return self.head(_SlowBackward.apply(torch.tanh(x), SHORT))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "control"])
def test_an_anchor_accumulated_in_a_nested_backward_gives_way_to_the_loss_node(tmp_path, reentrant):
    """Under reentrant activation checkpointing, a parameter of the checkpointed block has its
    gradient accumulated in a backward nested in the step's, whose callbacks run when it ends: a
    mark queued there would come before the rest of the step's backward. The first step's check
    sees it and the loss's node marks from then on, with the wait still comm. Control: without
    reentrance the anchor stays."""
    module = _Checkpointed(reentrant)
    timings, steps, _ = _ddp_steps(tmp_path, module, module.first)
    assert (timings._anchor is None) == reentrant
    for seconds in steps:
        assert SHORT <= seconds["comm"] < SHORT + 0.25, seconds


@pytest.mark.gpu
@pytest.mark.parametrize("mark", [True, False], ids=["marked", "control"])
def test_on_cuda_the_phases_are_read_from_events_on_the_device(mark):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from ddpkit._internals.compiler import at_backward_end

    model = nn.Linear(2048, 2048).cuda()
    timings = StepTimings(model, torch.device("cuda"))
    x = torch.randn(512, 2048, device="cuda")

    def device_work() -> None:  # queued as DDP queues its wait: device time after the gradients
        for _ in range(30):
            x @ x.T

    def queue_device_work(_grad: torch.Tensor) -> None:
        at_backward_end(device_work)

    for _ in range(5):
        timings.start_step()
        for i, batch in enumerate(_taken(timings, [x, x])):
            out = model(batch)
            out.register_hook(queue_device_work)
            loss = out.square().mean()
            if mark and i == 1:
                timings.sync_backward(loss)
            loss.backward()
        timings.before_optimizer()
        for _ in range(100):  # device work queued in the optimizer's span: the host returns at once
            x @ x.T
        timings.after_optimizer()
    row = timings.row(wall=1.0, items=0.0)
    seconds = dict(zip(PHASES, row))
    assert row[len(PHASES) + 1] == 5 * 2 * 512  # the samples read
    assert 0 < seconds["compute"] < seconds["optimizer"]
    if mark:  # the last backward's queued device work, after its gradients' event
        assert seconds["comm"] > 0.2 * seconds["compute"]
    else:  # Control: with no mark, all of it is compute.
        assert seconds["comm"] == 0


def test_a_peak_that_is_not_positive_is_refused_naming_the_option():
    from ddpkit._errors import ConfigError
    from ddpkit.training._config import LoggingConfig

    with pytest.raises(
        ConfigError, match="peak_flops=0 is not valid: see LoggingConfig.peak_flops"
    ):
        LoggingConfig(peak_flops=0)
