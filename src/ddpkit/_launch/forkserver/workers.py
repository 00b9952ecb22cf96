"""The agent's side of the fork server: torchrun's workers forked from
:mod:`ddpkit._launch.forkserver.server`.

torchrun's agent starts each worker through a ``SubprocessHandler`` whose ``_popen`` makes a
``Popen``. The handler here asks the fork server instead and gets back the pid of a worker that the
agent has adopted (its child, in a session of its own), wrapped in :class:`ForkedProcess`, which
answers what torchrun asks of a ``Popen``: ``pid``, ``poll``, ``wait``, ``returncode``, signals.
Everything else stays torchrun's: the process context, the worker's environment and log files,
failures, restarts. Where the server cannot serve (it is starting, it refused, it died, the command
is not a ``ddpkit._launch.worker`` one, NUMA binding wraps it), the handler makes the ``Popen`` as
torchrun would.

Why not torchrun's own ``--start-method forkserver``: it applies to function entrypoints only, whose
workers are children of multiprocessing's server, in the agent's session, with standard input closed
and no ``atexit`` handlers run; a script entrypoint under this handler keeps every behaviour of a
torchrun worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from ddpkit._internals.elastic import (
    log_files,
    popen_override,
    set_handler_factory,
    subprocess_handler_base,
    warn_once,
)
from ddpkit._internals.interpreter import finalize_problem, warn_interpreter_once
from ddpkit._launch.forkserver.server import MAX_MESSAGE, PRELOAD, ignored_signals
from ddpkit._launch.proctree import wait_exit

READY_TIMEOUT = 300.0
"""Seconds the first worker waits for the server's imports before it is started as a new
interpreter."""

_WORKER_COMMAND = ("-u", "-m", "ddpkit._launch.worker")


class ForkedProcess:
    """A worker forked by the server and adopted by this process, as torchrun's handler uses a
    ``Popen``."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid, self.args = pid, list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its status is lost
                self.returncode = 255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is not None:
            return self.returncode  # type: ignore[return-value]  # set by poll
        end = None if timeout is None else time.monotonic() + timeout
        pidfd = wait_exit(self.pid, timeout) is not None  # None: no pidfds, poll
        while self.poll() is None:  # after a pidfd said it exited, at once
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.001 if pidfd else 0.01)
        return self.returncode  # type: ignore[return-value]  # set by poll

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The job's fork server process, started at once; it imports in the background while the agent
    waits for the rendezvous."""

    def __init__(self, preload: Sequence[str], display: Sequence[str] = ()) -> None:
        """``display``: the workers' command, appended to the server's command line for ``ps`` (not
        read)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.why_not: str | None = None
        """Why the server does not fork workers (None: it does, or is not known yet)."""
        self.failed: list[str] = []
        self._ready: bool | None = None
        modules = ",".join(dict.fromkeys([*PRELOAD, *preload]))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-u",
                "-m",
                "ddpkit._launch.forkserver.server",
                str(theirs.fileno()),
                str(os.getpid()),
                modules,
            ]
            + ["--", *display],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            # out of reach of signals to the job's process group; it dies with the agent
            start_new_session=True,
        )
        theirs.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ready(self, timeout: float = READY_TIMEOUT) -> bool:
        """Wait for the server's imports; True when it forks workers."""
        if self._ready is None:
            self._ready = False
            reply, _ = self._receive(timeout)
            if reply is None:
                self._give_up("it did not answer")
            elif not reply.get("ready"):
                self._give_up(str(reply.get("why")))
            else:
                self._ready, self.failed = True, list(reply.get("failed", []))
                if self.failed:
                    print(
                        "ddpkit run: --preload: the fork server could not import "
                        f"{', '.join(self.failed)}; each worker imports what its script imports",
                        file=sys.stderr,
                        flush=True,
                    )
        return self._ready

    def spawn(
        self, argv: Sequence[str], env: dict[str, str], cwd: str, files: Sequence[int]
    ) -> int | None:
        """Fork a worker running ``python -u -m ddpkit._launch.worker ARGV`` with ``env`` in
        ``cwd``, ``files`` its standard input, output and error; its pid, or None when the server
        cannot.

        The worker waits for a word on a pipe whose one open end comes back with its pid, and exits
        if the pipe closes without it: a worker this process did not take (the server died before it
        answered, or answered too late) never runs next to the new interpreter started for its rank
        instead."""
        if not self.ready():
            return None
        # What a new interpreter started now would inherit of the agent's signals: those it ignores,
        # its mask.
        blocked = sorted(int(signum) for signum in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        request = {
            "argv": list(argv),
            "env": env,
            "cwd": cwd,
            "ignored": ignored_signals(),
            "blocked": blocked,
        }
        message = json.dumps(request).encode()
        try:
            socket.send_fds(self.sock, [message], list(files))
        except OSError as err:
            self._give_up(f"{type(err).__name__}: {err}")
            return None
        reply, fds = self._receive(60.0)
        try:
            if reply is None or "pid" not in reply or len(fds) != 1:
                self._give_up(reply.get("error", "no answer") if reply else "it did not answer")
                return None
            os.write(fds[0], b"g")
            return int(reply["pid"])
        finally:
            for fd in fds:
                os.close(fd)

    def _receive(self, timeout: float) -> tuple[dict[str, Any] | None, list[int]]:
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            return None, []
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
        except OSError:
            return None, []
        return (json.loads(data) if data else None), fds

    def _give_up(self, why: str) -> None:
        if self.why_not is None:
            self.why_not = why
            print(
                "ddpkit run: workers start as new interpreters (the fork server cannot fork "
                f"them: {why})",
                file=sys.stderr,
                flush=True,
            )
        self._ready = False
        self.close()

    def close(self) -> None:
        """Hang up (the server exits) and reap it."""
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.proc.poll() is None:
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_server: ForkServer | None = None


def current() -> ForkServer | None:
    return _server


def start(preload: Sequence[str] = (), display: Sequence[str] = ()) -> ForkServer:
    global _server
    _server = ForkServer(preload, display)
    return _server


def stop() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


def _standard_files(logs: tuple[Any, Any]) -> tuple[list[int], list[int]]:
    """The worker's standard input, output and error: torchrun's log files where it redirects
    (``logs``), else this process's own (what a ``Popen`` child inherits); and the descriptors
    opened here, for the caller to close."""
    files, opened = [0, 1, 2], []
    by_fd = {1: logs[0], 2: logs[1]}
    for i in range(3):
        log = by_fd.get(i)
        if log is not None:
            files[i] = log.fileno()
            continue
        try:
            # not: one of this process's own (a socket that took a closed fd 0)
            inherited = os.get_inheritable(i)
        except OSError:
            inherited = False
        if not inherited:  # a Popen child would have none there: the worker gets /dev/null instead
            files[i] = os.open(os.devnull, os.O_RDWR)
            opened.append(files[i])
    return files, opened


def _fork(handler: Any, args: Sequence[str], env: dict[str, str]) -> Any:
    """A worker forked from the server, or None to start it as torchrun does (no server, another
    command, or log files ddpkit cannot find: forked there, a worker's output would go to the
    terminal)."""
    server = _server
    if server is None or server.why_not is not None or not _is_worker_command(args):
        return None
    logs = log_files(handler)
    if logs is None:
        warn_once("SubprocessHandler._stdout/_stderr", "forking workers from the job's server")
        stop()  # no worker will come from it
        return None
    files, opened = _standard_files(logs)
    try:
        pid = server.spawn(list(args[1 + len(_WORKER_COMMAND) :]), env, os.getcwd(), files)
    finally:
        for fd in opened:
            os.close(fd)
    return ForkedProcess(pid, args) if pid is not None else None


def handler_class(base: type) -> type:
    """torchrun's ``SubprocessHandler`` (``base``) with workers forked from the server."""
    return popen_override(base, _fork, bypassed=stop)  # a server no worker comes from is stopped


def _is_worker_command(args: Sequence[str]) -> bool:
    """``python -u -m ddpkit._launch.worker ...`` with this interpreter, as the launcher asks
    torchrun for."""
    return (
        len(args) > len(_WORKER_COMMAND)
        # not another interpreter (torchrun's PYTHON_EXEC), even one it links to
        and args[0] == sys.executable
        and tuple(args[1 : 1 + len(_WORKER_COMMAND)]) == _WORKER_COMMAND
    )


def install(preload: Sequence[str] = (), display: Sequence[str] = ()) -> ForkServer | None:
    """Start the job's fork server and have torchrun's process context start workers through it.
    None (and nothing changed) where torchrun has no handler to replace or the platform cannot adopt
    forked workers."""
    if not sys.platform.startswith("linux"):
        return None
    base = subprocess_handler_base()
    if base is None:
        warn_once("torch's SubprocessHandler._popen", "forking workers from the job's server")
        return None
    if finalize_problem() is not None:  # a forked worker could not end as an interpreter ends
        warn_interpreter_once(
            "threading._shutdown/atexit._run_exitfuncs", "forking workers from the job's server"
        )
        return None
    forked = handler_class(base)
    set_handler_factory(lambda *args, **kwargs: forked(*args, **kwargs))
    return start(preload, display)


def uninstall() -> None:
    stop()
    set_handler_factory(None)
