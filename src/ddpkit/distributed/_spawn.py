"""Launch a function on N local processes from Python (notebooks, tests), as ``mp.spawn``:
``spawn(fn, nprocs, args)`` calls ``fn(*args)``, ``pass_rank=True`` ``fn(rank, *args)``, said in
the call, never guessed from ``fn``.
"""

from __future__ import annotations

import inspect
import os
import pickle
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp

from ddpkit._errors import ConfigError
from ddpkit._internals.compiler import autograd_device_threads
from ddpkit._internals.store import serve_store, use_agent_store
from ddpkit.distributed import _runtime as runtime
from ddpkit.platforms._cpus import cpu_count

_store: Any = None
"""Rank 0's store server, kept for the life of the process."""


def _worker(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    nprocs: int,
    listener: socket.socket,
    threads: int,
    results: Any,
    pass_rank: bool,
) -> None:
    global _store
    port = listener.getsockname()[1]
    if local_rank == 0:  # serves the job's store on the socket spawn() bound; every rank connects
        _store = serve_store(listener.detach(), "127.0.0.1", port, timedelta(minutes=5))
    else:
        listener.close()
    use_agent_store()
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
    )
    os.environ.pop("GROUP_WORLD_SIZE", None)  # a torchrun job's node count, not this world's
    torch.set_num_threads(threads)
    runtime.forget()  # a forked child must not inherit the parent's runtime
    try:
        out = fn(local_rank, *args) if pass_rank else fn(*args)
        results.put((local_rank, pickle.dumps(out)))
    except BaseException:
        # the others may be stuck waiting for this rank: do not wait for them
        runtime.shutdown(wait_for_peers=False)
        raise
    runtime.shutdown()


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple[Any, ...] = (),
    *,
    start_method: str | None = None,
    threads_per_process: int | None = None,
    pass_rank: bool = False,
    timeout: float | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local processes that form one job; return each rank's result.

    ``pass_rank=True`` calls ``fn(rank, *args)`` instead, as ``torch.multiprocessing.spawn`` does
    (the DDP tutorials' ``train(rank, world_size)``); a call that cannot fit ``fn`` is refused
    before any process starts, naming ``pass_rank``. Inside ``fn``, :func:`ddpkit.init` sees the
    ranks as under torchrun. If any process raises, the others are stopped and the exception is
    raised here with that rank's traceback.

    ``start_method`` is ``"fork"`` where it is safe (POSIX, CUDA not initialised here and no
    backward run here on a machine with a GPU), so a function of a notebook cell works, else
    ``"spawn"``, which needs ``fn`` importable. A forked process runs one intra-op thread (OpenMP's
    pool does not survive ``fork``); pass ``start_method="spawn"`` for more. ``timeout`` (seconds):
    processes still running by then are killed, and :class:`TimeoutError` names them.
    """
    if not isinstance(nprocs, int) or not isinstance(args, tuple):
        raise ConfigError(
            f"spawn(fn, nprocs={nprocs!r}, args={args!r}): nprocs is a number and args a tuple; "
            "torch's mp.spawn takes args second, ddpkit.spawn nprocs: pass both by name "
            "(args=..., nprocs=...)"
        )
    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs}: spawn needs at least one process")
    _check_call(fn, args, pass_rank)
    start_method, threads = _start_method(start_method, threads_per_process, nprocs)
    # Rank 0 serves the store (a child forked while a store thread here holds glibc's resolver lock
    # hangs), on a socket bound here: a port found free and bound later could be taken meanwhile.
    results = mp.get_context(start_method).SimpleQueue()
    with socket.create_server(("127.0.0.1", 0), backlog=1024) as listener:
        worker_args = (fn, args, nprocs, listener, threads, results, pass_rank)
        context = mp.start_processes(
            _worker, worker_args, nprocs, join=False, start_method=start_method
        )
    try:
        return _results(context, results, nprocs, timeout)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()


def _start_method(method: str | None, threads: int | None, nprocs: int) -> tuple[str, int]:
    """(start method, threads per process): fork where it is safe, and one thread when forked."""
    if method is None:
        # a child forked after CUDA or autograd's device threads started cannot use them
        forkable = (
            "fork" in mp.get_all_start_methods()
            and not torch.cuda.is_initialized()
            and not autograd_device_threads()
        )
        method = "fork" if forkable else "spawn"
    if method != "fork":
        return method, threads or max(1, cpu_count() // nprocs)
    if threads not in (None, 1):
        raise ConfigError(
            f"threads_per_process={threads} with start_method='fork' would hang in OpenMP: pass "
            "start_method='spawn' for more than one thread per process"
        )
    return method, 1


def _results(context: Any, results: Any, nprocs: int, timeout: float | None) -> list[Any]:
    """Each rank's result as ``context``'s processes end (a TimeoutError after ``timeout`` s)."""
    out: list[Any] = [None] * nprocs
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done = context.join(timeout=0.05)
        while not results.empty():  # drained while waiting: a child on a full pipe never exits
            rank, payload = results.get()
            out[rank] = pickle.loads(payload)
        if done:
            return out
        if deadline is not None and time.monotonic() > deadline:
            running = [r for r, p in enumerate(context.processes) if p.is_alive()]
            raise TimeoutError(
                f"ranks {running} of {nprocs} still running after {timeout:g} s: a collective some "
                "rank never reached, or a deadlock; they are killed"
            )


def _check_call(fn: Callable[..., Any], args: tuple[Any, ...], pass_rank: bool) -> None:
    """Refuse a call ``fn`` cannot take, saying whether ``pass_rank`` would fit."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature (a builtin): the call decides
        return
    name = getattr(fn, "__qualname__", repr(fn))

    def fits(call: tuple[Any, ...]) -> bool:
        try:
            signature.bind(*call)
        except TypeError:
            return False
        return True

    if fits((0, *args) if pass_rank else args):
        return
    if not pass_rank and fits((0, *args)):
        raise ConfigError(
            f"{name}{signature} takes the rank first, as under torch's mp.spawn: pass "
            "pass_rank=True (ddpkit.spawn(fn, args=..., nprocs=..., pass_rank=True) calls "
            "fn(rank, *args)), or drop the argument and read the rank from ddpkit.init()"
        )
    if pass_rank and fits(args):
        raise ConfigError(
            f"{name}{signature} takes no rank: drop pass_rank=True, which calls fn(rank, *args)"
        )
    how = "fn(rank, *args)" if pass_rank else "fn(*args)"
    raise ConfigError(
        f"{name}{signature} cannot be called as {how} with args={args!r}: change args"
    )
