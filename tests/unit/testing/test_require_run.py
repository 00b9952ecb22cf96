"""The suite's tier check (tests/require_run.py, set by CI's DDPKIT_REQUIRE_RUN=1): a pytest run in
which every test skipped fails; one in which a test passed does not. Control: without the variable,
the all-skipped run exits 0, which is what hid a tier that ran nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs.conftest import ROOT, clean_environ

SKIPPED = """
import pytest

@pytest.mark.skip(reason="the cluster tool is not installed")
def test_on_the_cluster():
    pass
"""
ONE_PASSES = SKIPPED + "\n\ndef test_here():\n    pass\n"


def _tier(
    tmp_path: Path, tests: str, require: bool, *options: str
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(
        "from tests.require_run import pytest_sessionfinish  # noqa: F401\n"
    )
    (tmp_path / "test_tier.py").write_text(tests)
    # The installed plugins are not what is tested, and loading them costs ~1 s a run (xdist's
    # worker loads them again): only xdist, where the run uses it.
    env = (
        clean_environ()
        | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        | ({"DDPKIT_REQUIRE_RUN": "1"} if require else {})
    )
    plugins = ["-p", "xdist"] if "-n" in options else []
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        *plugins,
        *options,
        str(tmp_path),
    ]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_a_tier_whose_tests_all_skip_fails_naming_why(tmp_path):
    done = _tier(tmp_path, SKIPPED, require=True)
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout[-3000:]
    assert "DDPKIT_REQUIRE_RUN=1 and no test passed (1 skipped)" in done.stdout


def test_control_without_the_variable_an_all_skipped_tier_passes(tmp_path):
    done = _tier(tmp_path, SKIPPED, require=False)
    assert done.returncode == pytest.ExitCode.OK, done.stdout[-3000:]


def test_a_tier_in_which_one_test_passes_passes(tmp_path):
    done = _tier(tmp_path, ONE_PASSES, require=True)
    assert done.returncode == pytest.ExitCode.OK, done.stdout[-3000:]


def test_under_xdist_the_controller_counts_the_workers_tests(tmp_path):
    """CI's slow step runs under xdist: the workers' passes count, and a run of only skips still
    fails."""
    assert _tier(tmp_path, ONE_PASSES, True, "-n", "1").returncode == pytest.ExitCode.OK
    done = _tier(tmp_path, SKIPPED, True, "-n", "1")
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout[-3000:]
