"""torchrun's and CPython's private steps that ddpkit's launcher overrides: where one is not as
ddpkit relies on, the feature it serves is turned off with one warning naming it and the version,
and the job runs as torchrun would run it, each rank's output where the user asked for it.

The jobs below run ``ddpkit run`` in a launcher whose torch is rewritten first, from torch's own
source, as a release that renamed or changed the internal would be (``REWRITE``): the real process
context, agent and workers run, only the name differs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ddpkit._internals import contract, elastic, interpreter

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the fork server is Linux only"
    ),
]

SCRIPTS = Path(__file__).parents[2] / "jobs" / "scripts"
FORK_PROBE = str(SCRIPTS / "fork_probe.py")
LAUNCH_PROBE = str(SCRIPTS / "launch_probe.py")

REWRITE = '''
import inspect, re, sys, tempfile, textwrap

def rewrite(module_name, target, edits):
    """Define ``target`` (a class of the module, or ``Class.method``) again from torch's source,
    with each (pattern, replacement) of ``edits`` applied, in a file of its own (where ``inspect``
    finds the new source); every module that imported the old class gets the new one."""
    module = __import__(module_name, fromlist=["_"])
    if "." in target:
        owner, name = getattr(module, target.split(".")[0]), target.split(".")[1]
    else:
        owner, name = module, target
    old = getattr(owner, name)
    source = textwrap.dedent(inspect.getsource(old))
    for pattern, replacement in edits:
        source, count = re.subn(pattern, replacement, source)
        assert count, (pattern, target)
    scope = dict(vars(module))
    # In the test\'s folder.
    with tempfile.NamedTemporaryFile("w", suffix=".py", dir=".", delete=False) as f:
        f.write(source)
    exec(compile(source, f.name, "exec"), scope)
    setattr(owner, name, scope[name])
    if owner is module:
        for other in list(sys.modules.values()):
            if getattr(other, name, None) is old:
                setattr(other, name, scope[name])

HANDLER = "torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler"
AGENT_API = "torch.distributed.elastic.agent.server.api"
'''

TORCH_CHANGES = {
    # SubprocessHandler starts its process through a step of another name.
    "popen renamed": 'rewrite(HANDLER, "SubprocessHandler", [(r"\\b_popen\\b", '
    '"_start_process")])\n',
    # __init__ no longer starts its process through self._popen (a subclass's _popen is never
    # called).
    "popen not called": 'rewrite(HANDLER, "SubprocessHandler", [(r"self\\._popen\\(", '
    '"SubprocessHandler._popen(self, ")])\n',
    # The log files a handler opened for its worker kept under other names.
    "log files renamed": 'rewrite(HANDLER, "SubprocessHandler", [(r"\\b_stdout\\b", "_out"), '
    '(r"\\b_stderr\\b", "_err")])\n',
    # What a forked worker runs to end as an interpreter ends, gone from CPython.
    "atexit._run_exitfuncs gone": "import atexit\ndel atexit._run_exitfuncs\n",
    # The agent's poll of its workers renamed, in the agent and in the loop that calls it.
    "monitor renamed": (
        "from torch.distributed.elastic.agent.server.api import SimpleElasticAgent\n"
        "from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent\n"
        "LocalElasticAgent._poll_workers = LocalElasticAgent._monitor_workers\n"
        "del LocalElasticAgent._monitor_workers, SimpleElasticAgent._monitor_workers\n"
        'rewrite(AGENT_API, "SimpleElasticAgent._invoke_run", [(r"self\\._monitor_workers\\(", '
        '"self._poll_workers(")])\n'
    ),
    # The loop polls the workers through another step; _monitor_workers is still there, never
    # called.
    "monitor bypassed": (
        "from torch.distributed.elastic.agent.server.api import SimpleElasticAgent\n"
        "from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent\n"
        "SimpleElasticAgent._poll_workers = LocalElasticAgent._monitor_workers\n"
        'rewrite(AGENT_API, "SimpleElasticAgent._invoke_run", [(r"self\\._monitor_workers\\(", '
        '"self._poll_workers(")])\n'
    ),
}

SAID = "is not what ddpkit relies on"


def launch(
    tmp_path: Path, env: dict, change: str | None, *args: str
) -> subprocess.CompletedProcess:
    """``ddpkit run --nproc 2 ARGS`` in ``tmp_path``, in a launcher with ``TORCH_CHANGES[change]``
    made first."""
    code = REWRITE + (TORCH_CHANGES[change] if change else "")
    code += "from ddpkit.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return subprocess.run(
        [sys.executable, "-c", code, "run", "--nproc", "2", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def rank_log(tmp_path: Path, rank: int) -> str:
    """What rank ``rank`` wrote to its standard output file under the run's log folder."""
    (found,) = (tmp_path / "ddpkit-logs").rglob(f"{rank}/stdout.log")
    return found.read_text()


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(contract, "_warned", set())


# a job each; the control of forking with torch as it is stays in the default suite
@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "internal"),
    [
        ("popen renamed", "torch's SubprocessHandler._popen"),
        ("popen not called", "SubprocessHandler._popen"),
        ("log files renamed", "SubprocessHandler._stdout/_stderr"),
        ("atexit._run_exitfuncs gone", "threading._shutdown/atexit._run_exitfuncs"),
    ],
)
def test_workers_start_as_new_interpreters_with_one_warning_and_their_output_where_asked(
    change, internal, clean_env, tmp_path
):
    out = launch(tmp_path, clean_env, change, "--fork-server", "on", FORK_PROBE, str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in range(2):
        assert (
            json.loads((tmp_path / f"rank{rank}.attempt0.json").read_text())["preloaded"] is False
        )
    assert out.stderr.count(SAID) == 1, out.stderr[-3000:]
    version = "CPython " if "atexit" in change else "torch "
    assert f"ddpkit: {internal} {SAID} in {version}" in out.stderr
    assert "forking workers from the job's server is off" in out.stderr
    # Rank 0 keeps the terminal, rank 1 writes to its log file, as without the fork server: a worker
    # started through torch's own step still gets the files torchrun opened for it.
    assert out.stdout.count("rank 0 to standard output") == 1 and "rank 1" not in out.stdout
    assert rank_log(tmp_path, 1) == "rank 1 to standard output\n"


@pytest.mark.slow
def test_control_with_torch_as_it_is_workers_are_forked_and_nothing_is_said(clean_env, tmp_path):
    out = launch(tmp_path, clean_env, None, "--fork-server", "on", FORK_PROBE, str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.attempt0.json").read_text())["preloaded"] is True
    assert SAID not in out.stderr and "Warning" not in out.stderr, out.stderr[-3000:]
    assert out.stdout.count("rank 0 to standard output") == 1 and "rank 1" not in out.stdout
    assert rank_log(tmp_path, 1) == "rank 1 to standard output\n"


# a job each; the control of forking with torch as it is stays in the default suite
@pytest.mark.slow
def test_an_agent_whose_poll_was_renamed_warns_at_construction_and_runs_as_torchruns(
    clean_env, tmp_path
):
    """Without the poll ddpkit rides on, a pre-empted job restarts (torchrun's way) instead of
    stopping: the warning names that loss once, at the agent's construction, and the job still
    runs."""
    out = launch(
        tmp_path, clean_env, "monitor renamed", "--max-restarts", "1", LAUNCH_PROBE, "preempted"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "attempt=1" in out.stdout  # restarted: the stop after a pre-emption is what was lost
    assert out.stderr.count(SAID) == 1, out.stderr[-3000:]
    assert f"LocalElasticAgent._monitor_workers/_shutdown {SAID} in torch " in out.stderr
    assert "no restart after a pre-emption" in out.stderr


# a job each; the control of forking with torch as it is stays in the default suite
@pytest.mark.slow
def test_an_agent_whose_poll_is_never_called_says_so_once(clean_env, tmp_path):
    out = launch(
        tmp_path, clean_env, "monitor bypassed", "--fork-server", "off", FORK_PROBE, str(tmp_path)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count(SAID) == 1, out.stderr[-3000:]
    assert f"LocalElasticAgent._monitor_workers (never called) {SAID} in torch " in out.stderr
    assert "stack dumps after a failure, no restart after a pre-emption" in out.stderr


# a job each; the control of forking with torch as it is stays in the default suite
@pytest.mark.slow
def test_control_an_agent_with_its_poll_stops_a_preempted_job_and_says_nothing(clean_env, tmp_path):
    out = launch(tmp_path, clean_env, None, "--max-restarts", "1", LAUNCH_PROBE, "preempted")
    assert out.returncode == 75, out.stderr[-3000:]
    assert "attempt=0" in out.stdout and "attempt=1" not in out.stdout
    assert SAID not in out.stderr


# -- pure logic ------------------------------------------------------------------------------------


class _Starts:
    """A stand-in for torchrun's SubprocessHandler: starts its process in __init__, through _popen
    or not."""

    through_popen = True

    def __init__(self, args, env) -> None:
        self.proc = self._popen(args, env) if self.through_popen else "started otherwise"

    def _popen(self, args, env):
        return "a new interpreter"


def test_a_handler_override_is_used_and_says_nothing_where_popen_is_called():
    handler = elastic.popen_override(_Starts, lambda h, args, env: f"forked {args}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert handler(["w"], {}).proc == "forked ['w']"
        assert handler(["w"], {}).proc == "forked ['w']"
    # None: start it as torch does
    declined = elastic.popen_override(_Starts, lambda h, args, env: None)
    assert declined(["w"], {}).proc == "a new interpreter"


def test_every_internal_holds_on_this_torch_and_python():
    for internal in elastic.INTERNALS + interpreter.INTERNALS:
        assert internal.check() is None, internal.name
    assert interpreter.finalize_problem() is None


def test_forking_is_refused_where_a_forked_worker_could_not_end_as_an_interpreter(monkeypatch):
    import atexit

    monkeypatch.delattr(atexit, "_run_exitfuncs")
    assert interpreter.finalize_problem() == "atexit has no _run_exitfuncs"


_ENDS_AT_ONCE = """
import io, os, sys, threading, atexit
from ddpkit._internals import interpreter
sys.modules["json"].kept = open(sys.argv[1], "w")  # a file held in a module's global, never closed
sys.modules["json"].kept.write("whole")
sys.modules["json"].binary = open(sys.argv[1] + ".bin", "wb")
sys.modules["json"].binary.write(b"bytes")
sys.modules["json"].read = open(sys.argv[1] + ".bin", "rb")  # open for reading: left alone
detached = io.TextIOWrapper(io.BytesIO())
detached.detach()  # reading its .closed raises, as sys.__stdout__'s after a script rewraps stdout
sys.modules["json"].detached = detached
import gc
gc.freeze()  # as a script does before forking loader workers: get_objects() no longer lists them
if sys.argv[2] == "finalize":
    interpreter.finalize_as_interpreter()
else:  # what a forked worker did before: threads joined and the exit handlers only
    threading._shutdown()
    atexit._run_exitfuncs()
os._exit(0)
"""


@pytest.mark.parametrize("ending", ["finalize", "control"])
def test_a_process_ended_at_once_flushes_the_files_its_modules_keep_open(tmp_path, ending):
    out = tmp_path / "kept.txt"
    done = subprocess.run(
        [sys.executable, "-c", _ENDS_AT_ONCE, str(out), ending], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    if ending == "finalize":
        assert out.read_text() == "whole" and (tmp_path / "kept.txt.bin").read_bytes() == b"bytes"
    else:  # Control: without the flush, os._exit loses what the files buffered.
        assert out.read_text() == "" and (tmp_path / "kept.txt.bin").read_bytes() == b""


def test_the_command_line_is_written_only_where_its_memory_is_found(tmp_path):
    """A misread ``arg_start`` is refused (nothing written); the real one is rewritten (``ps`` shows
    it)."""
    code = (
        "import sys\n"
        "from ddpkit._internals import interpreter as i\n"
        "start, end = i._command_line_memory()\n"
        "real = i._command_line_memory\n"
        "i._command_line_memory = lambda: (start + 1, end + 1)\n"
        "before = open('/proc/self/cmdline', 'rb').read()\n"
        "assert i.set_command_line(['misread']) is False\n"
        "assert open('/proc/self/cmdline', 'rb').read() == before\n"
        "i._command_line_memory = real\n"
        "assert i.set_command_line(['shown', 'as']) is True\n"
        "print(open('/proc/self/cmdline', 'rb').read().rstrip(b'\\0'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=os.environ | {}
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "b'shown\\x00as'"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("popen renamed", "SubprocessHandler._popen / _stdout / _stderr"),
        ("popen not called", "SubprocessHandler._popen / _stdout / _stderr"),
        ("log files renamed", "SubprocessHandler._popen / _stdout / _stderr"),
        ("atexit._run_exitfuncs gone", "atexit._run_exitfuncs"),
        ("monitor renamed", "LocalElasticAgent._monitor_workers / _shutdown"),
    ],
)
def test_each_change_is_named_by_its_check_with_the_version(change, named, tmp_path):
    """What ``ddpkit env`` and the contract tests print for a torch or CPython with the change: that
    internal, and only it, with the installed version."""
    code = REWRITE + TORCH_CHANGES[change]
    code += (
        "from ddpkit._internals import elastic, interpreter\nfrom ddpkit._internals.contract "
        "import problem\n"
    )
    code += (
        "print('\\n'.join(filter(None, map(problem, elastic.INTERNALS + interpreter.INTERNALS))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    (line,) = out.stdout.splitlines()
    assert named in line and ("(CPython 3." if "atexit" in change else "(torch 2.") in line, line
