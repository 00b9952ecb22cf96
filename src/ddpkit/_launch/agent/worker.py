"""What ``ddpkit run`` starts in each worker (``python -m ddpkit._launch.agent.worker [-m] TARGET
ARGS...``): the user's script, its exception recorded for the launcher, with the worker tied to the
agent, its guard, SIGUSR1 held, its inbox read (stack requests; :mod:`ddpkit.distributed._channels`)
and, where the job recovers in place, the script run again after a failure
(:mod:`ddpkit._launch.recover.worker`)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from ddpkit import _fs as fs
from ddpkit._internals.elastic import record_with
from ddpkit._launch.proctree import set_parent_death_signal, start_guard
from ddpkit._launch.recover import worker as recover
from ddpkit.distributed import _channels as channels
from ddpkit.distributed._progress import watch_torch_collectives
from ddpkit.distributed._signals import hold_stop_signals
from ddpkit.platforms import _torchrun as torchrun


class WholeErrorFile(ErrorHandler):
    """torch's error handler, its file (``TORCHELASTIC_ERROR_FILE``) written whole or not at all (a
    truncated one ends the agent's poll), in torch's format; a script's own ``@record`` too."""

    def record_exception(self, e: BaseException) -> None:
        path = torchrun.error_file(os.environ)
        if not path:
            super().record_exception(e)  # torch logs it
            return
        # a failed run let go of its frames to run again (recover.clean): its traceback as text
        stack = getattr(e, "__ddpkit_traceback__", None) or traceback.format_exc()
        info = {"py_callstack": stack, "timestamp": str(int(time.time()))}
        record = {"message": {"message": f"{type(e).__name__}: {e}", "extraInfo": info}}
        fs.write_atomic(Path(path), json.dumps(record).encode())


def _ignore_warnings_at_exit() -> None:
    # a SIGUSR1 after the script (its handler reset at exit) would kill a worker that finished
    with contextlib.suppress(ValueError):  # not the main thread
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)


@functools.partial(record, error_handler=WholeErrorFile())
def _run(target: str, as_module: bool) -> None:
    while True:
        try:
            if as_module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
            return
        except BaseException as error:  # noqa: BLE001 -- a recovering job's rank runs again
            failed = error
        # out of the handler: the failed step's frames, and the groups they hold, are released
        if not recover.leave(failed):
            raise failed
        del failed


def main() -> None:
    argv = sys.argv[1:]
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m ddpkit._launch.agent.worker [-m] TARGET [ARGS...]")
    # SIGKILLed when the agent dies (Linux); if it died before prctl, no signal will come
    agent = channels.agent_pid()
    if set_parent_death_signal(signal.SIGKILL) and os.getppid() != agent:
        os.kill(os.getpid(), signal.SIGKILL)
    start_guard()
    hold_stop_signals()
    atexit.register(_ignore_warnings_at_exit)  # run after the script's own exit handlers
    # nothing sends it: a stray one (a `kill` to the worker's group) must not kill the worker
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    watch_torch_collectives()  # marked for the stall watch
    record_with(WholeErrorFile)  # a script's own @record writes the agent's file whole too
    recover.start()  # where the job recovers in place
    channels.serve()
    # what is loaded now lives as long as the process: the collector skips it, and what it tracks
    # after a failed run is that run's (recover.clean)
    gc.freeze()
    target = argv[0]
    sys.argv = argv
    # as `python script.py`: the script's folder first on the import path
    sys.path[0] = os.getcwd() if as_module else os.path.dirname(os.path.abspath(target))
    try:
        _run(target, as_module)
    finally:
        # the interpreter's teardown deletes what it lists: frozen objects would be left alone
        gc.unfreeze()


if __name__ == "__main__":
    main()
