"""The search loop: every group of ranks trains one candidate at a time until the budget is spent.

Roles. The job is split once into groups of ``group_size`` ranks (:func:`ddpkit.split_world`). Rank 0 of each
group talks to the study (Optuna): it asks for a candidate, reports intermediate values, asks whether to prune
and tells the result. Everything the group's ranks must agree on (the parameters, each prune decision, the
outcome) reaches them by a broadcast on the group, so the ranks of a candidate never disagree. Groups never
wait for each other until the budget is spent.

Budget. A candidate is started only while the study holds fewer than ``n_trials`` trials of this search; the
count and the ask happen under a file lock in ``search_dir``, so groups racing for the last candidate cannot
both start one.

Crashes. Each candidate trains in its own run directory (``search_dir/trial-NNNN``). When the launcher
restarts the job after a rank died, the trials the dead job left running are handed to the groups again and
resume from their own snapshots; completed trials are kept. A trial is created with its search's tag in one
write to the study, so a kill while its parameters are drawn leaves a trial of this search, resumed like any
other (its missing parameters drawn then). Each start of the search seeds its samplers apart (a start counter
in the study), so a restart draws new candidates, and replaying the same starts replays the same draws.

One job per search_dir (see :mod:`ddpkit.search.search_dir`), and an error of the machine (a full disk, a
read-only file system) stops the search with that error: the trial is left running, to resume when the search
is started again, not failed and counted against the budget.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import optuna
import torch.distributed as dist
from optuna.trial import TrialState

from ddpkit import callbacks
from ddpkit.collectives import broadcast_object, gather_object, print0
from ddpkit.errors import ConfigError
from ddpkit.groups import split_world
from ddpkit.runtime import Runtime, get_runtime
from ddpkit.search.environment import environment_error
from ddpkit.search.report import write_results
from ddpkit.search.search_dir import (
    JOURNAL,
    SearchDirLock,
    check_trial_dirs,
    describe_storage,
    repair_journal,
    trial_dir,
)
from ddpkit.search.space import to_distributions
from ddpkit.seeding import mix_seed

SAMPLERS = ("tpe", "evolution", "nsga2", "cmaes", "random", "grid")
PRUNERS = ("median", "halving", "hyperband", "none")
_SEARCH_KEY = "ddpkit_search"  # a trial's user attribute: which search (run of this job) it belongs to
_STARTS_KEY = "ddpkit_starts"  # a study's user attribute: how many times a search was started on it


@dataclass(kw_only=True)
class SearchConfig:
    """What to search for, how, and for how long."""

    n_trials: int
    """Budget: finished trials (complete, pruned or failed) the search ends with."""
    group_size: int = 1
    """Ranks per candidate; the job's world size must divide by it."""
    metric: str = "val/loss"
    """The validation metric a Trainer reports each epoch (pruning) and the objective's result, if the objective
    returns the Trainer's metrics dict."""
    direction: str = "minimize"
    sampler: str = "tpe"
    """``tpe`` (default), ``evolution`` (Propulate's asynchronous evolution), ``nsga2``, ``cmaes``, ``random``,
    ``grid`` (choices only)."""
    pruner: str = "median"
    """``median``, ``halving`` (successive halving), ``hyperband``, or ``none``."""
    search_dir: str = "runs/search"
    """Trials' run directories, the study's journal file (default storage), trials.csv and plots."""
    storage: str | None = None
    """An RDB URL (``sqlite:///path.db``, ``postgresql://...``) to share a study between jobs; default: a journal
    file in ``search_dir`` (nothing to start)."""
    study_name: str = "ddpkit"
    seed: int = 0
    """Seeds the sampler: the same seed and the same order of results give the same candidates."""
    plots: bool = True
    """Save Optuna's matplotlib plots (needs matplotlib)."""
    sampler_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        checks = {
            "n_trials": self.n_trials >= 1,
            "group_size": self.group_size >= 1,
            "direction": self.direction in ("minimize", "maximize"),
            "sampler": self.sampler in SAMPLERS,
            "pruner": self.pruner in PRUNERS,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not valid: see SearchConfig.{name}")


class Candidate:
    """One trial as its group's ranks see it: the parameters, where to write, and how to report."""

    def __init__(self, number: int, params: dict[str, Any], runtime: Runtime, run_dir: Path,
                 trial: optuna.Trial | None, metric: str) -> None:
        self.number, self.params, self.runtime, self.run_dir = number, params, runtime, run_dir
        self.group = runtime.group
        self.metric = metric
        self.reported: dict[int, float] = {}
        self._trial = trial  # on the group's rank 0 only

    def report(self, value: float, step: int) -> None:
        """Report an intermediate value; raises ``optuna.TrialPruned`` on every rank of the group if the
        pruner stops this candidate. Collective on the group."""
        prune = False
        if self._trial is not None:
            self._trial.report(float(value), step)
            prune = self._trial.should_prune()
        self.reported[step] = float(value)
        if broadcast_object(prune, group=self.group):
            raise optuna.TrialPruned(f"pruned at step {step} ({self.metric} {value:.4g})")

    # The Trainer calls this after each epoch: pruning works without user code.
    def on_epoch_end(self, trainer: Any, metrics: Mapping[str, float]) -> None:
        if self.metric not in metrics:
            raise ConfigError(
                f"SearchConfig.metric={self.metric!r} is not among the Trainer's epoch metrics {sorted(metrics)}: "
                "give the Trainer val_data, or set metric to one of these"
            )
        self.report(metrics[self.metric], int(metrics["epoch"]))


def _sampler(cfg: SearchConfig, distributions: dict[str, Any], group_index: int = 0,
             start: int = 0) -> optuna.samplers.BaseSampler:
    # Each group's sampler draws its own random numbers: with one seed everywhere, groups asking at the same
    # time would draw the same "random" candidates. Each start of the search too: the samplers' random state
    # is not in the study, so a restarted job (or a rerun with a larger budget) seeded as the first start was
    # would draw the first start's candidates again. `start` is counted in the study, so the same starts
    # replayed draw the same candidates.
    seed = mix_seed(cfg.seed, "sampler", start, group_index)
    opts = dict(cfg.sampler_options)
    if cfg.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, **opts)
    if cfg.sampler == "evolution":
        from ddpkit.search.evolution import EvolutionSampler

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
            raise ConfigError(f"sampler='grid' needs choices only; {name!r} is {dist}: give it as choice([...])")
        grid[name] = list(dist.choices)
    return optuna.samplers.GridSampler(grid, seed=seed)


def _pruner(cfg: SearchConfig) -> optuna.pruners.BasePruner:
    return {
        "median": lambda: optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=2),
        "halving": optuna.pruners.SuccessiveHalvingPruner,
        "hyperband": optuna.pruners.HyperbandPruner,
        "none": optuna.pruners.NopPruner,
    }[cfg.pruner]()


def _storage(cfg: SearchConfig) -> Any:
    if cfg.storage is None:
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(str(Path(cfg.search_dir) / JOURNAL)))
    return optuna.storages.RDBStorage(cfg.storage, engine_kwargs={"pool_pre_ping": True})


def _open_study(cfg: SearchConfig, distributions: dict[str, Any], create: bool, group_index: int = 0,
                start: int = 0) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # ddpkit prints its own progress
    try:
        storage = _storage(cfg)
        sampler = _sampler(cfg, distributions, group_index, start)
        if create:
            return optuna.create_study(study_name=cfg.study_name, storage=storage, sampler=sampler,
                                       pruner=_pruner(cfg), direction=cfg.direction, load_if_exists=True)
        return optuna.load_study(study_name=cfg.study_name, storage=storage, sampler=sampler, pruner=_pruner(cfg))
    except ConfigError:
        raise
    except Exception as err:  # sqlalchemy's OperationalError, a bad URL's ArgumentError, a locked journal...
        raise ConfigError(
            f"cannot open the study {cfg.study_name!r} in storage {cfg.storage or cfg.search_dir}: "
            f"{type(err).__name__}: {str(err).splitlines()[0]}. Check the storage URL and that its database "
            "server is running and reachable, or leave storage unset (a journal file in search_dir)"
        ) from None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    # Groups count trials and ask under this lock: two groups racing for the last candidate of the budget
    # would otherwise both see room for one more.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _search_id(cfg: SearchConfig) -> str:
    # Trials of this search carry its id, so a study shared with other searches (an RDB URL) is counted and
    # resumed for ours only. It lives in search_dir, so a restarted job is the same search.
    path = Path(cfg.search_dir) / "search_id"
    if not path.exists():
        tmp = path.with_name(f".search_id.{os.getpid()}")
        tmp.write_text(f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}\n")
        os.replace(tmp, path)
    return path.read_text().strip()


def _ours(study: optuna.Study, search_id: str, states: tuple[TrialState, ...] | None = None) -> list[Any]:
    return [t for t in study.get_trials(deepcopy=False, states=states) if t.user_attrs.get(_SEARCH_KEY) == search_id]


def _count_start(study: optuna.Study) -> int:
    """This start's number (0 for the first start of a search on this study); counts it in the study."""
    start = int(study.user_attrs.get(_STARTS_KEY, 0))
    study.set_user_attr(_STARTS_KEY, start + 1)
    return start


@dataclass(frozen=True)
class _Start:
    """What world rank 0 found in search_dir and the study, for every rank."""

    search_id: str
    start: int
    """How many times a search was started on this study before this one: seeds the samplers."""
    leftover: list[int]
    """Numbers of this search's trials a stopped job left running."""


def _begin(cfg: SearchConfig, distributions: dict[str, Any]) -> tuple[SearchDirLock, _Start]:
    """On world rank 0: take search_dir for this job, repair or refuse what is wrong in it, count this start."""
    search_dir = Path(cfg.search_dir)
    lock = SearchDirLock(search_dir)
    lock.acquire()
    try:
        if cfg.storage is None:
            note = repair_journal(search_dir / JOURNAL)
            if note:
                print(note, flush=True)
        study = _open_study(cfg, distributions, create=True)
        search_id = _search_id(cfg)
        ours = _ours(study, search_id)
        check_trial_dirs(search_dir, {t.number for t in ours}, describe_storage(cfg))
        leftover = [t.number for t in ours if t.state == TrialState.RUNNING]
        return lock, _Start(search_id, _count_start(study), leftover)
    except BaseException:
        lock.release()
        raise


def search(
    objective: Callable[[Candidate], float | Mapping[str, float]],
    space: Mapping[str, Any],
    config: SearchConfig,
) -> optuna.Study:
    """Run the search on every rank of the job; return the study (on every rank).

    ``objective(candidate)`` builds and trains one candidate on ``candidate.group`` with
    ``candidate.params`` (with the Trainer: ``Trainer(..., group=candidate.group)``, its run_dir
    ``candidate.run_dir``) and returns the metric, or the Trainer's metrics dict holding ``config.metric``.
    A Trainer built inside the objective reports ``config.metric`` to the candidate after each epoch, so the
    pruner can stop it. A candidate that diverges, raises or runs out of memory fails its trial only; the
    group goes on to the next. An error of the machine (a full disk, a read-only file system: see
    :mod:`ddpkit.search.environment`) stops the search with that error and leaves the trial to resume when the
    search is started again. One job at a time per ``search_dir``; a second is refused, naming the first.
    """
    distributions = to_distributions(space)
    rt = get_runtime()
    if rt.world_size % config.group_size:
        raise ConfigError(
            f"SearchConfig.group_size={config.group_size} does not divide the job's {rt.world_size} ranks: pick a "
            f"divisor of {rt.world_size}, or launch a multiple of {config.group_size} processes"
        )
    Path(config.search_dir).mkdir(parents=True, exist_ok=True)
    # One rank takes search_dir and creates the study before the others open it; a refusal or an unreachable
    # storage is an error on every rank rather than a hang on those waiting.
    lock, error, begun = None, None, None
    if rt.is_main:
        try:
            lock, begun = _begin(config, distributions)
        except ConfigError as err:
            error = str(err)
    error, begun = broadcast_object((error, begun))
    if error:
        raise ConfigError(error)
    try:
        _search_on_groups(objective, distributions, config, begun)
        if rt.is_main:
            final = _open_study(config, distributions, create=False)
            write_results(final, _ours(final, begun.search_id), config)
    finally:
        if lock is not None:
            lock.release()
    return _open_study(config, distributions, create=False)


def _search_on_groups(objective, distributions: dict[str, Any], cfg: SearchConfig, begun: _Start) -> None:
    """Every group trains candidates until the budget is spent; returns once every group is done."""
    rt = get_runtime()
    grt = split_world(cfg.group_size)
    # A study per process: the storage is shared, the samplers' random state is not.
    study = (_open_study(cfg, distributions, create=False, group_index=grt.group_index, start=begun.start)
             if grt.is_main else None)
    # The trials a killed job left running, shared out among the groups before any group asks for new ones.
    n_groups = rt.world_size // cfg.group_size
    mine = begun.leftover[grt.group_index :: n_groups]
    if begun.leftover:
        print0(f"ddpkit search: resuming {len(begun.leftover)} trial(s) a stopped job left running: {begun.leftover}")
    search_dir = Path(cfg.search_dir)
    while True:
        trial = _next_trial(study, cfg, distributions, begun.search_id, mine, search_dir) if grt.is_main else None
        payload = broadcast_object(None if trial is None else (trial.number, trial.params), group=grt.group)
        if payload is None:
            break
        number, params = payload
        candidate = Candidate(number, params, grt, trial_dir(search_dir, number), trial, cfg.metric)
        state, value, error = _run_candidate(objective, candidate, cfg)
        if grt.is_main:
            if error:
                trial.set_user_attr("error", error[-2000:])
            study.tell(number, value if state == TrialState.COMPLETE else None, state=state)
            _progress(study, cfg, begun.search_id, candidate, state, value, error)
    _wait_for_every_group()


def _next_trial(study, cfg, distributions, search_id, leftover: list[int], search_dir: Path) -> optuna.Trial | None:
    """The next candidate's trial for this group, or None when the budget is spent."""
    while leftover:
        trial = _resumed_trial(study, leftover.pop(0), distributions)
        if trial is not None:
            return trial
    with _locked(search_dir / ".ask.lock"):
        if len(_ours(study, search_id)) >= cfg.n_trials:
            return None
        trial = _created_trial(study, search_id)
        _draw(trial, distributions)
    return trial


def _created_trial(study: optuna.Study, search_id: str) -> optuna.Trial:
    """A new running trial of this search, created with its tag in one write to the storage.

    ``study.ask()`` creates the trial and the tag would follow in a second write: a kill between the two left a
    running trial of nobody's search, never resumed nor counted. Optuna has no public call that creates a
    trial from a template and returns it, hence its storage's own ``create_new_trial``.
    """
    template = optuna.trial.create_trial(state=TrialState.RUNNING, user_attrs={_SEARCH_KEY: search_id})
    trial_id = study._storage.create_new_trial(study._study_id, template_trial=template)
    return optuna.Trial(study, trial_id)


def _resumed_trial(study: optuna.Study, number: int, distributions: dict[str, Any]) -> optuna.Trial | None:
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
    if frozen.state != TrialState.RUNNING:
        return None
    # Optuna has no public handle on an existing trial; its Trial is built from the storage's id.
    trial = optuna.Trial(study, frozen._trial_id)
    _draw(trial, distributions)  # a trial killed while its parameters were drawn gets the rest now
    return trial


def _draw(trial: optuna.Trial, distributions: dict[str, Any]) -> None:
    """Suggest every parameter of the space (as ``study.ask(distributions)`` does); one drawn before is kept."""
    for name, d in distributions.items():
        if isinstance(d, optuna.distributions.FloatDistribution):
            trial.suggest_float(name, d.low, d.high, step=d.step, log=d.log)
        elif isinstance(d, optuna.distributions.IntDistribution):
            trial.suggest_int(name, d.low, d.high, step=d.step, log=d.log)
        else:
            trial.suggest_categorical(name, d.choices)


def _run_candidate(objective, candidate: Candidate, cfg: SearchConfig) -> tuple[TrialState, float | None, str | None]:
    """Train one candidate; the group agrees on how it ended (every rank learns every other's outcome)."""
    state, value, error = TrialState.COMPLETE, None, None
    try:
        with callbacks.ambient(candidate):
            result = objective(candidate)
        value = float(result[cfg.metric] if isinstance(result, Mapping) else result)
    except optuna.TrialPruned:
        state = TrialState.PRUNED
    except BaseException as err:
        machine = environment_error(err)
        if machine is not None:
            _stop_for_machine(candidate, machine, err)
            raise
        if not isinstance(err, Exception):  # KeyboardInterrupt, SystemExit (Preempted): not the candidate's
            raise
        # A failed candidate fails its trial, not the search.
        state, error = TrialState.FAIL, "".join(traceback.format_exception_only(type(err), err)).strip()
        if "out of memory" in error.lower():
            error = f"out of memory: {error}"
        _free_accelerator_memory()
    outcomes = gather_object((state.name, value, error), group=candidate.group)
    errors = [e for _, _, e in outcomes if e]
    if errors:
        return TrialState.FAIL, None, errors[0]
    if any(s == TrialState.PRUNED.name for s, _, _ in outcomes):
        return TrialState.PRUNED, None, None
    if value is None or value != value:  # NaN: a diverged candidate that did not raise
        return TrialState.FAIL, None, f"the objective returned {value!r}"
    return state, value, None


def _stop_for_machine(candidate: Candidate, machine: OSError, err: BaseException) -> None:
    # No agreement with the group's other ranks first: they may be inside a collective of the training step,
    # and this rank's exit is what ends them (the launcher stops the job when a rank fails). The trial is not
    # told: it stays running in the study, and the next start of the search resumes it.
    message = (f"ddpkit search: trial {candidate.number} was stopped by the machine, not by the candidate: "
               f"{machine}. The search stops here; the trial is neither failed nor counted twice, and resumes "
               "from its last snapshot when the search is started again once that is fixed")
    print(message, file=sys.stderr, flush=True)
    if hasattr(err, "add_note"):
        err.add_note(message)


def _free_accelerator_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _progress(study, cfg: SearchConfig, search_id: str, candidate: Candidate, state, value, error) -> None:
    trials = _ours(study, search_id)
    finished = sum(t.state.is_finished() for t in trials)
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    best = (min if cfg.direction == "minimize" else max)(complete, key=lambda t: t.value) if complete else None
    if state == TrialState.COMPLETE:
        what = f"{cfg.metric} {value:.4g}"
    else:
        what = "pruned" if state == TrialState.PRUNED else f"failed: {(error or '?').splitlines()[0][:160]}"
    best_text = f"best #{best.number} {best.value:.4g}" if best else "no complete trial yet"
    print(f"[group {candidate.runtime.group_index}] trial {candidate.number} {what} | {finished}/{cfg.n_trials} "
          f"finished, {best_text} | {candidate.params}", flush=True)


def _wait_for_every_group() -> None:
    """Wait until every group has finished its last candidate.

    Groups end at different times, up to a whole candidate apart, which can be longer than the process group's
    collective timeout; this barrier runs on a gloo group of its own whose timeout is a day. Without it a group
    that finished first would tear down the job's process group under the others.
    """
    if not dist.is_initialized():
        return
    waiting = dist.new_group(backend="gloo", timeout=timedelta(days=1))
    dist.barrier(group=waiting)
    dist.destroy_process_group(waiting)
