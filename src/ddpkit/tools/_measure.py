"""What ``ddpkit bench`` times inside its ranks: a DDP step part by part (data, forward, backward,
exposed all-reduce, optimizer, all-reduce span), and the backend's all-reduce alone.

The exposed all-reduce is backward less backward under ``no_sync()`` (every other timed step); the
span comes from a communication hook, in steps of their own after the timed ones (docs:
bench-and-check.md). On CUDA every part ends with a device synchronisation.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.data import build_loader, to_device
from ddpkit.distributed._collectives import all_reduce, barrier, comm_device
from ddpkit.distributed._runtime import init
from ddpkit.distributed._seeding import seed_everything
from ddpkit.strategies._prepare import GRADIENT_AS_BUCKET_VIEW, prepare_model
from ddpkit.tools._predict import BUCKET_CAP_MB
from ddpkit.tools._workload import Workload, load_workload

PARTS = ("data", "forward", "backward", "backward_no_sync", "optimizer", "step", "allreduce_span")
DEFAULT_SIZES = tuple(4**k for k in range(1, 13))  # 4 B .. 16 MiB


@dataclass(frozen=True, kw_only=True)
class Knobs:
    """The DDP and loader settings a timed run uses (the defaults are ``prepare_model``'s)."""

    bucket_cap_mb: float = BUCKET_CAP_MB
    gradient_as_bucket_view: bool = GRADIENT_AS_BUCKET_VIEW
    static_graph: bool = False
    num_workers: int = 0
    """Loader worker processes per rank."""
    pin_memory: bool = False

    def label(self) -> str:
        default = Knobs()
        changed = [f"{k}={v}" for k, v in asdict(self).items() if getattr(default, k) != v]
        return ", ".join(changed) or "defaults"


class _CommTimer:
    """A communication hook that all-reduces as DDP does and stamps the first launch and last
    completion: host clock readings on the CPU, CUDA events on a GPU (recorded in the future's
    callback, on a stream that waits for the all-reduce)."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.first: Any = None
        self.last: Any = None

    def _stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def hook(self, state: Any, bucket: Any) -> torch.futures.Future:
        if self.first is None:
            self.first = self._stamp()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self.last = self._stamp()
            return fut.value()

        return allreduce_hook(state, bucket).then(done)

    # DDP checks a hook's annotations against the real types; this module's are strings.
    hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }

    def take(self) -> float:
        """The last step's span in seconds (0 if nothing was all-reduced)."""
        first, last = self.first, self.last
        self.first, self.last = None, None
        if first is None or last is None:
            return 0.0
        span = first.elapsed_time(last) / 1e3 if self.cuda else last - first
        return max(0.0, span)


def pin_to_core(rank: int, world: int) -> bool:
    """Pin every thread of this process (the backend's too) to a core of its own, if enough."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < world * torch.get_num_threads():
        return False
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for task in tasks:
        with contextlib.suppress(OSError):  # a thread that has just ended
            os.sched_setaffinity(int(task), {cores[rank]})
    return True


def _cycle(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def measure_steps(
    script: str | None, knobs: Knobs, steps: int, warmup: int, split_comm: bool, pin: bool = True
) -> dict[str, Any]:
    """Time ``steps`` DDP steps after ``warmup``; this rank's medians per part (collective). With
    ``split_comm``, as many ``no_sync()`` backward steps are interleaved."""
    rt = init()
    pinned = pin_to_core(rt.rank, rt.world_size) if pin and rt.device.type == "cpu" else False
    seed_everything(0)
    w = load_workload(script, rt.world_size)
    model = prepare_model(
        w.model,
        bucket_cap_mb=knobs.bucket_cap_mb,
        static_graph=knobs.static_graph,
        gradient_as_bucket_view=knobs.gradient_as_bucket_view,
    )
    assert isinstance(model, DDP)  # init() made a process group
    optimizer = w.optimizer(model.parameters())
    if w.loader is not None:
        loader: Any = w.loader(w.dataset, w.batch_size, rt.rank, rt.world_size)
    else:
        loader = build_loader(
            w.dataset,
            w.batch_size,
            num_workers=knobs.num_workers,
            pin_memory=knobs.pin_memory,
            collate_fn=w.collate_fn,
        )
    batches = _cycle(loader)
    times = _timed_steps(w, model, optimizer, batches, rt.device, (steps, warmup), split_comm)
    medians = {p: statistics.median(v) if v else None for p, v in times.items()}
    return {
        "medians": medians,
        "pinned": pinned,
        "threads": torch.get_num_threads(),
        "device": str(rt.device),
        "backend": rt.backend,
        "param_bytes": [
            p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
        ],
        "batch_size": w.batch_size,
        "step_samples": times["step"],
    }


def _timed_steps(
    w: Workload,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterator[Any],
    device: torch.device,
    counts: tuple[int, int],
    split_comm: bool,
) -> dict[str, list[float]]:
    """Each part's seconds per timed step; then, with the hook on, the all-reduce span. Only with
    ``split_comm`` is ``model`` a DDP's (``no_sync``, the hook)."""
    (steps, warmup), cuda = counts, device.type == "cuda"

    def now() -> float:
        _sync(device)
        return time.perf_counter()

    timer = _CommTimer(cuda=cuda)
    times: dict[str, list[float]] = {p: [] for p in PARTS}
    model.train()
    timed = warmup + (2 * steps if split_comm else steps)
    span_steps = max(10, steps // 2) if split_comm else 0
    for i in range(timed + span_steps):
        if i == timed:
            cast(DDP, model).register_comm_hook(None, timer.hook)
        no_sync = split_comm and warmup <= i < timed and (i - warmup) % 2 == 1
        t0 = now()
        batch = to_device(next(batches), device)
        t1 = now()
        with cast(DDP, model).no_sync() if no_sync else nullcontext():
            loss = w.loss(model, batch)
            t2 = now()
            loss.backward()
            t3 = now()
        if no_sync:
            optimizer.zero_grad(set_to_none=True)
            times["backward_no_sync"].append(t3 - t2)
            continue
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t4 = now()
        span = timer.take()  # every step: a span never reaches back into the step before
        if i > timed:  # the first step with the hook warms it up
            times["allreduce_span"].append(span)
        elif warmup <= i < timed:
            parts = ("data", "forward", "backward", "optimizer", "step")
            for part, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                times[part].append(seconds)
    return times


def single_process_steps(
    script: str | None, data_parallel: bool, steps: int, warmup: int
) -> dict[str, Any]:
    """Median step of the workload on one GPU, or under ``nn.DataParallel`` over every visible GPU
    at the per-GPU batch of a DDP rank. CUDA only; no process group."""
    seed_everything(0)
    w = load_workload(script)
    gpus = torch.cuda.device_count() if data_parallel else 1
    model: torch.nn.Module = w.model.cuda()
    if data_parallel:
        model = torch.nn.DataParallel(model)
    optimizer = w.optimizer(model.parameters())
    loader = torch.utils.data.DataLoader(
        w.dataset,
        batch_size=w.batch_size * gpus,
        shuffle=True,
        drop_last=True,
        collate_fn=w.collate_fn,
    )
    # timed as DDP's steps are, parts synchronised
    device, counts = torch.device("cuda", 0), (steps, warmup)
    times = _timed_steps(w, model, optimizer, _cycle(loader), device, counts, split_comm=False)
    return {"gpus": gpus, "step": statistics.median(times["step"]), "samples": w.batch_size * gpus}


def measure_allreduce(sizes: tuple[int, ...]) -> list[tuple[int, float]]:
    """Seconds per float32 all-reduce of each size in bytes (collective): back to back, as
    nccl-tests times them, for at least 20 ms; the slowest rank's time, the fastest of 5."""
    device = comm_device()
    out = []
    for nbytes in sizes:
        x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        _sync(device)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        _sync(device)
        # the same count on every rank, or ranks would enter different numbers of collectives
        once = all_reduce(time.perf_counter() - t0, op="max")
        iters = max(3, min(1000, math.ceil(0.02 / max(once, 1e-7))))
        times = []
        for _ in range(5):
            barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(x)
            _sync(device)
            times.append(all_reduce((time.perf_counter() - t0) / iters, op="max"))
        out.append((x.numel() * 4, min(times)))
    return out


def measure_in_step(buckets: list[int], compute_s: float) -> float:
    """Seconds a step spends in the all-reduces of ``buckets`` when each step first computes for
    ``compute_s`` on every rank, as a DDP step on the CPU does: the slowest rank's median of 60
    steps after 10 (collective)."""
    x = torch.randn(128, 128)
    tensors = [torch.ones(max(1, b // 4), dtype=torch.float32) for b in buckets]
    times = []
    for i in range(70):
        t = time.perf_counter()
        while time.perf_counter() - t < compute_s:
            x @ x
        t0 = time.perf_counter()
        for tensor in tensors:
            dist.all_reduce(tensor)
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return all_reduce(statistics.median(times), op="max")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
