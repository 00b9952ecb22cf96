"""``ddpkit env`` shows the seam's state: each private internal ddpkit relies on, ok or what differs
in the installed version."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import ddpkit._internals
from ddpkit._internals import dcp, optuna_journal
from ddpkit.tools._env import internals_state
from ddpkit.tools._env import main as env_main


def _seam(monkeypatch, internals) -> None:
    monkeypatch.setattr(ddpkit._internals, "all_internals", lambda: list(internals))


def test_env_names_each_internal_ok_and_one_changed_with_the_version_and_what_differs(
    monkeypatch, capsys
):
    pytest.importorskip("optuna")
    good = [*dcp.INTERNALS, *optuna_journal.INTERNALS]
    changed = dataclasses.replace(
        dcp.INTERNALS[0], check=lambda: "its first fields are ['path', 'start', 'size']"
    )
    _seam(monkeypatch, [changed, *good[1:]])
    # a diagnostic: it reports, the live check decides the status
    assert env_main(["--no-live"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"private internals relied on (1 of {len(good)} differ)" in lines
    for internal in good[1:]:
        assert f"  {internal.name}: ok" in lines, internal.name
    expected = (
        f"  {changed.name}: DIFFERS (torch {torch.__version__}): its first fields are ['path', "
        f"'start', 'size']; {changed.used_for}"
    )
    assert expected in lines, lines


def test_env_shows_every_internal_of_the_seam(monkeypatch):
    # Control for the one above: with no check patched, nothing differs on the torch under test.
    _seam(monkeypatch, dcp.INTERNALS)
    assert internals_state() == {i.name: "ok" for i in dcp.INTERNALS}


def test_optunas_internals_are_not_checked_where_it_is_not_installed(monkeypatch):
    for name in [m for m in sys.modules if m == "optuna" or m.startswith("optuna.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "optuna", None)
    _seam(monkeypatch, optuna_journal.INTERNALS)
    assert set(internals_state().values()) == {"not checked: Optuna (not installed)"}


def test_a_seam_that_cannot_be_listed_is_reported_not_a_crash(monkeypatch, capsys):
    def missing() -> list:
        raise ModuleNotFoundError("No module named 'ddpkit._internals.elastic'")

    monkeypatch.setattr(ddpkit._internals, "all_internals", missing)
    assert env_main(["--no-live"]) == 0
    assert (
        "  (all): cannot be listed: ModuleNotFoundError: No module named "
        "'ddpkit._internals.elastic'" in (capsys.readouterr().out)
    )
