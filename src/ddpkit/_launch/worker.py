"""What ``ddpkit run`` starts in each worker: the user's script, with its exception recorded for the
launcher.

torchrun reports a failed worker's traceback only when the script's entry point is decorated with
``@record``; running the script through this module gives every script that, unchanged. Before the
script starts, the worker ties its life to the agent's (a parent-death signal), forks the guard that
ends whatever it starts once it is gone (:mod:`ddpkit._launch.proctree`), holds SIGUSR1 until a
Trainer listens for it (:mod:`ddpkit.distributed._signals`), writes its stack when asked (SIGUSR2),
and on global rank 0 serves the workers' store on ``MASTER_ADDR`` alone. Usage (by the launcher):
``python -m ddpkit._launch.worker [-m] TARGET ARGS...``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._internals.elastic import record_with
from ddpkit._internals.store import agent_store_in_use, serve_store, use_agent_store
from ddpkit._launch.proctree import set_parent_death_signal, start_guard
from ddpkit.distributed._progress import watch_torch_collectives
from ddpkit.distributed._signals import hold_stop_signals
from ddpkit.platforms import _torchrun as torchrun


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent (the launcher's agent) dies.

    A SIGKILLed agent cannot stop its workers, and they would train on to the end, reparented to
    init, holding the GPUs and writing the run directory. SIGKILL, not SIGTERM: with the agent gone
    nobody would report or restart anything, so a worker has no use for the time a snapshot takes.
    Returns False where the call does not exist (not Linux).
    """
    parent = int(os.environ.get("DDPKIT_AGENT_PID", os.getppid()))
    if not set_parent_death_signal(sig):
        return False
    # The parent may have died between fork and prctl; then no signal will come, and the parent is
    # gone.
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def dump_stack_on_request() -> None:
    """On SIGUSR2, write every thread's Python stack to ``$DDPKIT_STACK_DIR/rank<RANK>.txt``.

    The agent sends SIGUSR2 to the workers still running when one has failed, so that the failure
    summary can say where each of them was (stuck in user code, or waiting in which collective);
    ``kill -USR2`` on the agent asks every worker the same at any time. faulthandler writes from the
    signal handler itself, so a rank blocked inside a C++ collective answers too.
    """
    folder = os.environ.get("DDPKIT_STACK_DIR")
    if not folder:
        return
    path = Path(folder) / f"rank{torchrun.rank_text(os.environ)}.txt"
    # Kept open for the life of the process: faulthandler writes to its descriptor.
    stream = os.fdopen(
        fs.open_fd(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, linked="replace"), "w"
    )
    # Ignored underneath: faulthandler puts back the previous action while the interpreter exits,
    # and a request that arrives then must not kill a worker that is finishing on its own.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR2, file=stream, all_threads=True)


def ask_stacks(
    folder: Path, pids: dict[int, int], wait: float = 3.0, lines: int = 10
) -> dict[int, list[str]]:
    """Each rank's main-thread stack (global rank -> pid), innermost first, asked now (SIGUSR2) of
    the workers that write to ``folder`` (:func:`dump_stack_on_request`): only what each writes from
    now."""
    paths = {g: folder / f"rank{g}.txt" for g in pids}
    before = {g: p.stat().st_size if p.exists() else 0 for g, p in paths.items()}
    asked = []
    for g, pid in pids.items():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR2)
            asked.append(g)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not all(
        paths[g].exists() and paths[g].stat().st_size > before[g] for g in asked
    ):
        # written from the workers' signal handlers: nothing to wait on but the files
        time.sleep(0.05)
    time.sleep(0.1)  # a dump just begun is written whole within milliseconds
    out = {}
    for g in asked:
        with contextlib.suppress(OSError), open(paths[g], "rb") as f:
            f.seek(before[g])
            out[g] = main_frames(f.read().decode(errors="replace"))[:lines]
    return out


def main_frames(dump: str) -> list[str]:
    """The frames of the thread that answered (the main thread) in one faulthandler dump, innermost
    first, without the launch machinery's."""
    block = dump.split("Current thread", 1)[1] if "Current thread" in dump else dump
    frames = []
    for line in block.splitlines()[1:]:
        line = line.strip()
        if line.startswith("Thread 0x") or line.startswith("Current thread"):
            break
        if line.startswith("File ") and not any(
            skip in line
            for skip in ("ddpkit/_launch/worker.py", "<frozen runpy>", "elastic/multiprocessing")
        ):
            frames.append(line)
    return frames


_worker_store: Any = None  # the store global rank 0 serves, alive as long as the process


def serve_worker_store() -> Any:
    """On global rank 0, serve the workers' TCPStore on ``MASTER_ADDR:MASTER_PORT``, bound to that
    address only.

    ``torch.distributed``'s own env:// rendezvous has rank 0 start the store listening on every
    interface of its node, whatever ``MASTER_ADDR`` says; a single-node job's ``MASTER_ADDR`` is
    127.0.0.1, so that store would be open to the network for nothing. Served here from a socket
    bound to ``MASTER_ADDR``'s address, and every rank (this one too) told to connect as a client
    (``TORCHELASTIC_USE_AGENT_STORE``), which holds for scripts that call
    ``torch.distributed.init_process_group`` themselves as much as for ``ddpkit.init()``.
    """
    global _worker_store
    master = torchrun.master_address(os.environ)
    if master is None or agent_store_in_use():
        return None  # no store to serve: the agent serves it, or this is not a job of ddpkit run
    addr, port = master
    if torchrun.is_rank_zero(os.environ):
        from datetime import timedelta

        try:
            listener = socket.create_server((socket.gethostbyname(addr), int(port)), backlog=1024)
        except OSError as err:
            raise ConfigError(
                f"rank 0 cannot serve the workers' store at {addr}:{port} ({err.strerror}): the "
                "agent picked this port as free, and another program took it since, or "
                "--local-addr is not an address of this node; run the job again"
            ) from None
        _worker_store = serve_store(listener.detach(), addr, int(port), timedelta(minutes=5))
    use_agent_store()
    return _worker_store


class WholeErrorFile(ErrorHandler):
    """torch's error handler, its file (``TORCHELASTIC_ERROR_FILE``) written whole or not at all.

    torch writes it in place. A worker stopped in the middle of that write (the agent ending the
    survivors of a failed rank) left a truncated file, and the agent's next poll, which reads every
    failed worker's file, raised on it and ended the whole launcher with a JSON error. Here the same
    record (torch's format: the message, the traceback, the time) replaces the file whole
    (:func:`ddpkit._fs.write_atomic`): a worker stopped before that has no file, and its failure
    reads as its exit status. A script's own ``@record`` (torchrun's documentation asks for one on
    ``main``) writes through it too (:func:`main`)."""

    def record_exception(self, e: BaseException) -> None:
        path = torchrun.error_file(os.environ)
        if not path:
            super().record_exception(e)  # torch logs what it would have written
            return
        record = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": traceback.format_exc(),
                    "timestamp": str(int(time.time())),
                },
            }
        }
        fs.write_atomic(Path(path), json.dumps(record).encode())


@functools.partial(record, error_handler=WholeErrorFile())
def _run(target: str, as_module: bool) -> None:
    serve_worker_store()
    if as_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


def main() -> None:
    argv = sys.argv[1:]
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m ddpkit._launch.worker [-m] TARGET [ARGS...]")
    die_with_parent()
    start_guard()
    hold_stop_signals()
    dump_stack_on_request()
    # the world's collectives the script calls through torch.distributed, marked for the stall
    # watch (a rank that calls another one than the others is named)
    watch_torch_collectives()
    # A script's own @record, applied as its module runs, writes the agent's file whole too: torch's
    # handler would write it in place, before this worker's sees the exception it re-raises.
    record_with(WholeErrorFile)
    target = argv[0]
    sys.argv = argv
    # As `python script.py` does: the script's folder first on the import path, not ours.
    sys.path[0] = os.getcwd() if as_module else os.path.dirname(os.path.abspath(target))
    _run(target, as_module)


if __name__ == "__main__":
    main()
