"""The search's parts with no rank started: a space Optuna rejects, the samplers seeded apart per
start, errors of the machine told from a candidate's, and a damaged journal repaired or refused."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

import ddpkit
from ddpkit._errors import ConfigError
from ddpkit.search import SearchConfig, uniform
from ddpkit.search._engine import environment_error
from ddpkit.search._study import new_sampler, repair_journal


def test_a_search_space_optuna_rejects_is_a_clear_error():
    with pytest.raises(ConfigError, match="uniform"):
        uniform(1.0, 0.1)
    with pytest.raises(ConfigError, match="log"):
        uniform(0.0, 1.0, log=True)
    with pytest.raises(ConfigError, match="parameter 'lr'"):
        ddpkit.search._config.to_distributions({"lr": 0.1})
    with pytest.raises(ConfigError, match="sampler='grid' needs choices"):
        new_sampler(SearchConfig(n_trials=1, sampler="grid"), {"lr": uniform(0.1, 1.0)})


def _draws(sampler: str, group: int, start: int, n: int = 4) -> list[tuple]:
    space = {"lr": uniform(1e-3, 1.0, log=True), "momentum": uniform(0.0, 0.9)}
    cfg = SearchConfig(n_trials=n, sampler=sampler)
    study = optuna.create_study(sampler=new_sampler(cfg, space, group, start))
    return [tuple(study.ask(space).params.values()) for _ in range(n)]


@pytest.mark.parametrize("sampler", ["tpe", "evolution", "random", "nsga2"])
def test_each_start_seeds_the_samplers_apart_and_a_replayed_start_alike(sampler):
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    first, replayed = _draws(sampler, group=0, start=0), _draws(sampler, group=0, start=0)
    restart, other_group = _draws(sampler, group=0, start=1), _draws(sampler, group=1, start=0)
    # Seeded alike, samplers draw alike: what every start did when a start was not part of the seed
    # (the control), and what a replayed start must still do.
    assert first == replayed
    assert not set(first) & set(restart)
    assert not set(first) & set(other_group)


def _raised(outer: BaseException, inner: BaseException, cause: bool = True) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as err:
            if cause:
                raise outer from err
            raise outer  # noqa: B904 - an error while handling another: its __context__
    except BaseException as err:
        return err


def test_errors_of_the_machine_are_told_from_a_candidates_errors():
    from torch.distributed.checkpoint.api import CheckpointException

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/search/trial-0001/snapshots")
    read_only = OSError(errno.EROFS, os.strerror(errno.EROFS))
    machine = [
        full,
        read_only,
        OSError(errno.EDQUOT, "quota"),
        OSError(errno.EIO, "I/O error"),
        # A snapshot written in the background is re-raised in the training thread from its error.
        _raised(RuntimeError("ddpkit: writing a snapshot in the background failed"), full),
        # torch.distributed.checkpoint gathers each rank's error into one exception (a
        # BaseException).
        CheckpointException("save failed", {1: (read_only, None)}),
        _raised(RuntimeError("background"), CheckpointException("save failed", {0: (full, None)})),
        _raised(KeyError("cleanup failed too"), full, cause=False),
    ]
    candidate = [
        ValueError("a bug in user code"),
        FloatingPointError("non-finite loss"),
        MemoryError(),
        RuntimeError("CUDA out of memory"),
        FileNotFoundError(errno.ENOENT, "no such file"),
        OSError(errno.ENOMEM, "cannot allocate memory"),
        PermissionError(errno.EACCES, "permission denied"),
        _raised(RuntimeError("wrapped"), ValueError("a bug")),
    ]
    assert [environment_error(e) is not None for e in machine] == [True] * len(machine)
    assert [environment_error(e) for e in candidate] == [None] * len(candidate)


def _journal_study(path: Path) -> optuna.Study:
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(
        study_name="s", storage=JournalStorage(JournalFileBackend(str(path))), load_if_exists=True
    )


def _optimize(study: optuna.Study, n: int) -> None:
    study.optimize(lambda t: t.suggest_float("x", 0.0, 1.0), n_trials=n)


def test_a_journal_cut_at_its_end_is_repaired_keeping_every_whole_record(tmp_path):
    path = tmp_path / "study.journal"
    _optimize(_journal_study(path), 3)
    whole = path.read_bytes()
    values = [t.value for t in _journal_study(path).trials]
    # trial 2's last record (its result) cut short, as by a kill or a full disk mid-write
    cut = whole[:-20]
    # Control: left as it is, the next record is glued to the cut one, and the study can no longer
    # be read.
    path.write_bytes(cut)
    with pytest.raises(json.JSONDecodeError):
        _optimize(_journal_study(path), 1)
    with pytest.raises(json.JSONDecodeError):
        _journal_study(path)

    path.write_bytes(cut)
    note = repair_journal(path)
    kept = cut[: cut.rfind(b"\n") + 1]
    assert path.read_bytes() == kept and "cut short" in note
    [aside] = tmp_path.glob("study.journal.cut-*")
    assert aside.read_bytes() == cut[len(kept) :] and aside.name in note
    study = _journal_study(path)
    _optimize(study, 1)
    trials = _journal_study(path).trials
    complete, running = TrialState.COMPLETE, TrialState.RUNNING
    # trial 2's result was cut
    assert [t.state for t in trials] == [complete, complete, running, complete]
    assert [t.value for t in trials[:2]] == values[:2]
    assert repair_journal(path) is None  # a whole journal is left alone


def test_a_journal_damaged_before_its_end_is_refused_naming_the_line_and_the_ways_out(tmp_path):
    path = tmp_path / "study.journal"
    _optimize(_journal_study(path), 2)
    lines = path.read_bytes().splitlines(keepends=True)
    # What Optuna leaves after a cut last record: the next record glued to it, then the later
    # records.
    damaged = b"".join(lines[:3] + [lines[3][:15] + lines[4]] + lines[5:])
    path.write_bytes(damaged)
    with pytest.raises(ConfigError) as err:
        repair_journal(path)
    message = str(err.value)
    assert str(path) in message and "line 4 of" in message
    assert f"head -n 3 {path}" in message and "another search_dir" in message
    assert path.read_bytes() == damaged  # nothing changed
