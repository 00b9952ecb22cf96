"""The fork server's parts that need no job: the exit status a forked worker ends with, its signals,
the handle the agent keeps of it, which commands it forks, and its options. (Forked workers in real
jobs: tests/jobs/launch/test_forkserver.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit._launch.agent.forkserver import (
    JOB_SIGNALS,
    ForkedProcess,
    _is_worker_command,
    exec_dispositions,
    exit_status,
    ignored_signals,
)
from ddpkit._launch.cli.options import build_parser, config_from_args

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the fork server is Linux only"
    ),
]
ROOT = Path(__file__).parents[3]


def test_exit_status_is_the_interpreters(capsys):
    assert [exit_status(c) for c in (None, 0, 3, 256 + 5)] == [0, 0, 3, 5]
    assert exit_status("no data") == 1
    assert capsys.readouterr().err == "no data\n"


END = """
import atexit, sys, threading, time
from ddpkit._launch.agent.forkserver import run_as_main
atexit.register(lambda: print("atexit", flush=True))
def main():
    # Ends after main.
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread", flush=True))).start()
    {body}
code = run_as_main(main)
print("status", code, flush=True)
"""


@pytest.mark.parametrize(
    ("body", "status", "err"),
    [
        ("pass", 0, ""),
        ("sys.exit(4)", 4, ""),
        ("sys.exit('bad input')", 1, "bad input"),
        ("raise ValueError('boom')", 1, "ValueError: boom"),
    ],
)
def test_run_as_main_ends_as_an_interpreter_ends(run_python, body, status, err):
    # The status first, then the threads and the atexit handlers, as Py_FinalizeEx; in a fresh
    # process, whose atexit handlers are its own.
    out = run_python(END.format(body=body))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["thread", "atexit", f"status {status}"]
    assert err in out.stderr


def test_an_uncaught_keyboard_interrupt_ends_the_process_by_sigint(run_python):
    out = run_python(END.format(body="raise KeyboardInterrupt"))
    assert out.returncode == -signal.SIGINT, out.stderr
    assert "KeyboardInterrupt" in out.stderr and out.stdout.splitlines() == ["thread", "atexit"]


NAMES = {
    signal.SIG_IGN: "ignored",
    signal.SIG_DFL: "default",
    signal.default_int_handler: "python's",
}
SHOW = f"""import json, signal
names = {{
    signal.SIG_IGN: "ignored", signal.SIG_DFL: "default", signal.default_int_handler: "python's"
}}
signals = {[int(s) for s in JOB_SIGNALS]}
print(json.dumps({{s: names.get(signal.getsignal(s), "a handler") for s in signals}}))
"""


@pytest.mark.parametrize(
    "ignored", [(), (signal.SIGINT, signal.SIGQUIT), (signal.SIGUSR2, signal.SIGHUP)]
)
def test_a_forked_workers_signals_are_those_of_a_new_interpreter(ignored):
    """exec_dispositions against a real interpreter started by a process that ignores ``ignored``
    and has a Python handler on every other job signal (as torch's agent has on some)."""

    def parent() -> None:
        for signum in JOB_SIGNALS:
            signal.signal(
                signum, signal.SIG_IGN if signum in ignored else signal.default_int_handler
            )

    new = subprocess.run(
        [sys.executable, "-c", SHOW], capture_output=True, text=True, preexec_fn=parent, timeout=60
    )
    assert new.returncode == 0, new.stderr
    expected = {str(int(s)): NAMES[h] for s, h in exec_dispositions(list(ignored)).items()}
    assert json.loads(new.stdout) == expected
    # What the agent sends: the job signals it ignores now.
    saved = {signum: signal.getsignal(signum) for signum in JOB_SIGNALS}
    try:
        parent()
        assert sorted(ignored_signals()) == sorted(ignored)
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


GAP = """
import os, signal
from ddpkit._launch import proctree
from ddpkit._launch.agent import forkserver as forked
forked.PRELOAD = ()  # nothing to import: the fork is what is tested
proctree.become_subreaper()  # this process is the agent, which adopts its forked workers
server = forked.ForkServer({preload!r})
assert server.ready(), server.why_not
receive = server._receive

def signalled_before_the_word(timeout):
    reply, fds = receive(timeout)
    # The worker still has the server's dispositions: all ignored.
    os.kill(reply["pid"], signal.SIGTERM)
    return reply, fds

server._receive = signalled_before_the_word
pid = server.spawn([{script!r}], dict(os.environ), os.getcwd(), [0, 1, 2])
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
server.close()
"""


@pytest.mark.slow  # two fork servers started, each importing torch: ~17 s
def test_a_signal_sent_as_the_worker_starts_is_not_lost(run_python, tmp_path):
    """SIGTERM reaches the forked worker before it has its own dispositions (the server ignores the
    job's signals): it waits, blocked, and ends the worker as it would end a new interpreter; the
    script never runs. Control: a worker forked without the job's signals blocked ignores it and
    runs the script."""
    script = tmp_path / "script.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    out = run_python(GAP.format(script=str(script), preload=()))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(-signal.SIGTERM)] and not (tmp_path / "ran").exists()
    control = GAP.format(script=str(script), preload=["tests.jobs.scripts.fork_unblocked"])
    out = run_python(
        control,
        extra_env={
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        },
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0"] and (tmp_path / "ran").exists()


def _child(read_fd: int | None = None, code: int = 0) -> int:
    pid = os.fork()
    if pid == 0:  # waits for the pipe (if any), then exits without running anything of pytest's
        if read_fd is not None:
            os.read(read_fd, 1)
        os._exit(code)
    return pid


@pytest.mark.parametrize("pidfds", [True, False])
def test_a_forked_process_answers_as_a_popen(monkeypatch, pidfds):
    # a kernel before 5.3, or a seccomp profile that refuses the call: waiting polls instead
    if not pidfds:

        def refused(pid: int, flags: int = 0) -> int:
            raise OSError(38, "pidfd_open refused")

        monkeypatch.setattr(os, "pidfd_open", refused)
    proc = ForkedProcess(_child(code=7), ["python", "x"])
    assert proc.wait(timeout=30) == 7 and proc.poll() == 7 and proc.returncode == 7
    read, write = os.pipe()
    try:
        proc = ForkedProcess(_child(read), ["python", "x"])
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL
        proc.kill()  # once it has exited: nothing to signal, no error
    finally:
        os.close(read)
        os.close(write)


def test_only_the_launchers_worker_command_is_forked():
    assert _is_worker_command(
        [sys.executable, "-u", "-m", "ddpkit._launch.agent.worker", "train.py"]
    )
    assert not _is_worker_command([sys.executable, "-u", "train.py"])  # not the launcher's command
    assert not _is_worker_command(
        ["numactl", "-N", "0", sys.executable, "-u", "-m", "ddpkit._launch.agent.worker", "t.py"]
    )
    assert not _is_worker_command(
        ["/usr/bin/other-python", "-u", "-m", "ddpkit._launch.agent.worker", "t.py"]
    )
    # Another virtual environment on the same interpreter (torchrun's PYTHON_EXEC): its own
    # site-packages.
    if os.path.realpath(sys.executable) != sys.executable:
        assert not _is_worker_command(
            [os.path.realpath(sys.executable), "-u", "-m", "ddpkit._launch.agent.worker", "t.py"]
        )


def test_the_fork_server_serves_jobs_that_may_restart_unless_told():
    def uses(*flags: str) -> bool:
        return config_from_args(build_parser().parse_args([*flags, "t.py"])).uses_fork_server

    assert not uses()  # no restart: every worker a new interpreter, as under torchrun
    assert uses("--max-restarts", "1")
    assert uses("--nnodes", "1:2", "--rdzv-endpoint", "h:1")  # elastic: restarts by default
    assert uses("--fork-server", "on") and not uses("--fork-server", "off", "--max-restarts", "3")
    cfg = config_from_args(
        build_parser().parse_args(["--preload", "numpy,pandas", "--preload", "x.y", "t.py"])
    )
    assert cfg.preload == ["numpy", "pandas", "x.y"]
