"""The search's side of the Optuna study and of ``search_dir``: the study, its samplers and
pruners, this search's trials, and the checks of what ``search_dir`` holds
(docs/hyperparameter-search.md)."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, cast

import numpy as np
import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.samplers import BaseSampler, RandomSampler
from optuna.search_space import IntersectionSearchSpace
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.study import Study, StudyDirection
from optuna.trial import FrozenTrial, TrialState

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._fs.lock import FolderLock
from ddpkit._fs.lock import take as take_lock
from ddpkit._internals.optuna_journal import (
    STEP_LIMIT,
    ReplayWork,
    journal_operations,
    memory_journal,
)
from ddpkit.distributed._seeding import mix_seed
from ddpkit.search._config import SearchConfig

JOURNAL = "study.journal"
JOURNAL_LIMIT = 1 << 30  # Optuna reads a journal whole and replays it at each open
# the most replay work (ReplayWork) a record may cost, above a floor
_REPLAY_PER_RECORD = 1024
_REPLAY_FLOOR = 1 << 24
_SEARCH_KEY = "ddpkit_search"  # a trial's user attribute: the search it belongs to
_STARTS_KEY = "ddpkit_starts"  # a study's user attribute: how many times a search was started on it
_TRIAL_DIR = re.compile(r"trial-(\d+)")


# -- search_dir ------------------------------------------------------------------------------------


def trial_dir(search_dir: Path, number: int) -> Path:
    return search_dir / f"trial-{number:04d}"


def search_dir_lock(search_dir: Path) -> FolderLock:
    """An exclusive advisory lock on ``search_dir/.lock`` naming its holder."""
    return FolderLock(
        search_dir,
        what="search_dir",
        job="search job",
        user="search",
        hazard="a second job would take that job's live trials for trials a dead job left running",
    )


def describe_storage(config: Any) -> str:
    """Where the study lives, for messages."""
    where = config.storage or str(Path(config.search_dir) / JOURNAL)
    return f"study {config.study_name!r} ({where})"


def repair_journal(path: Path) -> str | None:
    """Make Optuna's journal readable again after a write was cut short (the bytes after the last
    newline move to a file beside it); say what was done, or None. Call it only under
    :func:`search_dir_lock`. A damaged line before the last is a :class:`ConfigError` naming it."""
    # Optuna appends through an open() that follows links, to a file that must have one name
    fs.check_owned(path, "the study's journal", follow=False)
    fs.unshare(path)
    if not path.is_file():
        return None
    refuse_large_journal(path, path.stat().st_size)
    data = fs.read_bytes(path)
    whole, _, tail = data.rpartition(b"\n")
    lines = whole.split(b"\n") if whole else []
    for number, line in enumerate(lines, start=1):
        if not _is_record(line):
            what = "not a whole record; a write cut short, then others appended to it"
            _refuse_damaged(path, len(lines) + bool(tail), number, what)
    lock = path.with_name(path.name + ".lock")
    if os.path.lexists(lock):
        # Optuna's lock left by a killed writer: under the search_dir lock no writer is alive
        fs.remove(lock)
    if not tail:
        return None
    if _is_record(tail):
        # written whole but for its newline, which Optuna needs to read the record
        with fs.open_append(path) as f:
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        return (
            f"ddpkit search: {path} ended without its last newline; the whole record before it "
            "is kept"
        )
    aside = path.with_name(f"{path.name}.cut-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    # first the copy, then the cut: a crash between them loses nothing
    with fs.open_exclusive(aside) as f:
        f.write(tail)
        f.flush()
        os.fsync(f.fileno())
    fs.truncate(path, len(data) - len(tail))
    return (
        f"ddpkit search: {path} ended in a record cut short (a kill or a full disk while it was "
        f"written); its {len(tail)} bytes were moved to {aside.name}, the {len(lines)} whole "
        "records before it are kept"
    )


def refuse_large_journal(path: Path, size: int) -> None:
    if size > JOURNAL_LIMIT:
        raise ConfigError(
            f"the study's journal {path} holds {size} bytes, more than the {JOURNAL_LIMIT} a "
            "search reads: continue the search in another search_dir, or give it an RDB storage "
            "(SearchConfig.storage)"
        )


def _is_record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except (ValueError, RecursionError):
        return False


def _refuse_damaged(path: Path, total: int, number: int, what: str) -> NoReturn:
    kept = number - 1
    raise ConfigError(
        f"the study's journal {path} is damaged at line {number} of {total}: {what}, and Optuna "
        "cannot read past it. Put the line back as it was if it was edited, or keep the "
        f"{kept} whole records before it (`head -n {kept} {path} > {path}.kept && mv {path} "
        f"{path}.damaged && mv {path}.kept {path}`: the trials recorded after them are dropped, "
        "and their trial-NNNN folders must be moved away too), or start the search afresh in "
        "another search_dir"
    )


def check_trial_dirs(search_dir: Path, owned: set[int], study: str) -> None:
    """Refuse ``trial-NNNN`` folders with content whose trial is not one of ``owned``."""
    strangers = []
    for path in sorted(search_dir.glob("trial-*")):
        match = _TRIAL_DIR.fullmatch(path.name)
        if match:
            fs.refuse_link(path)  # a trial's run directory is made here, never through a link
        if match and int(match.group(1)) not in owned and path.is_dir() and any(path.iterdir()):
            strangers.append(path.name)
    if strangers:
        listed = ", ".join(strangers[:6]) + (
            f" and {len(strangers) - 6} more" if len(strangers) > 6 else ""
        )
        raise ConfigError(
            f"search_dir {str(search_dir)!r} holds trial folders that no trial of this search in "
            f"{study} owns: {listed}. They are another search's (its journal was emptied or "
            "removed, or study_name changed), and a new trial of the same number would resume "
            "that one's snapshots instead of training. Give this search another search_dir, or "
            "move those folders out of this one (or delete them)"
        )


def check_journal(path: Path) -> None:
    """Refuse a journal Optuna would fail to read (a bad record, more replay work than its budget,
    a record Optuna fails to replay), naming the file, the line and what is wrong."""
    try:
        fd = fs.open_fd(path, os.O_RDONLY | os.O_CLOEXEC)  # a regular file, never through a link
    except FileNotFoundError:
        return
    with os.fdopen(fd, "rb") as f:
        refuse_large_journal(path, os.fstat(fd).st_size)
        data = f.read()
    lines = data.split(b"\n")[:-1]  # whole lines only
    refuse = functools.partial(_refuse_damaged, path, len(lines))
    replay = memory_journal(_journal_records(path, lines, refuse))
    try:
        JournalStorage(replay)
    except Exception as err:  # noqa: BLE001 - KeyError, TypeError, AssertionError: a bad record
        refuse(replay.handed, f"Optuna cannot replay it ({type(err).__name__}: {str(err)[:200]})")


def _journal_records(
    path: Path, lines: list[bytes], refuse: Callable[[int, str], NoReturn]
) -> list[dict[str, Any]]:
    """Each line as a record Optuna can read, within the replay's budget; ``refuse`` otherwise."""
    operations = journal_operations()
    records = []
    work, budget = ReplayWork(), _REPLAY_PER_RECORD * len(lines) + _REPLAY_FLOOR
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
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
    return records


def _step(value: Any) -> bool:
    """A step of an intermediate value (a record's int, or a create_trial's key: its string)."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 20:
        value = int(value)
    return type(value) is int and 0 <= value < STEP_LIMIT


# -- the study -------------------------------------------------------------------------------------


def new_sampler(
    cfg: SearchConfig,
    distributions: dict[str, Any],
    group_index: int = 0,
    start: int = 0,
    search_id: str = "",
) -> optuna.samplers.BaseSampler:
    """The sampler of one group at one start of the search, seeded apart by group and start (and,
    on a shared database, by the search's own id)."""
    shared = (search_id,) if cfg.storage is not None else ()
    seed = mix_seed(cfg.seed, "sampler", start, group_index, *shared)
    samplers: dict[str, Callable[..., BaseSampler]] = {
        "tpe": optuna.samplers.TPESampler,
        "evolution": EvolutionSampler,
        "nsga2": optuna.samplers.NSGAIISampler,
        "cmaes": optuna.samplers.CmaEsSampler,
    }
    if cfg.sampler in samplers:
        return samplers[cfg.sampler](seed=seed, **cfg.sampler_options)
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


@dataclass(frozen=True)
class SearchStudy:
    """A study as a group's rank 0 holds it: the study, its storage, and its id there."""

    study: optuna.Study
    storage: optuna.storages.BaseStorage
    study_id: int


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
        backend: optuna.storages.BaseStorage
        if cfg.storage is None:
            check_journal(Path(cfg.search_dir) / JOURNAL)
            backend = JournalStorage(JournalFileBackend(str(Path(cfg.search_dir) / JOURNAL)))
        else:
            backend = optuna.storages.RDBStorage(cfg.storage, engine_kwargs={"pool_pre_ping": True})
        # what the study writes through (Optuna's cache before an RDB): created_trial writes there
        storage = optuna.storages.get_storage(backend)
        sampler = new_sampler(cfg, distributions, group_index, start, search_id)
        if create:
            optuna.create_study(
                study_name=cfg.study_name,
                storage=storage,
                direction=cfg.direction,
                load_if_exists=True,
            )
        study = optuna.load_study(
            study_name=cfg.study_name, storage=storage, sampler=sampler, pruner=new_pruner(cfg)
        )
        return SearchStudy(study, storage, storage.get_study_id_from_name(cfg.study_name))
    except ConfigError:
        raise
    except Exception as err:  # sqlalchemy's OperationalError, a bad URL, a locked journal...
        said = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if cfg.storage is None:
            raise ConfigError(
                f"cannot open the study {cfg.study_name!r} in its journal "
                f"{Path(cfg.search_dir) / JOURNAL}: {said}"
            ) from None
        raise ConfigError(
            f"cannot open the study {cfg.study_name!r} in storage {cfg.storage}: {said}. Check "
            "the storage URL and that its database server is running and reachable, or leave "
            "storage unset (a journal file in search_dir)"
        ) from None


def read_search_id(cfg: SearchConfig) -> str:
    """This search's id, kept in search_dir: a restarted job is the same search."""
    path = Path(cfg.search_dir) / "search_id"
    if not path.exists():
        fs.write_atomic(path, f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}\n".encode())
    return fs.read_bytes(path).decode().strip()


def trials_of(study: optuna.Study, search_id: str) -> list[Any]:
    trials = study.get_trials(deepcopy=False)
    return [t for t in trials if t.user_attrs.get(_SEARCH_KEY) == search_id]


def count_start(study: optuna.Study) -> int:
    """This start's number (0 for the first on this study); counts it in the study."""
    start = int(study.user_attrs.get(_STARTS_KEY, 0))
    study.set_user_attr(_STARTS_KEY, start + 1)
    return start


@dataclass(frozen=True)
class Start:
    """What world rank 0 found, for every rank: the search's id, the starts before this one on the
    study (they seed the samplers), and this search's trials a stopped job left running."""

    search_id: str
    start: int
    leftover: list[int]


def begin_search(cfg: SearchConfig, distributions: dict[str, Any]) -> tuple[FolderLock, Start]:
    """On world rank 0: take search_dir, repair or refuse what is wrong in it, count this start."""
    search_dir = Path(cfg.search_dir)
    lock = search_dir_lock(search_dir)
    lock.acquire()
    try:
        if cfg.storage is None:
            note = repair_journal(search_dir / JOURNAL)
            if note:
                print(note, flush=True)
        study = open_search_study(cfg, distributions, create=True).study
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
) -> optuna.Trial | None:
    """The next candidate's trial for this group, or None when the budget is spent."""
    while leftover:
        trial = resumed_trial(handle, leftover.pop(0), distributions)
        if trial is not None:
            return trial
    # held while the group counts and asks: groups racing for the last candidate cannot both start
    fd, _ = take_lock(Path(cfg.search_dir) / ".ask.lock", wait=True)
    try:
        if len(trials_of(handle.study, search_id)) >= cfg.n_trials:
            return None
        trial = created_trial(handle, search_id)
        draw_params(trial, distributions)
    finally:
        os.close(fd)
    return trial


def created_trial(handle: SearchStudy, search_id: str) -> optuna.Trial:
    """A new running trial of this search, created with its tag in one write to the storage."""
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
    trial = optuna.Trial(
        handle.study,
        handle.storage.get_trial_id_from_study_id_trial_number(handle.study_id, number),
    )
    draw_params(trial, distributions)  # a trial killed while its parameters were drawn
    return trial


def draw_params(trial: optuna.Trial, distributions: dict[str, Any]) -> None:
    """Suggest every parameter of the space (as ``study.ask(distributions)``); one drawn is kept."""
    for name, d in distributions.items():
        if isinstance(d, optuna.distributions.FloatDistribution):
            trial.suggest_float(name, d.low, d.high, step=d.step, log=d.log)
        elif isinstance(d, optuna.distributions.IntDistribution):
            trial.suggest_int(name, d.low, d.high, step=d.step, log=d.log)
        else:
            trial.suggest_categorical(name, d.choices)


class EvolutionSampler(BaseSampler):
    """Propulate's asynchronous evolution: a candidate is random with probability ``random_share``,
    else bred from two parents chosen by tournaments among the ``top`` finished, each parameter
    taken from either and mutated with probability ``mutation_prob`` (a Gaussian step of
    ``mutation_scale`` of its range, in log space for log distributions; choices drawn anew)."""

    def __init__(
        self,
        *,
        top: int = 8,
        random_share: float = 0.2,
        mutation_prob: float = 0.3,
        mutation_scale: float = 0.1,
        min_finished: int = 4,
        seed: int | None = None,
    ) -> None:
        self.top, self.random_share, self.min_finished = top, random_share, min_finished
        self.mutation_prob, self.mutation_scale = mutation_prob, mutation_scale
        self._rng = np.random.default_rng(seed)
        self._random = RandomSampler(seed=seed)
        self._space = IntersectionSearchSpace()

    def infer_relative_search_space(
        self, study: Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return self._space.calculate(study)

    def sample_relative(
        self, study: Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        finished = [
            t
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None
        ]
        if (
            not search_space
            or len(finished) < self.min_finished
            or self._rng.random() < self.random_share
        ):
            return {}  # drawn at random by sample_independent
        reverse = study.direction == StudyDirection.MAXIMIZE
        best = sorted(finished, key=lambda t: cast(float, t.value), reverse=reverse)[: self.top]
        mother, father = self._tournament(best), self._tournament(best)
        child = {}
        for name, dist in search_space.items():
            parent = mother if self._rng.random() < 0.5 else father
            value = parent.params.get(name)
            if value is None:
                continue
            child[name] = (
                self._mutate(value, dist) if self._rng.random() < self.mutation_prob else value
            )
        return child

    def _tournament(self, ranked: Sequence[FrozenTrial]) -> FrozenTrial:
        # ranked is best first: the lower index of two draws wins.
        return ranked[int(min(self._rng.integers(len(ranked), size=2)))]

    def _mutate(self, value: Any, dist: BaseDistribution) -> Any:
        if isinstance(dist, CategoricalDistribution):
            return dist.choices[int(self._rng.integers(len(dist.choices)))]
        assert isinstance(dist, (FloatDistribution, IntDistribution))
        to, back = (math.log, math.exp) if dist.log else (float, float)
        lo, hi = to(dist.low), to(dist.high)
        x = min(max(to(value) + self._rng.normal(0.0, self.mutation_scale * (hi - lo)), lo), hi)
        x = back(x)
        if dist.step is not None:
            x = dist.low + round((x - dist.low) / dist.step) * dist.step
        x = min(max(x, dist.low), dist.high)
        return int(round(x)) if isinstance(dist, IntDistribution) else x

    def sample_independent(
        self,
        study: Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        return self._random.sample_independent(study, trial, param_name, param_distribution)
