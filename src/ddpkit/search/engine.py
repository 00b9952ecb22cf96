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
resume from their own snapshots; completed trials are kept.
"""

from __future__ import annotations

import fcntl
import os
import socket
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
from ddpkit.search.report import write_results
from ddpkit.search.space import to_distributions
from ddpkit.seeding import mix_seed

SAMPLERS = ("tpe", "evolution", "nsga2", "cmaes", "random", "grid")
PRUNERS = ("median", "halving", "hyperband", "none")
_SEARCH_KEY = "ddpkit_search"  # a trial's user attribute: which search (run of this job) it belongs to


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


def _sampler(cfg: SearchConfig, distributions: dict[str, Any], group_index: int = 0) -> optuna.samplers.BaseSampler:
    # Each group's sampler draws its own random numbers: with one seed everywhere, groups asking at the same
    # time would draw the same "random" candidates.
    seed = mix_seed(cfg.seed, "sampler", group_index)
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

        return JournalStorage(JournalFileBackend(str(Path(cfg.search_dir) / "study.journal")))
    return optuna.storages.RDBStorage(cfg.storage, engine_kwargs={"pool_pre_ping": True})


def _open_study(cfg: SearchConfig, distributions: dict[str, Any], create: bool, group_index: int = 0) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # ddpkit prints its own progress
    try:
        storage = _storage(cfg)
        sampler = _sampler(cfg, distributions, group_index)
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
    group goes on to the next.
    """
    distributions = to_distributions(space)
    rt = get_runtime()
    if rt.world_size % config.group_size:
        raise ConfigError(
            f"SearchConfig.group_size={config.group_size} does not divide the job's {rt.world_size} ranks: pick a "
            f"divisor of {rt.world_size}, or launch a multiple of {config.group_size} processes"
        )
    search_dir = Path(config.search_dir)
    search_dir.mkdir(parents=True, exist_ok=True)
    # One rank creates the study (and the search id) before the others open it; an unreachable storage is an
    # error on every rank rather than a hang on those waiting.
    error, search_id = None, None
    if rt.is_main:
        try:
            _open_study(config, distributions, create=True)
            search_id = _search_id(config)
        except ConfigError as err:
            error = str(err)
    error, search_id = broadcast_object((error, search_id))
    if error:
        raise ConfigError(error)
    grt = split_world(config.group_size)
    # A study per process: the storage is shared, the samplers' random state is not.
    study = _open_study(config, distributions, create=False, group_index=grt.group_index) if grt.is_main else None
    # The trials a killed job left running, shared out among the groups before any group asks for new ones.
    leftover = None
    if rt.is_main:
        running = _ours(_open_study(config, distributions, create=False), search_id, (TrialState.RUNNING,))
        leftover = [t.number for t in running]
    leftover = broadcast_object(leftover)
    n_groups = rt.world_size // config.group_size
    mine = leftover[grt.group_index :: n_groups]
    if leftover:
        print0(f"ddpkit search: resuming {len(leftover)} trial(s) a stopped job left running: {leftover}")
    while True:
        trial = _next_trial(study, config, distributions, search_id, mine, search_dir) if grt.is_main else None
        payload = broadcast_object(None if trial is None else (trial.number, trial.params), group=grt.group)
        if payload is None:
            break
        number, params = payload
        candidate = Candidate(number, params, grt, search_dir / f"trial-{number:04d}", trial, config.metric)
        state, value, error = _run_candidate(objective, candidate, config)
        if grt.is_main:
            if error:
                trial.set_user_attr("error", error[-2000:])
            study.tell(number, value if state == TrialState.COMPLETE else None, state=state)
            _progress(study, config, search_id, candidate, state, value, error)
    _wait_for_every_group()
    if rt.is_main:
        final = _open_study(config, distributions, create=False)
        write_results(final, _ours(final, search_id), config)
    return study if study is not None else _open_study(config, distributions, create=False)


def _next_trial(study, cfg, distributions, search_id, leftover: list[int], search_dir: Path) -> optuna.Trial | None:
    """The next candidate's trial for this group, or None when the budget is spent."""
    while leftover:
        number = leftover.pop(0)
        frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
        if frozen.state == TrialState.RUNNING:
            # Optuna has no public handle on an existing trial; its Trial is built from the storage's id.
            return optuna.Trial(study, frozen._trial_id)
    with _locked(search_dir / ".ask.lock"):
        if len(_ours(study, search_id)) >= cfg.n_trials:
            return None
        trial = study.ask(distributions)
        trial.set_user_attr(_SEARCH_KEY, search_id)
    return trial


def _run_candidate(objective, candidate: Candidate, cfg: SearchConfig) -> tuple[TrialState, float | None, str | None]:
    """Train one candidate; the group agrees on how it ended (every rank learns every other's outcome)."""
    state, value, error = TrialState.COMPLETE, None, None
    try:
        with callbacks.ambient(candidate):
            result = objective(candidate)
        value = float(result[cfg.metric] if isinstance(result, Mapping) else result)
    except optuna.TrialPruned:
        state = TrialState.PRUNED
    except Exception as err:  # noqa: BLE001 - a failed candidate fails its trial, not the search
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
