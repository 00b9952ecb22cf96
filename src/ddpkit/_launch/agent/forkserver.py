"""The fork server (docs/launcher.md, "Fast restarts"): a process that imported torch once for the
job, from which ``ddpkit run`` forks each worker; the agent's side (:class:`ForkServer`,
:func:`install`) stands in for the ``Popen`` of torchrun's ``SubprocessHandler``."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from ddpkit._internals.compiler import DYNAMO
from ddpkit._internals.elastic import (
    log_files,
    popen_override,
    set_handler_factory,
    subprocess_handler_base,
    warn_once,
)
from ddpkit._internals.interpreter import (
    cuda_driver_initialised,
    finalize_as_interpreter,
    finalize_problem,
    flush_open_files,
    set_command_line,
    warn_interpreter_once,
)
from ddpkit._launch import say
from ddpkit._launch.proctree import parent_of, send, set_parent_death_signal, wait_exit

PRELOAD = ("torch", "torch.distributed", DYNAMO, "ddpkit.training._trainer")
"""Imported before the first fork (Dynamo: what an optimizer or DDP imports)."""
MAX_MESSAGE = 1 << 20  # bytes of a request: a worker's environment and command line


def os_threads() -> int:
    """This process's threads, as the kernel counts them (native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def preload(modules: Sequence[str]) -> tuple[list[str], str | None]:
    """Import :data:`PRELOAD`, then ``modules``; return (those that failed to import, why the server
    must not fork, or None). A thread started by a preloaded module (Python's or native) is one a
    fork would not carry, and may hold locks the worker would inherit held; so is a CUDA driver."""
    # torch.cuda.is_available() initialises the driver unless it counts devices through NVML
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    failed = []

    def load(names: Sequence[str]) -> None:
        for name in names:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001  (any failure: the worker imports it itself)
                failed.append(name)

    load(PRELOAD)
    own = [m for m in modules if m not in PRELOAD]
    threads = os_threads()
    load(own)
    why = None
    if cuda_driver_initialised():
        why = "the CUDA driver was initialised while importing " + ", ".join([*PRELOAD, *own])
    elif threading.active_count() > 1:
        why = f"{threading.active_count() - 1} Python thread(s) started while importing"
    elif os_threads() > threads:
        why = f"{os_threads() - threads} thread(s) started while importing {', '.join(own)}"
    return failed, why


def exit_status(code: Any) -> int:
    """The exit status of ``SystemExit(code)``, as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def run_as_main(main: Callable[[], Any]) -> int:
    """Run ``main`` and end as an interpreter ends after ``__main__``; the exit status."""
    code = 0
    interrupted = False
    try:
        main()
    except SystemExit as exc:
        code = exit_status(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException:  # noqa: BLE001  (as the interpreter: printed, status 1)
        sys.excepthook(*sys.exc_info())
        code = 1
    finalize_as_interpreter()
    if interrupted:  # as the interpreter: die of the signal, so the parent sees it
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


JOB_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)
"""A job's signals: the server ignores them, its workers get a new interpreter's dispositions."""


def ignored_signals() -> list[int]:
    """Of :data:`JOB_SIGNALS`, those this process ignores now: what ``exec`` keeps for a child."""
    return [signum for signum in JOB_SIGNALS if signal.getsignal(signum) is signal.SIG_IGN]


def exec_dispositions(ignored: Sequence[int]) -> dict[int, Any]:
    """The dispositions of :data:`JOB_SIGNALS` in a new interpreter started by a process that
    ignores ``ignored``: those stay ignored, the rest default, and SIGINT raises KeyboardInterrupt
    where it is not ignored."""
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
    """Wait until this process's parent is ``agent``, which adopts it as the intermediate exits."""
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
    word, then its signals, directory, environment and random streams, and the script. Never
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
        # the agent's mask, as a Popen child inherits it: a signal sent since the fork waited
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
        from ddpkit._launch.agent import worker

        set_command_line(
            [sys.executable, "-u", "-m", "ddpkit._launch.agent.worker", *request["argv"]]
        )
        sys.argv = [worker.__file__, *request["argv"]]
        code = run_as_main(worker.main)
    except BaseException:  # noqa: BLE001  (before the script: os._exit below says nothing)
        traceback.print_exc()
    finally:
        os._exit(code)


def _fork_worker(
    request: dict[str, Any], fds: Sequence[int], agent: int, server: socket.socket
) -> tuple[int, int]:
    """Fork a worker through an intermediate; its pid once adopted, and the pipe it waits on."""
    pid_read, pid_write = os.pipe()
    go_read, go_write = os.pipe()
    # blocked: a signal sent before the worker has its own dispositions stays pending until then
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
    """Preload, say whether this server forks, then fork one per request until hung up."""
    for signum in JOB_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    failed, refused = preload(modules)
    # written once now: each worker would write what it inherited buffered again as it ends
    flush_open_files()
    try:
        sock.send(json.dumps({"ready": refused is None, "why": refused, "failed": failed}).encode())
    except OSError:  # the agent hung up before the imports ended
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
            # checked here: a request the worker could not follow is refused, not a failed rank
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
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != agent:
        return
    sock = socket.socket(fileno=fd)
    try:
        serve(sock, agent, modules)
    finally:
        sock.close()


READY_TIMEOUT = 300.0  # seconds the first worker waits for the server's imports

_WORKER_COMMAND = ("-u", "-m", "ddpkit._launch.agent.worker")


class ForkedProcess:
    """A worker forked by the server and adopted here, as torchrun's handler uses a ``Popen``."""

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
            send([self.pid], sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The job's fork server, started at once: it imports while the agent meets the others."""

    def __init__(self, preload: Sequence[str], display: Sequence[str] = ()) -> None:
        """``display``: the workers' command, shown on the server's command line."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.why_not: str | None = None
        """Why the server does not fork workers (None: it does, or is not known yet)."""
        self.failed: list[str] = []
        self._ready: bool | None = None
        modules = ",".join(dict.fromkeys([*PRELOAD, *preload]))
        command = [
            sys.executable,
            "-u",
            "-m",
            "ddpkit._launch.agent.forkserver",
            str(theirs.fileno()),
        ]
        self.proc = subprocess.Popen(
            [*command, str(os.getpid()), modules, "--", *display],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            # out of reach of signals to the job's process group; it dies with the agent
            start_new_session=True,
        )
        self.pid = self.proc.pid
        theirs.close()

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
                    say(
                        f"--preload: the fork server could not import {', '.join(self.failed)}; "
                        "each worker imports what its script imports"
                    )
        return self._ready

    def spawn(
        self, argv: Sequence[str], env: dict[str, str], cwd: str, files: Sequence[int]
    ) -> int | None:
        """Fork a worker running ``python -u -m ddpkit._launch.agent.worker ARGV`` with ``env`` in
        ``cwd``, ``files`` its standard input, output and error; its pid, or None when the server
        cannot. The worker runs only once this process writes the word on the pipe that comes back
        with its pid: one it did not take exits."""
        if not self.ready():
            return None
        # what a new interpreter started now would inherit: the signals ignored, the mask
        blocked = sorted(int(signum) for signum in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        request = {"argv": list(argv), "env": env, "cwd": cwd, "blocked": blocked}
        message = json.dumps(request | {"ignored": ignored_signals()}).encode()
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
            say(f"workers start as new interpreters (the fork server cannot fork them: {why})")
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


def stop() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


def _standard_files(logs: tuple[Any, Any]) -> tuple[list[int], list[int]]:
    """The worker's standard input, output and error: torchrun's log files where it redirects
    (``logs``), else this process's own; and the descriptors opened here, for the caller to
    close."""
    files, opened = [0, 1, 2], []
    by_fd = {1: logs[0], 2: logs[1]}
    for i in range(3):
        log = by_fd.get(i)
        if log is not None:
            files[i] = log.fileno()
            continue
        try:  # not one of this process's own (a socket that took a closed fd 0)
            inherited = os.get_inheritable(i)
        except OSError:
            inherited = False
        if not inherited:  # a Popen child would have none there: the worker gets /dev/null instead
            files[i] = os.open(os.devnull, os.O_RDWR)
            opened.append(files[i])
    return files, opened


def _fork(handler: Any, args: Sequence[str], env: dict[str, str]) -> Any:
    """A worker forked from the server, or None to start it as torchrun does."""
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


def _is_worker_command(args: Sequence[str]) -> bool:
    """``python -u -m ddpkit._launch.agent.worker ...`` with this very interpreter."""
    return (
        len(args) > len(_WORKER_COMMAND)
        and args[0] == sys.executable
        and tuple(args[1 : 1 + len(_WORKER_COMMAND)]) == _WORKER_COMMAND
    )


def install(preload: Sequence[str] = (), display: Sequence[str] = ()) -> ForkServer | None:
    """Start the job's fork server and have torchrun's process context start workers through it;
    None (nothing changed) where torchrun has no handler to replace or forked workers could not be
    adopted or end as interpreters."""
    if not sys.platform.startswith("linux"):
        return None
    base = subprocess_handler_base()
    if base is None:
        warn_once("torch's SubprocessHandler._popen", "forking workers from the job's server")
        return None
    if finalize_problem() is not None:
        warn_interpreter_once(
            "threading._shutdown/atexit._run_exitfuncs", "forking workers from the job's server"
        )
        return None
    forked = popen_override(base, _fork, bypassed=stop)  # a server no worker comes from is stopped
    set_handler_factory(lambda *args, **kwargs: forked(*args, **kwargs))
    global _server
    _server = ForkServer(preload, display)
    return _server


def uninstall() -> None:
    stop()
    set_handler_factory(None)


if __name__ == "__main__":
    main(sys.argv[1:])
