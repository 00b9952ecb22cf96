"""Optuna's storages, where ddpkit's search reaches past their public API: a journal's records and
their replay, and the storage a study writes through. Imports without Optuna (the checks pass)."""

from __future__ import annotations

import enum
import importlib
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from ddpkit._internals.contract import Internal


def journal_operations() -> frozenset[int]:
    """The ``op_code`` values of the records Optuna writes to a journal and replays."""
    from optuna.storages.journal._storage import JournalOperation

    return frozenset(int(op) for op in JournalOperation)


# a step below 2**61 - 1, where Python's hash of an int wraps: larger ones can share one hash
STEP_LIMIT = 2**61 - 1


_FINISHED = (1, 2, 3)  # TrialState COMPLETE, PRUNED, FAIL


class ReplayWork:
    """The work of Optuna's replay of a journal (``JournalStorageReplayResult.apply_logs``), counted
    in constant time a record, in entries copied or trials scanned; never less than the work."""

    def __init__(self) -> None:
        self.total = 0
        self._live: dict[str, int] = {}  # a live study's name -> its id
        self._names: list[str | None] = []  # study id -> its name while it lives
        # study id -> its trials (kept when it is deleted, as Optuna does)
        self._trials_of: list[int] = []
        self._study_attrs: list[int] = []
        self._trials: list[tuple[int, int]] = []  # trial id -> (study id, its number in the study)
        self._entries: list[int] = []  # trial id -> its params, attributes and intermediate values
        self._done: list[bool] = []  # trial id -> finished (Optuna sets nothing more on it)
        # (study, param) -> the first trial number with it
        self._first: dict[tuple[int, str], int] = {}

    def add(self, record: dict[str, Any]) -> int:
        """Count ``record`` (of a known ``op_code``); the work of all so far."""
        op, trial = record["op_code"], record.get("trial_id")
        study: Any = record.get("study_id")
        live = (
            type(study) is int and 0 <= study < len(self._names) and self._names[study] is not None
        )
        if op == 0 and isinstance(record.get("study_name"), str):  # CREATE_STUDY
            self.total += len(self._live)
            if record["study_name"] not in self._live:
                self._live[record["study_name"]] = len(self._names)
                self._names.append(record["study_name"])
                self._trials_of.append(0)
                self._study_attrs.append(0)
        elif op == 1 and live:  # DELETE_STUDY
            del self._live[self._names[study]]
            self._names[study] = None
        elif op in (2, 3) and live:  # SET_STUDY_USER_ATTR, SET_STUDY_SYSTEM_ATTR
            self.total += self._study_attrs[study]
            self._study_attrs[study] += 1
        elif op == 4 and live:  # CREATE_TRIAL
            self._trials.append((study, self._trials_of[study]))
            self._trials_of[study] += 1
            self._entries.append(0)
            self._done.append(record.get("state") in _FINISHED)
        # SET_TRIAL_STATE_VALUES
        elif op == 6 and type(trial) is int and 0 <= trial < len(self._trials):
            self._done[trial] = self._done[trial] or record.get("state") in _FINISHED
        # SET_TRIAL_*
        elif op in (5, 7, 8, 9) and type(trial) is int and 0 <= trial < len(self._trials):
            self.total += self._entries[trial]
            self._entries[trial] += 1
            name = record.get("param_name")
            if op == 5 and isinstance(name, str):
                study, number = self._trials[trial]
                first = self._first.get((study, name))
                self.total += self._trials_of[study] if first is None else first
                if first is None and not self._done[trial]:  # set here: the first trial that has it
                    self._first[(study, name)] = number
        return self.total


def memory_journal(records: list[dict[str, Any]]) -> Any:
    """A journal backend over ``records`` in memory, counting in ``handed`` the records read."""
    from optuna.storages.journal import BaseJournalBackend

    class MemoryJournal(BaseJournalBackend):
        def __init__(self) -> None:
            self.records, self.handed = records, 0

        def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
            for record in self.records[log_number_from:]:
                self.handed += 1
                yield record

        def append_logs(self, logs: list[dict[str, Any]]) -> None:
            self.records += logs

    return MemoryJournal()


def _optuna() -> ModuleType | None:
    try:
        return importlib.import_module("optuna")
    except ModuleNotFoundError as err:
        if err.name != "optuna":
            raise  # Optuna there but broken: the check reports what it raised
        return None


@contextmanager
def _quiet(optuna: ModuleType) -> Iterator[None]:
    """Optuna's logging at WARNING for the block, put back after."""
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(verbosity)


def _check_journal_operations() -> str | None:
    optuna = _optuna()
    if optuna is None:
        return None
    from optuna.storages.journal import JournalStorage

    try:
        from optuna.storages.journal._storage import JournalOperation
    except ImportError:
        return "optuna.storages.journal._storage has no JournalOperation"
    if not issubclass(JournalOperation, enum.IntEnum):
        return "JournalOperation is no IntEnum"
    records = memory_journal([])
    with _quiet(optuna):
        study = optuna.create_study(storage=JournalStorage(records))
        study.set_user_attr("a", 1)
        trial = study.ask()
        trial.suggest_float("x", 0.0, 1.0)
        trial.set_user_attr("b", 2)
        trial.report(0.5, 1)
        study.tell(trial, 0.5)
    codes = {int(op) for op in JournalOperation}
    unknown = sorted({r.get("op_code") for r in records.records} - codes, key=repr)
    if unknown:
        return f"Optuna wrote op_code {unknown}, not members of JournalOperation"
    if not all(isinstance(r.get("worker_id"), str) for r in records.records):
        return "a journal record has no worker_id string"
    return None


def _check_study_storage() -> str | None:
    optuna = _optuna()
    if optuna is None:
        return None
    from optuna.trial import TrialState, create_trial

    get_storage = getattr(optuna.storages, "get_storage", None)
    if not callable(get_storage):
        return "optuna.storages has no get_storage"
    with _quiet(optuna), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        storage = get_storage(optuna.storages.RDBStorage("sqlite:///:memory:"))
        if get_storage(storage) is not storage:
            return "get_storage does not return the storage it made unchanged"
        study = optuna.create_study(storage=storage)
        study_id = storage.get_study_id_from_name(study.study_name)
        template = create_trial(state=TrialState.RUNNING, user_attrs={"tag": 1})
        trial = optuna.Trial(study, storage.create_new_trial(study_id, template_trial=template))
        trial.suggest_float("x", 0.0, 1.0)
        found = study.get_trials(deepcopy=False)
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
        "a search on an RDB storage creates each trial with its tag in one write (a kill cannot "
        "leave an untagged one)",
        _check_study_storage,
    ),
]
