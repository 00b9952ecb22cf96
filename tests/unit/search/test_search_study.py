"""A search's trials are created with their tag in one write and resumed by number, on a journal and
on an RDB storage, through Optuna's public storage API; Optuna's internals the search keeps are in
the seam."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("optuna")

import optuna  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from ddpkit._internals import optuna_journal  # noqa: E402
from ddpkit._internals.contract import problem  # noqa: E402
from ddpkit.search import SearchConfig, choice, uniform  # noqa: E402
from ddpkit.search._config import to_distributions  # noqa: E402
from ddpkit.search._study import (  # noqa: E402
    _SEARCH_KEY,
    created_trial,
    draw_params,
    open_search_study,
    resumed_trial,
    trials_of,
)

SPACE = to_distributions({"lr": uniform(1e-4, 1e-1, log=True), "act": choice(["relu", "gelu"])})


def _config(tmp_path, storage: str) -> SearchConfig:
    url = None if storage == "journal" else f"sqlite:///{tmp_path / 'study.db'}"
    return SearchConfig(n_trials=3, search_dir=str(tmp_path), storage=url, sampler="random")


@pytest.mark.parametrize("storage", ["journal", "sqlite"])
def test_a_created_trial_carries_its_tag_and_resumes_by_number_with_its_draws_kept(
    tmp_path, storage
):
    cfg = _config(tmp_path, storage)
    first = open_search_study(cfg, SPACE, create=True)
    trial = created_trial(first, "search-a")
    assert trial.user_attrs == {_SEARCH_KEY: "search-a"}
    trial.suggest_float("lr", 1e-4, 1e-1, log=True)  # killed here: one parameter drawn of two
    # A later start (another study object on the same storage) resumes it: the drawn one kept, the
    # rest drawn.
    again = open_search_study(cfg, SPACE, create=False)
    resumed = resumed_trial(again, trial.number, SPACE)
    assert resumed is not None and resumed.number == trial.number
    assert set(resumed.params) == {"lr", "act"} and resumed.params["lr"] == trial.params["lr"]
    assert [t.number for t in trials_of(again.study, "search-a")] == [trial.number]
    assert trials_of(again.study, "search-b") == []
    again.study.tell(trial.number, 1.0)
    assert resumed_trial(again, trial.number, SPACE) is None  # a finished trial is not resumed


def test_a_trial_and_its_tag_are_one_record_of_the_journal(tmp_path):
    """What makes a kill harmless: the tag is in the record that creates the trial. Control:
    ``study.ask()`` then the tag writes two records, and a kill between them leaves a trial of no
    search."""
    cfg = _config(tmp_path, "journal")
    handle = open_search_study(cfg, SPACE, create=True)
    journal = tmp_path / "study.journal"

    def new_records(before: int) -> list[dict]:
        return [json.loads(line) for line in journal.read_text().splitlines()[before:]]

    before = len(journal.read_text().splitlines())
    draw_params(created_trial(handle, "search-a"), SPACE)
    created = [r for r in new_records(before) if r["op_code"] == 4]  # CREATE_TRIAL
    assert len(created) == 1 and created[0]["user_attrs"] == {_SEARCH_KEY: "search-a"}

    before = len(journal.read_text().splitlines())
    control = handle.study.ask()
    control.set_user_attr(_SEARCH_KEY, "search-a")
    records = new_records(before)
    # tagged only by a second record
    assert records[0]["op_code"] == 4 and not records[0].get("user_attrs")


def test_optuna_internals_hold_and_a_damaged_journal_is_still_refused(tmp_path):
    for internal in optuna_journal.INTERNALS:
        assert problem(internal) is None, problem(internal)
    assert {0, 4, 6} <= optuna_journal.journal_operations()


def test_without_optuna_the_seam_imports_and_its_checks_do_not_apply(monkeypatch):
    # Optuna is an extra: the seam lists its records all the same, and a check has nothing to look
    # at.
    for name in [m for m in sys.modules if m == "optuna" or m.startswith("optuna.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "optuna", None)  # `import optuna` raises ModuleNotFoundError
    with pytest.raises(ModuleNotFoundError):
        import optuna as _  # noqa: F401
    assert len(optuna_journal.INTERNALS) == 2
    assert [i.check() for i in optuna_journal.INTERNALS] == [None, None]


def test_a_study_storage_check_that_finds_a_difference_names_it(monkeypatch):
    """Control: where ``get_storage`` wrapped the storage again, the study and ddpkit would write
    through two caches; the check says so."""
    monkeypatch.setattr(
        optuna.storages, "get_storage", lambda storage: optuna.storages.InMemoryStorage()
    )
    line = problem(optuna_journal.INTERNALS[1])
    assert line is not None and "optuna.storages.get_storage" in line and optuna.__version__ in line


def test_a_trial_of_another_state_is_not_resumed(tmp_path):
    handle = open_search_study(_config(tmp_path, "journal"), SPACE, create=True)
    trial = created_trial(handle, "search-a")
    handle.study.tell(trial, state=TrialState.FAIL)
    assert resumed_trial(handle, trial.number, SPACE) is None
