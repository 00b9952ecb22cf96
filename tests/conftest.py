"""Shared helpers for the tests: a way to run ``python -c`` in a fresh interpreter of the clean
environment (``tests/jobs/conftest.py``), and ddpkit's module globals reset after each test."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from tests.jobs.conftest import clean_environ
from tests.require_run import pytest_sessionfinish  # noqa: F401 (a hook of this suite)


@pytest.fixture(scope="session")
def run_python(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[..., subprocess.CompletedProcess]:
    """``run_python(code, env=None, extra_env=None, timeout=90)``: run ``python -c code`` as a fresh
    process.

    ``env`` defaults to the clean environment; ``extra_env`` is added on top. Output is captured as
    text. Past ``timeout`` the process and all its descendants are killed and the test fails.
    """
    cwd = tmp_path_factory.mktemp("subprocess_cwd")

    def run(
        code: str,
        env: Mapping[str, str] | None = None,
        extra_env: Mapping[str, str] | None = None,
        timeout: float = 90,
    ) -> subprocess.CompletedProcess:
        full_env = dict(clean_environ() if env is None else env)
        full_env.update(extra_env or {})
        args = [sys.executable, "-c", code]
        # A session of its own, so that on timeout the process and everything it started (ranks
        # forked by ddpkit.spawn, loader workers) can be killed together and nothing outlives the
        # test.
        proc = subprocess.Popen(
            args,
            env=full_env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(
                f"python -c ... did not finish within {timeout}s\n--- stdout\n{out}\n--- stderr "
                f"(end)\n{err[-4000:]}"
            ) from None
        return subprocess.CompletedProcess(args, proc.returncode, out, err)

    return run


# ddpkit's module-level state, with its value at import: what a test run in this process may leave
# behind for the next test to trip on (a runtime that makes the next init() a no-op, a held SIGUSR1
# that stops the next fit(), writer groups of a destroyed process group, a cached script).
# runtime._generation is left alone on purpose: it numbers the process groups this process has made,
# so that no later group reads an earlier one's keys in a store they share.
DDPKIT_GLOBALS: dict[tuple[str, str], Any] = {
    ("ddpkit.distributed._runtime", "_runtime"): None,
    ("ddpkit.distributed._runtime", "_store_of"): None,
    ("ddpkit.distributed._runtime", "_group_store"): None,
    ("ddpkit.distributed._signals", "_pending"): None,
    # a rank's progress record for the launcher's stall watch: a test that opened one leaves it
    # mapped
    ("ddpkit.distributed._progress", "_buf"): None,
    ("ddpkit.distributed._progress", "_ints"): None,
    ("ddpkit.distributed._progress", "_floats"): None,
    ("ddpkit.data._loader", "_stand_in"): [],  # numpy's stand-in generator, made once
    ("ddpkit.nn._dropout", "_layout"): None,
    ("ddpkit.nn._dropout", "_calls"): {},
    ("ddpkit.snapshot._disk", "_groups"): {},
    ("ddpkit._launch.agent.jobdir", "_job_folder"): None,  # the agent's job folder
    ("ddpkit.tools._workload", "_modules"): {},
    ("ddpkit._launch.recover.worker", "_links"): [],
    ("ddpkit._launch.recover.worker", "_making"): [],
    ("ddpkit._launch.recover.worker", "_worker"): None,
    ("ddpkit.distributed._channels", "_inbox"): None,
    ("ddpkit.distributed._channels", "_handlers"): {},
    ("ddpkit.distributed._runtime", "_held"): {},
    ("ddpkit.distributed._runtime", "_listeners"): [],
    ("ddpkit.distributed._spawn", "_store"): None,
    ("ddpkit.platforms._mpi", "_served"): None,
    ("ddpkit._launch.agent.agent", "_answering"): None,
    ("ddpkit._launch.rendezvous.backend", "_jobs"): {},
    ("ddpkit._launch.rendezvous.backend", "_relays"): {},
    ("ddpkit._launch.rendezvous.backend", "_in_place"): {},
    ("ddpkit._launch.agent.forkserver", "_server"): None,
}
# hold_stop_signals() and the Trainer's stop_signals() install handlers for these in the process
# that calls them.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def _set_global(module: Any, name: str, value: Any) -> None:
    current = getattr(module, name)
    if isinstance(current, dict) and isinstance(value, dict):
        current.clear()  # in place: the module's functions hold this very dict
        current.update(value)
    elif isinstance(current, list) and isinstance(value, list):
        current[:] = value
    else:
        setattr(module, name, value)


@pytest.fixture(autouse=True)
def _reset_ddpkit_globals() -> Iterator[None]:
    """Put ddpkit's module globals, the stop-signal handlers and torch's default process group back
    as they were before the test: tests share one process, and none may see what another left."""
    before = {}
    for (module_name, name), _ in DDPKIT_GLOBALS.items():
        if module_name in sys.modules:
            value = getattr(sys.modules[module_name], name)
            before[module_name, name] = (
                copy.copy(value) if isinstance(value, (dict, list)) else value
            )
    handlers = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    dist = sys.modules.get("torch.distributed")
    had_group = dist is not None and dist.is_available() and dist.is_initialized()
    yield
    dist = sys.modules.get("torch.distributed")
    if not had_group and dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for sig, handler in handlers.items():
        # None: installed from outside Python, nothing to put back from here
        if handler is not None:
            signal.signal(sig, handler)
    for (module_name, name), initial in DDPKIT_GLOBALS.items():
        # imported before the test, or by it (then back to its value at import)
        if module_name in sys.modules:
            value = before.get((module_name, name), initial)
            _set_global(
                sys.modules[module_name],
                name,
                copy.copy(value) if isinstance(value, (dict, list)) else value,
            )


JOB_TIER_TIMEOUT = 900  # seconds; see pytest_collection_modifyitems


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Tests of features a torch older than they need refuses (naming the version) are skipped
    there, saying why: ``@pytest.mark.torch_at_least(2, 7, "why")``, and the CPU tests that train
    with fsdp (the strategy's refusal is tested by
    ``test_fsdp_on_the_cpu_is_refused_below_its_torch_naming_the_version``)."""
    from ddpkit._internals.versions import TORCH_VERSION
    from ddpkit.strategies._fsdp import FSDP_ON_CPU

    for item in items:
        # The hang guard of the job tiers: their tests wait on jobs with deadlines of their own,
        # which fail naming what did not happen and showing the logs; a loaded machine (CI runs two
        # of them at once beside other work) can take a whole job past pyproject's 120 s, and the
        # guard must not cut such a test short of its own diagnosis. A test's own mark stands.
        if item.get_closest_marker("timeout") is None and any(
            item.get_closest_marker(tier) for tier in ("slow", "heavy", "gpu")
        ):
            item.add_marker(pytest.mark.timeout(JOB_TIER_TIMEOUT))
        marker = item.get_closest_marker("torch_at_least")
        if marker is not None and TORCH_VERSION < tuple(marker.args[:2]):
            major, minor, why = marker.args
            item.add_marker(pytest.mark.skip(reason=f"{why} needs torch >= {major}.{minor}"))
        elif (
            TORCH_VERSION < FSDP_ON_CPU
            and "fsdp" in item.nodeid.lower()
            and "refused" not in item.name
            and item.get_closest_marker("gpu") is None
        ):
            item.add_marker(
                pytest.mark.skip(
                    reason=f"fsdp on the CPU needs torch >= {FSDP_ON_CPU[0]}.{FSDP_ON_CPU[1]}"
                )
            )
