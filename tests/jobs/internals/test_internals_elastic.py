"""torchrun's and CPython's private steps that ddpkit's launcher overrides, in real jobs: where one
is not as ddpkit relies on, the feature it serves is turned off with one warning naming it and the
version, and the job runs as torchrun would run it, each rank's output where the user asked for it.

The jobs below run ``ddpkit run`` in a launcher whose torch is rewritten first, from torch's own
source, as a release that renamed or changed the internal would be
(``tests/unit/internals/torch_changes.py``): the real process context, agent and workers run, only
the name differs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit._internals import contract
from tests.unit.internals.torch_changes import REWRITE, TORCH_CHANGES

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="the fork server is Linux only"
    ),
]

SCRIPTS = Path(__file__).parents[1] / "scripts"
FORK_PROBE = str(SCRIPTS / "fork_probe.py")
LAUNCH_PROBE = str(SCRIPTS / "launch_probe.py")
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
