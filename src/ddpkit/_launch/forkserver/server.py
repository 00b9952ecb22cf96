"""The fork server: a process that has imported torch once, from which ``ddpkit run`` forks each
worker.

A worker started as a new interpreter spends most of a restart importing: on the 2-core CI machine
``python`` and ``import torch`` take 1.2 s and the first optimizer's import of Dynamo
(torch.compile's tracer) another 1.0 s, against 0.06 s to load a snapshot from memory
(``bench/goodput.py``). The agent starts this server once per job
(:mod:`ddpkit._launch.forkserver.workers`); it imports :data:`PRELOAD` (and ``--preload``), then
forks a worker for each one torchrun's agent starts, at every attempt.

A forked worker must be what a new interpreter would have been. What fork carries over, and how each
is put right:

- *Its parent.* The server forks an intermediate process that forks the worker and exits: the
  orphaned worker is re-parented to the agent, a child subreaper, and is the agent's child as a
  ``Popen`` would have made it (its exit status, its parent-death signal,
  ``ddpkit._launch.proctree``). It leads a session of its own, as torchrun's ``start_new_session``,
  before the agent learns its pid.
- *Only the worker the agent took.* A forked worker waits, before it runs anything, for the agent's
  word on a pipe only the agent holds: where the agent gives up on the server halfway (the server
  died, or did not answer) and starts the worker as a new interpreter instead, the forked one reads
  the end of the pipe and exits, and no rank runs twice.
- *Threads.* The server forks from its one thread of its own and runs no parallel work (no OpenMP
  pool exists); OpenBLAS's pool, which numpy starts at import where it has several threads, is shut
  down around every fork by OpenBLAS's own fork handlers. A ``--preload`` module that starts a
  thread (a Python thread, or a native one: an OpenMP pool after a parallel operation) makes the
  server refuse to fork.
- *CUDA.* A driver initialised before fork cannot be used after it. Preloading runs with torch's
  NVML-based device count (which does not initialise the driver), and the server refuses to serve if
  the driver was initialised all the same: the agent then starts workers as new interpreters.
- *Random state.* A new interpreter seeds Python's ``random``, numpy's global generator and torch's
  default generator from the OS, so unseeded ranks draw differently; forked, they would all draw the
  server's streams. Python's ``random`` reseeds itself after a fork; numpy's and torch's are
  reseeded here.
- *Environment, files, signals.* The worker's environment, working directory, standard input, output
  and error are the ones torchrun gave it. The server, in a session of its own, ignores the signals
  a terminal or a scheduler sends a job's process group. The worker gets what a new interpreter
  started by the agent at that moment would have: ``exec`` keeps ignored what the agent ignores and
  resets its handlers to the default, and Python puts its own handler on a default SIGINT. The agent
  names what it ignores in each request, as its dispositions change after the server starts: a job
  started in a script's background begins with SIGINT ignored, and torch's agent handles SIGINT once
  it starts its workers.
- *Exit.* The worker's script runs as ``python -m ddpkit._launch.worker`` runs it, and the process
  ends as an interpreter does: non-daemon threads joined, ``atexit`` handlers run, the exit status
  of ``SystemExit`` or of an uncaught exception.

- *Its command line.* ``ps`` shows the worker's command, written over the server's (which is longer)
  where the kernel keeps it.

What differs from a new interpreter: variables read when a library loads are the job's (the server
has the agent's environment; a script that sets ``OMP_NUM_THREADS`` itself before ``import torch``
is too late for OpenMP, as it is for any module imported before it: use ``torch.set_num_threads``);
``/proc/PID/environ`` shows the server's first environment (``os.environ`` is the worker's); hash
randomisation and ``sys.orig_argv`` are the server's; the preloaded modules were imported with the
agent's working directory first on ``sys.path`` (the script's folder is first for everything the
script imports). ``ddpkit run`` uses the server where the job may restart its workers
(``--max-restarts``, elastic jobs); ``--fork-server on|off`` decides otherwise.

Usage (by the agent): ``python -u -m ddpkit._launch.forkserver.server FD AGENT_PID PRELOAD -- WORKER
COMMAND...``.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ddpkit._internals.compiler import DYNAMO
from ddpkit._internals.interpreter import (
    cuda_driver_initialised,
    finalize_as_interpreter,
    flush_open_files,
    set_command_line,
)
from ddpkit._launch.proctree import parent_of, set_parent_death_signal, wait_exit

PRELOAD = ("torch", "torch.distributed", DYNAMO, "ddpkit.training._trainer")
"""Imported by the server before its first fork. Dynamo (:data:`~ddpkit._internals.compiler.DYNAMO`)
is what constructing an optimizer or DDP imports (1.0 s on the CI machine); the Trainer's modules
bring torch's distributed checkpoint."""

MAX_MESSAGE = 1 << 20
"""Largest request in bytes (a worker's environment and command line)."""


def os_threads() -> int:
    """This process's threads, as the kernel counts them (native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def preload(modules: Sequence[str]) -> tuple[list[str], str | None]:
    """Import :data:`PRELOAD`, then ``modules``; return (those that failed to import, why the server
    must not fork, or None).

    Threads: :data:`PRELOAD` starts none but OpenBLAS's pool where numpy has several threads (which
    OpenBLAS shuts down around a fork itself). A thread another module starts, Python's or native (a
    pool after a parallel operation at import), is one a fork would not carry, and it may hold locks
    the worker would inherit held.
    """
    # torch.cuda.is_available() initialises the driver unless told to count devices through NVML.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    failed = []

    def load(names: Sequence[str]) -> None:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001
                # A --preload module may fail any way; the worker imports it.
                failed.append(name)

    load(PRELOAD)
    own = [m for m in modules if m not in PRELOAD]
    threads = os_threads()
    load(own)
    if cuda_driver_initialised():
        return failed, "the CUDA driver was initialised while importing " + ", ".join(
            [*PRELOAD, *own]
        )
    if threading.active_count() > 1:
        return failed, f"{threading.active_count() - 1} Python thread(s) started while importing"
    if os_threads() > threads:
        return (
            failed,
            f"{os_threads() - threads} thread(s) started while importing {', '.join(own)}",
        )
    return failed, None


# -- the worker, in the forked process -------------------------------------------------------------


def exit_status(code: Any) -> int:
    """The exit status of ``SystemExit(code)``, as the interpreter computes it (printing a message
    code)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_as_main(main: Callable[[], Any]) -> int:
    """Run ``main`` and end as an interpreter ends after its ``__main__``: the exit status; then
    threading's shutdown (non-daemon threads, an executor's workers), ``atexit`` handlers, flushed
    output."""
    code = 0
    interrupted = False
    try:
        main()
    except SystemExit as exc:
        code = exit_status(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException:  # noqa: BLE001
        # As the interpreter: any uncaught exception is printed, status 1.
        sys.excepthook(*sys.exc_info())
        code = 1
    # what Py_FinalizeEx does: threads joined, the exit handlers, files and streams flushed
    finalize_as_interpreter()
    if interrupted:  # as the interpreter does since 3.8: die of the signal, so the parent sees it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


JOB_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)
"""Signals sent to a job's process group (a terminal, a scheduler): the server ignores them, its
workers get a new interpreter's dispositions (:func:`exec_dispositions`)."""


def ignored_signals() -> list[int]:
    """Of :data:`JOB_SIGNALS`, those this process ignores now: what ``exec`` keeps for a child."""
    return [signum for signum in JOB_SIGNALS if signal.getsignal(signum) is signal.SIG_IGN]


def exec_dispositions(ignored: Sequence[int]) -> dict[int, Any]:
    """The dispositions of :data:`JOB_SIGNALS` in a new interpreter started by a process that
    ignores ``ignored``: those stay ignored, a handler is reset to the default by ``exec``, and
    Python's start-up puts its own handler (KeyboardInterrupt) on a default SIGINT."""
    out: dict[int, Any] = {}
    for signum in JOB_SIGNALS:
        if signum in ignored:
            out[signum] = signal.SIG_IGN
        elif signum == signal.SIGINT:
            out[signum] = signal.default_int_handler
        else:
            out[signum] = signal.SIG_DFL
    return out


def _wait_adopted(agent: int, deadline: float = 30.0) -> bool:
    """Wait until this process's parent is ``agent``: the intermediate that forked it has exited and
    the agent, a subreaper, adopted it. A pidfd of the intermediate becomes readable once its exit
    is done, after its children were re-parented; where there are no pidfds (a kernel before 5.3, a
    seccomp profile that refuses them) the parent is polled."""
    parent = os.getppid()
    if parent != agent and wait_exit(parent, deadline) is None:
        end = time.monotonic() + deadline
        while os.getppid() == parent and time.monotonic() < end:
            time.sleep(0.001)
    return os.getppid() == agent


def _become_worker(
    request: dict[str, Any], fds: Sequence[int], agent: int, pid_pipe: int, go: int
) -> None:
    """In the forked worker: its session, its pid to the server, its files, its parent, the agent's
    word, then its directory, environment, signals and random streams, and the script. Never
    returns."""
    code = 1
    try:
        os.setsid()  # before the agent learns the pid: it signals the worker's process group by it
        os.write(pid_pipe, struct.pack("=i", os.getpid()))
        os.close(pid_pipe)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        if not _wait_adopted(agent):
            print(
                f"ddpkit fork server: the worker was not adopted by the agent (pid {agent})",
                file=sys.stderr,
            )
            os._exit(1)
        if os.read(go, 1) != b"g":  # the agent took another way to start this rank (or is gone)
            os._exit(1)
        os.close(go)
        for signum, disposition in exec_dispositions(request["ignored"]).items():
            signal.signal(signum, disposition)
        # The agent's mask, as a Popen child inherits it. Until here the job's signals were blocked
        # (see _fork_worker): one sent since the fork waited, and is delivered now as a new
        # interpreter would get it.
        signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()  # from the OS, as numpy's import does
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.default_generator.seed()  # from the OS, as torch's start does
        from ddpkit._launch import worker

        set_command_line([sys.executable, "-u", "-m", "ddpkit._launch.worker", *request["argv"]])
        sys.argv = [worker.__file__, *request["argv"]]
        code = run_as_main(worker.main)
    except BaseException:  # noqa: BLE001
        # Before the script: said here, as os._exit below says nothing.
        traceback.print_exc()
    finally:
        os._exit(code)


def _fork_worker(
    request: dict[str, Any], fds: Sequence[int], agent: int, server: socket.socket
) -> tuple[int, int]:
    """Fork a worker through an intermediate process; return its pid, once the agent has adopted it,
    and the write end of the pipe the worker waits on before it runs anything (for the agent)."""
    pid_read, pid_write = os.pipe()
    go_read, go_write = os.pipe()
    # Forked with the job's signals blocked, not only ignored as the server has them: the agent may
    # signal the worker as soon as it knows its pid, before the worker has a new interpreter's
    # dispositions. On Linux a blocked signal stays pending even where it is ignored; the worker
    # unblocks it once its own are set.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    intermediate = -1
    try:
        intermediate = os.fork()
    finally:
        if intermediate != 0:  # the server, after the fork or its failure
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if intermediate == 0:
        try:
            server.close()
            os.close(pid_read)
            os.close(go_write)
            if os.fork() == 0:
                _become_worker(request, fds, agent, pid_write, go_read)
        finally:
            os._exit(0)  # the worker is orphaned, and the agent adopts it
    os.close(pid_write)
    os.close(go_read)
    try:
        with os.fdopen(pid_read, "rb") as pipe:
            data = pipe.read(4)
        os.waitpid(intermediate, 0)
        if len(data) != 4:
            raise OSError("the worker died before it started its session")
        pid = struct.unpack("=i", data)[0]
        parent = parent_of(pid)
        if parent not in (agent, None):  # None: it already exited, as the agent's zombie
            raise OSError(f"the worker was re-parented to pid {parent}, not to the agent {agent}")
    except BaseException:
        os.close(go_write)  # the worker, if any, exits at the end of the pipe
        raise
    return pid, go_write


def serve(sock: socket.socket, agent: int, modules: Sequence[str]) -> None:
    """Preload, say whether this server can fork workers, then fork one per request until the agent
    hangs up."""
    for signum in JOB_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    failed, refused = preload(modules)
    # What a preloaded module buffered in a file is written now, once: a worker that inherited the
    # buffer would write it again as it ends (it flushes its open files).
    flush_open_files()
    try:
        sock.send(json.dumps({"ready": refused is None, "why": refused, "failed": failed}).encode())
    # the agent hung up before the imports ended (its job ended, or it forks nothing)
    except OSError:
        return
    if refused is not None:
        return
    while True:
        try:
            message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
        except OSError:
            return
        if not message:  # the agent closed its end
            return
        go = None
        try:
            request = json.loads(message)
            # Checked here, so that a request the worker could not follow is refused, not a failed
            # rank.
            request["ignored"] = [int(signum) for signum in request["ignored"]]
            request["blocked"] = [int(signum) for signum in request["blocked"]]
            pid, go = _fork_worker(request, fds, agent, sock)
            reply: dict[str, Any] = {"pid": pid}
        except (OSError, ValueError, KeyError, TypeError) as err:
            reply = {"error": f"{type(err).__name__}: {err}"}
        finally:
            for fd in fds:
                os.close(fd)
        try:  # the agent gets the only end of the worker's pipe left open
            socket.send_fds(sock, [json.dumps(reply).encode()], [go] if go is not None else [])
        finally:
            if go is not None:
                os.close(go)


def main(argv: Sequence[str]) -> None:
    fd, agent, modules = int(argv[0]), int(argv[1]), [m for m in argv[2].split(",") if m]
    # The server dies with the agent: nothing would fork from it again, and it must not hold the
    # job's memory.
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != agent:
        return
    sock = socket.socket(fileno=fd)
    try:
        serve(sock, agent, modules)
    finally:
        sock.close()


if __name__ == "__main__":
    main(sys.argv[1:])
