"""The search's side of the Optuna study: opening it, its samplers and pruners, and the trials of
this search.

Trials of a search carry its id (a study shared between searches through an RDB URL is counted and
resumed for ours only); each start of the search is counted in the study and seeds the samplers
apart; a trial is created with its tag in one write, so a kill while its parameters are drawn leaves
a trial the next start resumes.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import optuna
from optuna.storages.journal import BaseJournalBackend, JournalStorage
from optuna.trial import TrialState

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._fs.lock import take as take_lock
from ddpkit._internals.optuna_journal import (
    STEP_LIMIT,
    ReplayWork,
    journal_operations,
    study_storage,
)
from ddpkit.distributed._seeding import mix_seed
from ddpkit.search._config import SearchConfig
from ddpkit.search._search_dir import (
    JOURNAL,
    SearchDirLock,
    check_trial_dirs,
    describe_storage,
    refuse_large_journal,
    repair_journal,
)

# Optuna's replay of a journal may cost at most this much work a record (ReplayWork: entries copied
# or trials scanned, ~10-100 ns each), above a floor of a fraction of a second: a trial's k
# intermediate values cost k**2 / 2 copies, so 2,000 in every trial are read, and any journal of up
# to 16M entries' work.
_REPLAY_PER_RECORD = 1024
_REPLAY_FLOOR = 1 << 24
# a trial's user attribute: which search (run of this job) it belongs to
_SEARCH_KEY = "ddpkit_search"


_STARTS_KEY = "ddpkit_starts"  # a study's user attribute: how many times a search was started on it


def new_sampler(
    cfg: SearchConfig,
    distributions: dict[str, Any],
    group_index: int = 0,
    start: int = 0,
    search_id: str = "",
) -> optuna.samplers.BaseSampler:
    # Each group's sampler draws its own random numbers: with one seed everywhere, groups asking at
    # the same time would draw the same "random" candidates. Each start of the search too: the
    # samplers' random state is not in the study, so a restarted job (or a rerun with a larger
    # budget) seeded as the first start was would draw the first start's candidates again. `start`
    # is counted in the study, so the same starts replayed draw the same candidates. A study shared
    # through a database may be started by several searches at once, which read the same count:
    # each search's own id (kept in its search_dir) sets theirs apart.
    shared = (search_id,) if cfg.storage is not None else ()
    seed = mix_seed(cfg.seed, "sampler", start, group_index, *shared)
    opts = dict(cfg.sampler_options)
    if cfg.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, **opts)
    if cfg.sampler == "evolution":
        from ddpkit.search._evolution import EvolutionSampler

        return EvolutionSampler(seed=seed, **opts)
    if cfg.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, **opts)
    if cfg.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed, **opts)
    if cfg.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    grid = {}
    for name, dist in distributions.items():
        if not isinstance(dist, optuna.distributions.CategoricalDistribution):
            raise ConfigError(
                f"sampler='grid' needs choices only; {name!r} is {dist}: give it as choice([...])"
            )
        grid[name] = list(dist.choices)
    return optuna.samplers.GridSampler(grid, seed=seed)


def new_pruner(cfg: SearchConfig) -> optuna.pruners.BasePruner:
    pruners: dict[str, Callable[[], optuna.pruners.BasePruner]] = {
        "median": lambda: optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2),
        "halving": optuna.pruners.SuccessiveHalvingPruner,
        "hyperband": optuna.pruners.HyperbandPruner,
        "none": optuna.pruners.NopPruner,
    }
    return pruners[cfg.pruner]()


def open_storage(cfg: SearchConfig) -> optuna.storages.BaseStorage:
    """The storage a study of this search writes through (an RDB's behind the cache Optuna puts
    before it)."""
    if cfg.storage is None:
        from optuna.storages.journal import JournalFileBackend

        return study_storage(
            JournalStorage(JournalFileBackend(str(Path(cfg.search_dir) / JOURNAL)))
        )
    return study_storage(
        optuna.storages.RDBStorage(cfg.storage, engine_kwargs={"pool_pre_ping": True})
    )


class _Replay(BaseJournalBackend):
    """A journal's records in memory, for Optuna to replay: the number handed out so far tells which
    record a failure of the replay came from (Optuna reads them lazily, one at a time)."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records, self.handed = records, 0

    def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
        for record in self.records[log_number_from:]:
            self.handed += 1
            yield record

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        raise RuntimeError("a journal being checked is not written")


def check_journal(path: Path) -> None:
    """Refuse a journal that Optuna would fail to read, naming the file, the line and what is wrong
    with it: a record that is not an object, has no known ``op_code`` or ``worker_id``, or that
    Optuna fails to replay (a trial of no study, a field missing). Without this, such a file fails
    in Optuna's replay with a bare ``KeyError`` or ``AssertionError``. A last line without its
    newline is :func:`repair_journal`'s."""
    try:
        # a FIFO would block a plain open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(
                f"the study's journal {path} is not a regular file: give the search another "
                "search_dir"
            )
        refuse_large_journal(path, os.fstat(fd).st_size)
        data = f.read()
    lines = data.split(b"\n")[:-1]  # whole lines only

    def refuse(number: int, what: str) -> NoReturn:
        raise ConfigError(
            f"the study's journal {path} is damaged at line {number} of {len(lines)}: {what}. It "
            "was not written so by Optuna (edited by hand?): put the line back as it was, or keep "
            f"the {number - 1} records before it (`head -n {number - 1} {path} > {path}.kept`, "
            f"then move {path}.kept over it), or start the search afresh in another search_dir"
        )

    operations = journal_operations()
    records = []
    work, budget = ReplayWork(), _REPLAY_PER_RECORD * len(lines) + _REPLAY_FLOOR
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested too deep
            refuse(number, "not a JSON record")
        if not isinstance(record, dict):
            refuse(number, f"a JSON {type(record).__name__}, not an object")
        op = record.get("op_code")
        if type(op) is not int or op not in operations:
            refuse(
                number,
                f"op_code {repr(op)[:40]} is not one of Optuna's operations (0 to "
                f"{max(operations)})",
            )
        if not isinstance(record.get("worker_id"), str):
            refuse(number, "it names no worker_id")
        values = record.get("intermediate_values") if op == 4 else None
        steps = (
            [record.get("step")] if op == 7 else list(values) if isinstance(values, dict) else []
        )
        if not all(_step(s) for s in steps):
            refuse(number, f"a step that is not an integer from 0 to {STEP_LIMIT - 1}")
        if work.add(record) > budget:
            raise ConfigError(
                f"the study's journal {path} would cost Optuna more than {budget} steps to replay "
                f"by line {number} (copies and scans that grow with the records before each; "
                f"{len(lines)} records): continue the search in another search_dir, or give it an "
                "RDB storage (SearchConfig.storage)"
            )
        records.append(record)
    replay = _Replay(records)
    try:
        JournalStorage(replay)
    except Exception as err:  # noqa: BLE001
        # KeyError, TypeError, AssertionError...: each a bad record.
        refuse(replay.handed, f"Optuna cannot replay it ({type(err).__name__}: {str(err)[:200]})")


def _step(value: Any) -> bool:
    """A step of an intermediate value (a record's int, or a create_trial's key: a string of
    one)."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 20:
        value = int(value)
    return type(value) is int and 0 <= value < STEP_LIMIT


@dataclass(frozen=True)
class SearchStudy:
    """A study as a group's rank 0 holds it: the study, the storage it writes through, and its id
    there."""

    study: optuna.Study
    storage: optuna.storages.BaseStorage
    study_id: int


def open_study(
    cfg: SearchConfig,
    distributions: dict[str, Any],
    create: bool,
    group_index: int = 0,
    start: int = 0,
) -> optuna.Study:
    return open_search_study(cfg, distributions, create, group_index, start).study


def open_search_study(
    cfg: SearchConfig,
    distributions: dict[str, Any],
    create: bool,
    group_index: int = 0,
    start: int = 0,
    search_id: str = "",
) -> SearchStudy:
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # ddpkit prints its own progress
    try:
        if cfg.storage is None:
            check_journal(Path(cfg.search_dir) / JOURNAL)
        storage = open_storage(cfg)
        sampler = new_sampler(cfg, distributions, group_index, start, search_id)
        if create:
            study = optuna.create_study(
                study_name=cfg.study_name,
                storage=storage,
                sampler=sampler,
                pruner=new_pruner(cfg),
                direction=cfg.direction,
                load_if_exists=True,
            )
        else:
            study = optuna.load_study(
                study_name=cfg.study_name, storage=storage, sampler=sampler, pruner=new_pruner(cfg)
            )
        return SearchStudy(study, storage, storage.get_study_id_from_name(cfg.study_name))
    except ConfigError:
        raise
    # sqlalchemy's OperationalError, a bad URL's ArgumentError, a locked journal...
    except Exception as err:
        if cfg.storage is None:
            raise ConfigError(
                f"cannot open the study {cfg.study_name!r} in its journal "
                f"{Path(cfg.search_dir) / JOURNAL}: {type(err).__name__}: "
                f"{str(err).splitlines()[0] if str(err) else ''}"
            ) from None
        raise ConfigError(
            f"cannot open the study {cfg.study_name!r} in storage {cfg.storage or cfg.search_dir}: "
            f"{type(err).__name__}: {str(err).splitlines()[0]}. Check the storage URL and that its "
            "database server is running and reachable, or leave storage unset (a journal file in "
            "search_dir)"
        ) from None


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    # Groups count trials and ask under this lock: two groups racing for the last candidate of the
    # budget would otherwise both see room for one more.
    fd, _ = take_lock(path, wait=True)
    try:
        yield
    finally:
        os.close(fd)  # drops the flock


def read_search_id(cfg: SearchConfig) -> str:
    # Trials of this search carry its id, so a study shared with other searches (an RDB URL) is
    # counted and resumed for ours only. It lives in search_dir, so a restarted job is the same
    # search.
    path = Path(cfg.search_dir) / "search_id"
    if not path.exists():
        fs.write_atomic(path, f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}\n".encode())
    return fs.read_bytes(path).decode().strip()


def trials_of(
    study: optuna.Study, search_id: str, states: tuple[TrialState, ...] | None = None
) -> list[Any]:
    return [
        t
        for t in study.get_trials(deepcopy=False, states=states)
        if t.user_attrs.get(_SEARCH_KEY) == search_id
    ]


def count_start(study: optuna.Study) -> int:
    """This start's number (0 for the first start of a search on this study); counts it in the
    study."""
    start = int(study.user_attrs.get(_STARTS_KEY, 0))
    study.set_user_attr(_STARTS_KEY, start + 1)
    return start


@dataclass(frozen=True)
class Start:
    """What world rank 0 found in search_dir and the study, for every rank."""

    search_id: str
    start: int
    """How many times a search was started on this study before this one: seeds the samplers."""
    leftover: list[int]
    """Numbers of this search's trials a stopped job left running."""


def begin_search(cfg: SearchConfig, distributions: dict[str, Any]) -> tuple[SearchDirLock, Start]:
    """On world rank 0: take search_dir for this job, repair or refuse what is wrong in it, count
    this start."""
    search_dir = Path(cfg.search_dir)
    lock = SearchDirLock(search_dir)
    lock.acquire()
    try:
        if cfg.storage is None:
            note = repair_journal(search_dir / JOURNAL)
            if note:
                print(note, flush=True)
        study = open_study(cfg, distributions, create=True)
        search_id = read_search_id(cfg)
        ours = trials_of(study, search_id)
        check_trial_dirs(search_dir, {t.number for t in ours}, describe_storage(cfg))
        leftover = [t.number for t in ours if t.state == TrialState.RUNNING]
        return lock, Start(search_id, count_start(study), leftover)
    except BaseException:
        lock.release()
        raise


def next_trial(
    handle: SearchStudy,
    cfg: SearchConfig,
    distributions: dict[str, Any],
    search_id: str,
    leftover: list[int],
    search_dir: Path,
) -> optuna.Trial | None:
    """The next candidate's trial for this group, or None when the budget is spent."""
    while leftover:
        trial = resumed_trial(handle, leftover.pop(0), distributions)
        if trial is not None:
            return trial
    with file_lock(search_dir / ".ask.lock"):
        if len(trials_of(handle.study, search_id)) >= cfg.n_trials:
            return None
        trial = created_trial(handle, search_id)
        draw_params(trial, distributions)
    return trial


def created_trial(handle: SearchStudy, search_id: str) -> optuna.Trial:
    """A new running trial of this search, created with its tag in one write to the storage.

    ``study.ask()`` creates the trial and the tag would follow in a second write: a kill between the
    two left a running trial of nobody's search, never resumed nor counted. (``enqueue_trial``
    writes the tag with a waiting trial, but the ``ask`` that starts it takes the oldest waiting
    trial of the study, which may be another search's.) Hence the storage's own ``create_new_trial``
    from a template, and the trial built on its id.
    """
    template = optuna.trial.create_trial(
        state=TrialState.RUNNING, user_attrs={_SEARCH_KEY: search_id}
    )
    trial_id = handle.storage.create_new_trial(handle.study_id, template_trial=template)
    return optuna.Trial(handle.study, trial_id)


def resumed_trial(
    handle: SearchStudy, number: int, distributions: dict[str, Any]
) -> optuna.Trial | None:
    frozen = next(t for t in handle.study.get_trials(deepcopy=False) if t.number == number)
    if frozen.state != TrialState.RUNNING:
        return None
    # Optuna has no handle on an existing trial but its Trial, built from the storage's id of the
    # trial.
    trial = optuna.Trial(
        handle.study,
        handle.storage.get_trial_id_from_study_id_trial_number(handle.study_id, number),
    )
    # a trial killed while its parameters were drawn gets the rest now
    draw_params(trial, distributions)
    return trial


def draw_params(trial: optuna.Trial, distributions: dict[str, Any]) -> None:
    """Suggest every parameter of the space (as ``study.ask(distributions)`` does); one drawn before
    is kept."""
    for name, d in distributions.items():
        if isinstance(d, optuna.distributions.FloatDistribution):
            trial.suggest_float(name, d.low, d.high, step=d.step, log=d.log)
        elif isinstance(d, optuna.distributions.IntDistribution):
            trial.suggest_int(name, d.low, d.high, step=d.step, log=d.log)
        else:
            trial.suggest_categorical(name, d.choices)
