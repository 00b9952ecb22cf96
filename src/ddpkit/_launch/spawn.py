"""Launch a function on N local processes from Python: for notebooks and tests, as the DDP
tutorials' ``mp.spawn``.

Two ways to call the function. ddpkit's own, ``spawn(fn, nprocs, args)``, calls ``fn(*args)``: the
rank and the world size are :func:`ddpkit.init`'s to tell. ``mp.spawn``'s,
``spawn(fn, args=..., nprocs=..., pass_rank=True)``, calls ``fn(rank, *args)``, as
``torch.multiprocessing.spawn`` does: a script written for it (the DDP tutorials'
``train(rank, world_size)``) runs unchanged. Which one is said in the call, never guessed from
``fn``: a function that takes a rank first and one that takes its own first argument look alike.
"""

from __future__ import annotations

import inspect
import os
import pickle
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from ddpkit._errors import ConfigError
from ddpkit._internals.store import AGENT_STORE_VARIABLE
from ddpkit.distributed import _runtime as runtime
from ddpkit.platforms._cpus import cpu_count


def _worker(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    nprocs: int,
    port: int,
    threads: int,
    results: Any,
    pass_rank: bool,
) -> None:
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(threads),
    )
    # rank 0 hosts the store, as with a static rendezvous
    os.environ.pop(AGENT_STORE_VARIABLE, None)
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

    ``pass_rank=True`` calls ``fn(rank, *args)`` instead, as ``torch.multiprocessing.spawn(fn,
    args, nprocs)`` does: ``ddpkit.spawn(train, args=(world_size,),
    nprocs=world_size, pass_rank=True)`` runs the DDP tutorials' ``train(rank, world_size)``. A call
    that cannot fit ``fn`` (a rank it needs, or one it does not take) is refused before any process
    starts, naming ``pass_rank``.

    Inside ``fn``, :func:`ddpkit.init` sees RANK, WORLD_SIZE and the rest as under torchrun. If any
    process raises, the others are stopped and the exception is raised here with that rank's
    traceback. ``start_method`` defaults to ``"fork"`` where it is safe (POSIX, CUDA not yet
    initialised in this process), so a function defined in a notebook cell works; else ``"spawn"``,
    which needs ``fn`` importable.

    Forked processes run one intra-op thread each: OpenMP's thread pool does not survive ``fork``,
    and a forked child that starts a parallel region with more threads waits forever for workers
    that do not exist. For more threads per process, pass ``start_method="spawn"``.

    ``timeout`` (seconds): processes still running by then are killed, and :class:`TimeoutError`
    names them (a hang: a collective some rank never reached, a deadlock); None waits as long as
    they run.
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
    if start_method is None:
        forkable = "fork" in mp.get_all_start_methods() and not torch.cuda.is_initialized()
        start_method = "fork" if forkable else "spawn"
    if start_method == "fork":
        if threads_per_process not in (None, 1):
            raise ConfigError(
                f"threads_per_process={threads_per_process} with start_method='fork' would hang in "
                "OpenMP: pass start_method='spawn' for more than one thread per process"
            )
        threads = 1
    else:
        threads = threads_per_process or max(1, cpu_count() // nprocs)
    # Rank 0 hosts the rendezvous store, not this process: a store here runs a server thread that
    # resolves peer names (getnameinfo) as ranks connect, and a child forked while it holds glibc's
    # resolver lock inherits the lock held and hangs in its own connect. The port is free now; if
    # another program takes it before rank 0 binds it, init() says so.
    port = _free_port()
    results = mp.get_context(start_method).SimpleQueue()
    out: list[Any] = [None] * nprocs

    def drain() -> None:
        while not results.empty():
            r, payload = results.get()
            out[r] = pickle.loads(payload)

    context = mp.start_processes(
        _worker,
        args=(fn, args, nprocs, port, threads, results, pass_rank),
        nprocs=nprocs,
        join=False,
        start_method=start_method,
    )
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        # Drain results while waiting: a child blocked on a full pipe would otherwise never exit.
        while not context.join(timeout=0.05):
            drain()
            if deadline is not None and time.monotonic() > deadline:
                running = [r for r, p in enumerate(context.processes) if p.is_alive()]
                raise TimeoutError(
                    f"ranks {running} of {nprocs} still running after {timeout:g} s: a collective "
                    "some rank never reached, or a deadlock; they are killed"
                )
        drain()
        return out
    finally:
        # Interrupted (Ctrl-C in a notebook, a test's timeout) or failed: leave no process behind.
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()


def _check_call(fn: Callable[..., Any], args: tuple[Any, ...], pass_rank: bool) -> None:
    """Refuse, before any process starts, a call ``fn`` cannot take; say whether ``pass_rank`` would
    fit."""
    try:
        signature = inspect.signature(fn)
    # a builtin or C function without a signature: let the call decide
    except (TypeError, ValueError):
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


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
