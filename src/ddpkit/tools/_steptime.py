"""One DDP job's step, timed part by part on every rank: data, forward, backward, exposed
all-reduce, optimizer.

How communication is measured, two ways:

- **exposed all-reduce**: every other timed step runs its backward under DDP's ``no_sync()`` (no
  all-reduce; its gradients are dropped and no optimizer step follows). The exposed all-reduce is
  the median backward with synchronisation minus the median backward without: the time the
  all-reduce adds to the step.
- **all-reduce span**: a DDP communication hook (torch's default ``allreduce_hook``, wrapped) stamps
  the moment DDP launches the first bucket and the moment the last bucket's all-reduce completes;
  their difference is the communication time of a step, hidden or not. On CUDA the stamps are CUDA
  events: nccl's future completes on the host as soon as the all-reduce is queued, and its callback
  runs on a stream that waits for the all-reduce, so an event recorded there marks the device's
  completion (a host clock would time the launch). A hook written in Python costs the step itself:
  its callback waits for the GIL on the backend's thread (0.4 to 0.6 ms a step over gloo at 2 ranks
  here, nothing at 1). So the hook is registered only after the step and its parts are timed, and
  the span comes from steps of its own.

On CUDA every part ends with a device synchronisation, so its time is the device's, not the
launch's.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.data import build_loader, to_device
from ddpkit.distributed._collectives import all_gather_object
from ddpkit.distributed._runtime import init
from ddpkit.distributed._seeding import seed_everything
from ddpkit.platforms._cpus import cpu_count
from ddpkit.strategies._prepare import GRADIENT_AS_BUCKET_VIEW, prepare_model
from ddpkit.tools._workload import load_workload

PARTS = ("data", "forward", "backward", "backward_no_sync", "optimizer", "step", "allreduce_span")


@dataclass(frozen=True, kw_only=True)
class Knobs:
    """The DDP and loader settings a timed run uses (the defaults are ``prepare_model``'s and the
    bench's)."""

    bucket_cap_mb: float = 25.0
    """DDP's bucket size (MiB)."""
    gradient_as_bucket_view: bool = GRADIENT_AS_BUCKET_VIEW
    """Gradients are views into DDP's buckets: no copy out of the bucket, less memory."""
    static_graph: bool = False
    """DDP may assume the same parameters get gradients in the same order every step."""
    num_workers: int = 0
    """Loader worker processes per rank (0: the rank loads its own batches)."""
    pin_memory: bool = False
    """Page-locked batches, for faster copies to a GPU (no effect on the CPU)."""

    def label(self) -> str:
        default = Knobs()
        changed = [f"{k}={v}" for k, v in asdict(self).items() if getattr(default, k) != v]
        return ", ".join(changed) or "defaults"


class _CommTimer:
    """A DDP communication hook that all-reduces as DDP does and stamps the first launch and last
    completion: host clock readings on the CPU, CUDA events (read after the step's synchronisation)
    on a GPU."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.first: Any = None
        self.last: Any = None

    def _stamp(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream: in done(), one that waits for the all-reduce
        return event

    def hook(self, state: Any, bucket: Any) -> torch.futures.Future:
        if self.first is None:
            self.first = self._stamp()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self.last = self._stamp()
            return fut.value()

        return allreduce_hook(state, bucket).then(done)

    # DDP checks a hook's annotations against the real types; this module's are strings (postponed).
    hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }

    def take(self) -> float:
        """The last step's span in seconds (0 if nothing was all-reduced); on CUDA, after a
        synchronisation."""
        first, last = self.first, self.last
        self.first, self.last = None, None
        if first is None or last is None:
            return 0.0
        span = first.elapsed_time(last) / 1e3 if self.cuda else last - first
        return max(0.0, span)


def pin_to_core(rank: int, world: int) -> bool:
    """Give each rank a core of its own when there are enough, so that ranks do not migrate between
    cores.

    Every thread of the process: the backend's threads, which run its collectives, were started with
    the process group, and a thread's affinity is its own (a thread started later inherits its
    starter's)."""
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
    """Time ``steps`` DDP steps after ``warmup``; every rank's medians per part (collective: run on
    every rank).

    With ``split_comm``, as many ``no_sync()`` backward steps are interleaved (see the module's
    docstring).
    """
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
    assert isinstance(model, DDP)  # init() made a process group, so prepare_model wrapped the model
    timer = _CommTimer(cuda=rt.device.type == "cuda")
    optimizer = w.optimizer(model.parameters())
    if w.loader is not None:
        loader: Any = w.loader(w.dataset, w.batch_size, rt.rank, rt.world_size)
    else:
        loader = build_loader(
            w.dataset, w.batch_size, num_workers=knobs.num_workers, pin_memory=knobs.pin_memory
        )
    batches = _cycle(loader)
    cuda = rt.device.type == "cuda"

    def now() -> float:
        if cuda:
            torch.cuda.synchronize(rt.device)
        return time.perf_counter()

    times: dict[str, list[float]] = {p: [] for p in PARTS}
    model.train()
    timed = warmup + (2 * steps if split_comm else steps)
    span_steps = max(10, steps // 2) if split_comm else 0
    for i in range(timed + span_steps):
        # the step is timed: now the span, in steps of its own (the module's docstring)
        if i == timed:
            model.register_comm_hook(None, timer.hook)
        no_sync = split_comm and warmup <= i < timed and (i - warmup) % 2 == 1
        t0 = now()
        batch = to_device(next(batches), rt.device)
        t1 = now()
        with model.no_sync() if no_sync else nullcontext():
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
        span = timer.take()  # every step, so that a span never reaches back into the step before
        if i > timed:  # the first step with the hook warms it up
            times["allreduce_span"].append(span)
        elif warmup <= i < timed:
            for part, seconds in zip(
                ("data", "forward", "backward", "optimizer", "step"),
                (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0),
            ):
                times[part].append(seconds)
    medians = {p: statistics.median(v) if v else None for p, v in times.items()}
    grad_bytes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    return {
        "rank": rt.rank,
        "medians": medians,
        "pinned": pinned,
        "threads": torch.get_num_threads(),
        "device": str(rt.device),
        "backend": rt.backend,
        "param_bytes": grad_bytes,
        "batch_size": w.batch_size,
        "every_rank_step": all_gather_object(medians["step"]),
        "step_samples": times["step"],
    }


def single_process_steps(
    script: str | None, data_parallel: bool, steps: int, warmup: int
) -> dict[str, Any]:
    """Median step of the workload on one GPU, or under ``nn.DataParallel`` over every visible GPU
    with the per-GPU batch of a DDP rank (so the three compare at the same work per GPU). CUDA only;
    no process group."""
    seed_everything(0)
    w = load_workload(script)
    gpus = torch.cuda.device_count() if data_parallel else 1
    model: torch.nn.Module = w.model.cuda()
    if data_parallel:
        model = torch.nn.DataParallel(model)
    optimizer = w.optimizer(model.parameters())
    loader = torch.utils.data.DataLoader(
        w.dataset, batch_size=w.batch_size * gpus, shuffle=True, drop_last=True
    )
    batches = _cycle(loader)
    device = torch.device("cuda", 0)
    out = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = w.loss(model, to_device(next(batches), device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return {"gpus": gpus, "step": statistics.median(out), "samples": w.batch_size * gpus}


def cores() -> int:
    return cpu_count()
