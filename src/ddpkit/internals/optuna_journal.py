"""Optuna's storages, where ddpkit's search reaches past their public API.

- ``optuna.storages.journal._storage.JournalOperation``: the operation codes of a journal's records. Before
  Optuna reads a journal, :func:`ddpkit.search.study.check_journal` refuses a record whose ``op_code`` is not
  one of them, naming the line (Optuna's own replay fails on it with a bare ``AssertionError``, or skips it
  under ``python -O``).
- ``optuna.storages.get_storage``: the storage object a study opened on a storage writes through (Optuna puts
  a cache in front of an ``RDBStorage``). A search creates each trial with its tag in one write through that
  object's public ``create_new_trial``; a write that went around the cache would leave a trial the study's
  cache does not know.

Optuna is an optional extra (``ddpkit[search]``): this module imports without it, its records are listed all
the same, and their checks return None (nothing to check, nothing relies on them) where Optuna is not
installed. :func:`ddpkit.internals.contract.version_of` then names it "not installed".
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

from ddpkit.internals.contract import Internal


def journal_operations() -> frozenset[int]:
    """The ``op_code`` values of the records Optuna writes to a journal and replays."""
    from optuna.storages.journal._storage import JournalOperation

    return frozenset(int(op) for op in JournalOperation)


def study_storage(storage: Any) -> Any:
    """The storage a study opened on ``storage`` writes through; pass it to ``optuna.create_study`` /
    ``load_study`` and write through it, so that the study and ddpkit's own writes share one cache."""
    import optuna

    return optuna.storages.get_storage(storage)


def _optuna() -> ModuleType | None:
    try:
        return importlib.import_module("optuna")
    except ModuleNotFoundError as err:
        if err.name != "optuna":
            raise  # Optuna there but broken: the check reports what it raised
        return None


def _check_journal_operations() -> str | None:
    if _optuna() is None:
        return None
    import enum

    from optuna.storages.journal import BaseJournalBackend, JournalStorage

    try:
        from optuna.storages.journal._storage import JournalOperation
    except ImportError:
        return "optuna.storages.journal._storage has no JournalOperation"
    if not issubclass(JournalOperation, enum.IntEnum):
        return "JournalOperation is no IntEnum"

    class Records(BaseJournalBackend):  # a journal in memory: what Optuna writes, as ddpkit's check reads it
        def __init__(self) -> None:
            self.logs: list[dict[str, Any]] = []

        def read_logs(self, log_number_from: int) -> list[dict[str, Any]]:
            return self.logs[log_number_from:]

        def append_logs(self, logs: list[dict[str, Any]]) -> None:
            self.logs += logs

    import optuna

    records = Records()
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(storage=JournalStorage(records))
        study.set_user_attr("a", 1)
        trial = study.ask()
        trial.suggest_float("x", 0.0, 1.0)
        trial.set_user_attr("b", 2)
        trial.report(0.5, 1)
        study.tell(trial, 0.5)
    finally:
        optuna.logging.set_verbosity(verbosity)
    codes = {int(op) for op in JournalOperation}
    unknown = sorted({r.get("op_code") for r in records.logs} - codes, key=repr)
    if unknown:
        return f"Optuna wrote op_code {unknown}, not members of JournalOperation"
    if not all(isinstance(r.get("worker_id"), str) for r in records.logs):
        return "a journal record has no worker_id string"
    return None


def _check_study_storage() -> str | None:
    optuna = _optuna()
    if optuna is None:
        return None
    import warnings

    from optuna.trial import TrialState, create_trial

    get_storage = getattr(optuna.storages, "get_storage", None)
    if not callable(get_storage):
        return "optuna.storages has no get_storage"
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            storage = get_storage(optuna.storages.RDBStorage("sqlite:///:memory:"))
            if get_storage(storage) is not storage:
                return "get_storage does not return the storage it made unchanged"
            study = optuna.create_study(storage=storage)
            study_id = storage.get_study_id_from_name(study.study_name)
            template = create_trial(state=TrialState.RUNNING, user_attrs={"tag": 1})
            trial = optuna.Trial(study, storage.create_new_trial(study_id, template_trial=template))
            trial.suggest_float("x", 0.0, 1.0)  # through the cache: refused if it does not know the trial
            found = study.get_trials(deepcopy=False)
    finally:
        optuna.logging.set_verbosity(verbosity)
    if [(t.number, t.state, t.user_attrs, set(t.params)) for t in found] != [
        (0, TrialState.RUNNING, {"tag": 1}, {"x"})
    ]:
        return "a trial created through the storage is not the study's running trial with its tag"
    return None


INTERNALS = [
    Internal(
        "optuna.storages.journal._storage.JournalOperation",
        "Optuna",
        "a damaged search journal is refused naming its line, not failed inside Optuna's replay",
        _check_journal_operations,
    ),
    Internal(
        "optuna.storages.get_storage",
        "Optuna",
        "a search on an RDB storage creates each trial with its tag in one write (a kill cannot leave an untagged one)",
        _check_study_storage,
    ),
]
