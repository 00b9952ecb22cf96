"""Launch a function on N local processes from Python: for notebooks and tests, as the seeds' ``mp.spawn``."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddpkit import runtime
from ddpkit.cluster import cpu_count


def _worker(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    nprocs: int,
    port: int,
    threads: int,
    results: Any,
) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # The parent holds the rendezvous store (see spawn), so every rank connects to it as a client, the
        # way torchrun's workers connect to their agent's store.
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS=str(threads),
    )
    torch.set_num_threads(threads)
    runtime._runtime = None  # a forked child must not inherit the parent's runtime
    try:
        out = fn(*args)
        results.put((local_rank, pickle.dumps(out)))
    finally:
        runtime.shutdown()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    *,
    start_method: str | None = None,
    threads_per_process: int | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes that form one job; return each rank's result.

    Inside ``fn``, :func:`ddpkit.init` sees RANK, WORLD_SIZE and the rest as under torchrun. If any process
    raises, the others are stopped and the exception is raised here with that rank's traceback.
    ``start_method`` defaults to ``"fork"`` where it is safe (POSIX, CUDA not yet initialised in this process),
    so a function defined in a notebook cell works; else ``"spawn"``, which needs ``fn`` importable.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs}: spawn needs at least one process")
    if start_method is None:
        forkable = "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized()
        start_method = "fork" if forkable else "spawn"
    threads = threads_per_process or max(1, cpu_count() // nprocs)
    # A store opened here on port 0 gets a free port from the OS and keeps it: no window in which another
    # job could take the port between choosing and binding it.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    results = mp.get_context(start_method).SimpleQueue()
    out: list[Any] = [None] * nprocs

    def drain() -> None:
        while not results.empty():
            r, payload = results.get()
            out[r] = pickle.loads(payload)

    try:
        context = mp.start_processes(
            _worker,
            args=(fn, args, nprocs, store.port, threads, results),
            nprocs=nprocs,
            join=False,
            start_method=start_method,
        )
        # Drain results while waiting: a child blocked on a full pipe would otherwise never exit.
        while not context.join(timeout=0.05):
            drain()
        drain()
        return out
    finally:
        del store
