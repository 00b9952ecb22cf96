"""A tier of the suite that ran nothing fails: with ``DDPKIT_REQUIRE_RUN=1`` in the environment, a
pytest run in which no test passed (every test skipped, deselected or none collected) exits
non-zero.

CI sets it for the tiers whose tests skip when something is missing (the slow tests without a
cluster tool, a torch-matrix cell whose venv lost a dependency): without it such a tier reports "N
skipped" and exits 0, and a broken cell looks the same as a green one.
"""

from __future__ import annotations

import os

import pytest

ENV = "DDPKIT_REQUIRE_RUN"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # xdist: the controller counts
    if os.environ.get(ENV) != "1" or hasattr(session.config, "workerinput"):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or exitstatus not in (
        pytest.ExitCode.OK,
        pytest.ExitCode.NO_TESTS_COLLECTED,
    ):
        return
    if reporter.stats.get("passed"):
        return
    skipped = len(reporter.stats.get("skipped", []))
    reporter.ensure_newline()
    reporter.write_sep(
        "!",
        f"{ENV}=1 and no test passed ({skipped} skipped): this tier ran nothing; see the skip "
        "reasons (-rs)",
        red=True,
    )
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
