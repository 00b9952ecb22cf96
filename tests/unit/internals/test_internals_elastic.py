"""torchrun's and CPython's private steps that ddpkit's launcher overrides, in one process each:
the override used where the step is as ddpkit relies on, each internal checked on this torch and
Python, a process ended at once flushing its files, and each change (``torch_changes.py``) named by
its check with the version. The jobs run under such changes are in
``tests/jobs/internals/test_internals_elastic.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from ddpkit._internals import elastic, interpreter
from tests.unit.internals.torch_changes import REWRITE, TORCH_CHANGES

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the fork server is Linux only"
    ),
]

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
