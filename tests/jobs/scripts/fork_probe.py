"""A job for the fork server's tests: what a worker finds at its start, and what it does at its end.

``python fork_probe.py DIR [MODE]``; each rank writes ``DIR/rank<R>.json`` with, read at the
script's first line: whether ``torch._dynamo`` is already imported (it is only in a worker forked
from the server, which preloaded it), its parent, session, arguments, directory, rank variables,
threads and signal dispositions; then a first draw of python's, numpy's and torch's generators,
unseeded; and rank 0 what it reads on its standard input. At the end three things that a process
must finish before it exits, each writing ``DIR/rank<R>.<what>``: an ``atexit`` handler, a
non-daemon thread, and a task left in a ``ThreadPoolExecutor`` (the last two 0.3 s after the script
ended); and a file its own module ``fork_probe_log`` keeps open and never closes, whose text is on
disk only if the process flushed it as it ended (``rank<R>.unclosed``). Each process that runs a
rank's script adds a line to ``DIR/rank<R>.starts``. MODE:

- ``end`` (default): exit 0;
- ``exit3``: ``sys.exit(3)`` on rank 0, 0 on the others;
- ``message``: ``sys.exit("a message")`` on rank 0 (status 1, the message on standard error);
- ``kill-first``: in the first attempt rank 1 kills itself with SIGKILL once both ranks wrote their
  files; later attempts end normally;
- ``kill-server-first``: the same, after rank 1 has SIGKILLed the job's fork server (as the OOM
  killer might);
- ``hold``: wait until killed (at most 120 s).
"""

import os
import sys

PRELOADED = "torch._dynamo" in sys.modules  # before this script imports anything of torch's

import atexit  # noqa: E402
import concurrent.futures  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import fork_probe_log  # noqa: E402
import numpy  # noqa: E402
import torch  # noqa: E402

folder, mode = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "end")
SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
DISPOSITIONS = {
    signal.SIG_IGN: "ignored",
    signal.SIG_DFL: "default",
    signal.default_int_handler: "python's",
}
rank = int(os.environ["RANK"])


def _agent_pid() -> int:
    """The agent's pid, as the job folder's owner file states it."""
    return int((Path(os.environ["DDPKIT_JOB_DIR"]) / "owner").read_text().split()[0])


attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
found = {
    "preloaded": PRELOADED,
    "parent_is_agent": os.getppid() == _agent_pid(),
    "session_leader": os.getsid(0) == os.getpid(),
    "argv": sys.argv[1:],
    "cwd": os.getcwd(),
    "world_size": os.environ["WORLD_SIZE"],
    "python_threads": threading.active_count(),
    "draws": [random.random(), float(numpy.random.random_sample()), float(torch.rand(1))],
    "signals": {
        name: DISPOSITIONS.get(signal.getsignal(getattr(signal, name)), "a handler")
        for name in SIGNALS
    },
    "stdin": sys.stdin.read() if rank == 0 else None,
    "attempt": attempt,
    # set in the launcher's environment by the test
    "probe_variable": os.environ.get("FORK_PROBE_VARIABLE"),
    "rank_variables": [
        os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")
    ],
}
# one line per process that ran this rank's script
with open(folder / f"rank{rank}.starts", "a") as starts:
    starts.write(f"{os.getpid()} {attempt}\n")
print(f"rank {rank} to standard output", flush=True)
(folder / f"rank{rank}.attempt{attempt}.json").write_text(json.dumps(found))


def mark(what: str) -> None:
    (folder / f"rank{rank}.attempt{attempt}.{what}").write_text("done")


def after_a_while(what: str) -> None:
    """Work that takes a while once the script has ended: only a process that waits for it at its
    end marks it."""
    finish.wait()
    time.sleep(0.3)
    mark(what)


atexit.register(mark, "atexit")
fork_probe_log.write(folder / f"rank{rank}.attempt{attempt}.unclosed")
finish = threading.Event()
threading.Thread(target=after_a_while, args=("thread",)).start()  # not a daemon: joined at exit
pool = concurrent.futures.ThreadPoolExecutor(1)
pool.submit(after_a_while, "executor")  # the pool is never shut down by the script
if mode in ("kill-first", "kill-server-first") and attempt == 0 and rank == 1:
    while not (folder / "rank0.attempt0.json").exists():  # both ranks have started
        threading.Event().wait(0.01)
    if mode == "kill-server-first":
        agent = os.getppid()
        for child in Path(f"/proc/{agent}/task/{agent}/children").read_text().split():
            if (
                b"ddpkit._launch.agent.forkserver\x00"
                in Path(f"/proc/{child}/cmdline").read_bytes()
            ):
                os.kill(int(child), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)
finish.set()

if mode == "hold":
    threading.Event().wait(120)
if mode == "exit3" and rank == 0:
    sys.exit(3)
if mode == "message" and rank == 0:
    sys.exit("a message")
