"""The suite's autouse fixture (``tests/conftest.py``) resets ddpkit's module globals between tests.

An inner pytest session runs two tests in this process: the first leaves every global of
``DDPKIT_GLOBALS`` set through ddpkit's own calls, the second lists those it finds other than at
import. With the fixture both pass; the control, the same session without it, fails the second,
naming every global. A last test keeps the list complete: a module-level variable that ddpkit's code
may change must be in it.
"""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

import pytest

from tests.conftest import DDPKIT_GLOBALS
from tests.jobs.conftest import SRC, clean_environ

pytest_plugins = ["pytester"]

# Imported with this module, before any inner session: pytester drops the modules imported after its
# fixture is set up, and torch's extensions cannot be imported a second time in one process.
for _module in ["ddpkit", *(module for module, _ in DDPKIT_GLOBALS)]:
    importlib.import_module(_module)

LEAVE_AND_CHECK = """
import importlib
import signal

import torch

import ddpkit
from ddpkit.distributed import _progress as progress
from ddpkit.distributed import _runtime as runtime
from ddpkit.distributed import _seeding as seeding
from ddpkit.distributed import _signals as signals
from ddpkit._launch.recover import inplace as recover
from ddpkit._launch.recover import worker as recovering
from ddpkit._launch.agent import agent
from ddpkit._launch.agent import jobdir
from ddpkit.distributed import _channels as channels
from ddpkit.distributed import _runtime as lifetime
from ddpkit._launch.agent import forkserver as forked
from ddpkit.distributed import _spawn as spawn
from ddpkit._launch.rendezvous import backend
from ddpkit.data import _loader as loader
from ddpkit.nn import _dropout as dropout
from ddpkit.platforms import _mpi as mpi
from ddpkit.snapshot import _disk as staging
from ddpkit.tools import _workload as workload
from tests.conftest import DDPKIT_GLOBALS

ENTERED = []  # a block entered and never left, as by a test that failed inside it


def test_leaves_every_global_set(tmp_path):
    assert ddpkit.init() is runtime._runtime is not None
    signals.hold_stop_signals()
    signal.raise_signal(signal.SIGUSR1)  # held: remembered for the next fit()
    assert signals._pending == signal.SIGUSR1
    ENTERED.append(dropout.batch_layout(dropout.BatchLayout(global_size=4, offset=0, key=1)))
    ENTERED[-1].__enter__()
    dropout.GlobalBatchDropout(0.5).train()(torch.ones(2, 3))
    loader.Held().release_numpy()
    staging._groups[(0,)] = "a writer group of a process group since destroyed"
    script = tmp_path / "script.py"
    script.write_text("def ddpkit_workload(): ...")
    workload._load_script(str(script))
    backend.register("run-1", backend.JobAccess(b"secret", None), recover.InPlace(tmp_path))
    backend._relays["run-1"] = []
    recovering._links.append((99, "socket:[1]"))  # a group's links noted by a recovering worker
    recovering._making.append({})  # a group being made
    recovering._worker = object()  # a worker's part in the job's recoveries
    channels._inbox = object()  # an inbox's state, as a worker keeps it
    channels.on_message("incident", print)
    lifetime.hold("a holder", print)
    lifetime.on_resume(print)
    spawn._store = object()  # rank 0's store server of ddpkit.spawn
    mpi._served = object()  # rank 0's store server of an mpiexec job
    agent._answering = object()  # the thread an agent answers stack requests from
    forked._server = object()  # stands for the job's fork server, as the agent keeps it
    runtime._store_of = (("env://", 0, 2), object())  # a rendezvous store kept across init()s
    runtime._group_store = object()
    jobdir._job_folder = tmp_path  # an agent's job folder
    # A record left mapped.
    progress._buf, progress._ints, progress._floats = object(), object(), object()


def test_finds_them_as_at_import():
    left = sorted(
        f"{module}.{name}"
        for (module, name), initial in DDPKIT_GLOBALS.items()
        if getattr(importlib.import_module(module), name) != initial
    )
    if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
        left.append("the SIGUSR1 handler")
    assert not left, f"left behind: {left}"
"""


@pytest.fixture
def session(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """``session(with_fixture)``: the two tests in an inner session of this process, with or without
    the suite's fixture; plain python (no launcher variable), so that ``ddpkit.init()`` makes a
    world of one."""
    for name in set(os.environ) - set(clean_environ()):
        monkeypatch.delenv(name)
    pytester.makepyfile(test_leftovers=LEAVE_AND_CHECK)

    def run(with_fixture: bool) -> pytest.RunResult:
        plugins = ["-p", "tests.conftest"] if with_fixture else []
        return pytester.runpytest_inprocess(*plugins, "-p", "no:cacheprovider", "-p", "no:randomly")

    return run


def test_each_test_finds_ddpkit_globals_as_at_import(session):
    session(with_fixture=True).assert_outcomes(passed=2)


def test_control_without_the_fixture_the_next_test_finds_every_global_left_behind(session):
    result = session(with_fixture=False)
    result.assert_outcomes(passed=1, failed=1)
    out = result.stdout.str()
    assert all(f"{module}.{name}" in out for module, name in DDPKIT_GLOBALS), out
    assert "the SIGUSR1 handler" in out


def _module_state(path: Path) -> set[str]:
    """Module-level names bound to None or to an empty dict, list or set: state ddpkit's functions
    fill in."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        elif isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        else:
            continue
        empty = (isinstance(value, ast.Constant) and value.value is None) or (
            isinstance(value, (ast.Dict, ast.List, ast.Set))
            and not getattr(value, "keys", getattr(value, "elts", None))
        )
        found |= {t.id for t in targets if isinstance(t, ast.Name) and t.id.islower() and empty}
    return found


def test_every_module_global_of_ddpkit_is_reset():
    found = {
        (".".join(path.relative_to(SRC).with_suffix("").parts), name)
        for path in (SRC / "ddpkit").rglob("*.py")
        for name in _module_state(path)
    }
    assert found == set(DDPKIT_GLOBALS), (
        "add new module state to tests/conftest.py's DDPKIT_GLOBALS"
    )
