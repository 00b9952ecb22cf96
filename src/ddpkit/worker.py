"""What ``ddpkit run`` starts in each worker: the user's script, with its exception recorded for the launcher.

torchrun reports a failed worker's traceback only when the script's entry point is decorated with ``@record``;
running the script through this module gives every script that, unchanged. Before the script starts, the
worker ties its life to the agent's (a parent-death signal), holds SIGUSR1 until a Trainer listens for it
(:mod:`ddpkit.signals`), and writes its stack when asked (SIGUSR2). Usage (by the launcher): ``python -m ddpkit.worker [-m] TARGET ARGS...``.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import runpy
import signal
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from ddpkit.signals import hold_stop_signals

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent (the launcher's agent) dies.

    A SIGKILLed agent cannot stop its workers, and they would train on to the end, reparented to init, holding
    the GPUs and writing the run directory. SIGKILL, not SIGTERM: with the agent gone nobody would report or
    restart anything, so a worker has no use for the time a snapshot takes. Returns False where the call does
    not exist (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = int(os.environ.get("DDPKIT_AGENT_PID", os.getppid()))
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    # The parent may have died between fork and prctl; then no signal will come, and the parent is gone.
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def dump_stack_on_request() -> None:
    """On SIGUSR2, write every thread's Python stack to ``$DDPKIT_STACK_DIR/rank<RANK>.txt``.

    The agent sends SIGUSR2 to the workers still running when one has failed, so that the failure summary can
    say where each of them was (stuck in user code, or waiting in which collective); ``kill -USR2`` on the
    agent asks every worker the same at any time. faulthandler writes from the signal handler itself, so a rank
    blocked inside a C++ collective answers too.
    """
    folder = os.environ.get("DDPKIT_STACK_DIR")
    if not folder:
        return
    path = os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.txt")
    stream = open(path, "w")  # kept open for the life of the process: faulthandler writes to its descriptor
    # Ignored underneath: faulthandler puts back the previous action while the interpreter exits, and a request
    # that arrives then must not kill a worker that is finishing on its own.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR2, file=stream, all_threads=True)


@record
def _run(target: str, as_module: bool) -> None:
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
        raise SystemExit("usage: python -m ddpkit.worker [-m] TARGET [ARGS...]")
    die_with_parent()
    hold_stop_signals()
    dump_stack_on_request()
    target = argv[0]
    sys.argv = argv
    # As `python script.py` does: the script's folder first on the import path, not ours.
    sys.path[0] = os.getcwd() if as_module else os.path.dirname(os.path.abspath(target))
    _run(target, as_module)


if __name__ == "__main__":
    main()
