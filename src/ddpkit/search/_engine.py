"""The search loop: every group of ranks trains one candidate at a time until the budget is spent.

Roles. The job is split once into groups of ``group_size`` ranks (:func:`ddpkit.split_world`). Rank
0 of each group talks to the study (Optuna): it asks for a candidate, reports intermediate values,
asks whether to prune and tells the result. Everything the group's ranks must agree on (the
parameters, each prune decision, the outcome) reaches them by a broadcast on the group, so the ranks
of a candidate never disagree. Groups never wait for each other until the budget is spent.

Budget. A candidate is started only while the study holds fewer than ``n_trials`` trials of this
search; the count and the ask happen under a file lock in ``search_dir``, so groups racing for the
last candidate cannot both start one.

Crashes. Each candidate trains in its own run directory (``search_dir/trial-NNNN``). When the
launcher restarts the job after a rank died, the trials the dead job left running are handed to the
groups again and resume from their own snapshots; completed trials are kept. A trial is created with
its search's tag in one write to the study, so a kill while its parameters are drawn leaves a trial
of this search, resumed like any other (its missing parameters drawn then). Each start of the search
seeds its samplers apart (a start counter in the study), so a restart draws new candidates, and
replaying the same starts replays the same draws.

One job per search_dir (see :mod:`ddpkit.search._search_dir`), and an error of the machine (a full
disk, a read-only file system) stops the search with that error: the trial is left running, to
resume when the search is started again, not failed and counted against the budget.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import optuna
import torch.distributed as dist
from optuna.trial import TrialState

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit.distributed._collectives import all_gather_object, broadcast_object
from ddpkit.distributed._groups import split_world
from ddpkit.distributed._log import print0
from ddpkit.distributed._runtime import Runtime, get_runtime
from ddpkit.search._config import SearchConfig
from ddpkit.search._environment import environment_error
from ddpkit.search._report import write_results
from ddpkit.search._search_dir import (
    SearchDirLock,
    describe_storage,
    trial_dir,
)
from ddpkit.search._space import to_distributions
from ddpkit.search._study import (
    Start,
    begin_search,
    next_trial,
    open_search_study,
    open_study,
    trials_of,
)

_Objective = Callable[["Candidate"], "float | Mapping[str, float]"]


class Candidate:
    """One trial as its group's ranks see it: the parameters, where to write, and how to report."""

    def __init__(
        self,
        number: int,
        params: dict[str, Any],
        runtime: Runtime,
        run_dir: Path,
        trial: optuna.Trial | None,
        metric: str,
    ) -> None:
        self.number, self.params, self.runtime, self.run_dir = number, params, runtime, run_dir
        self.group = runtime.group
        self.metric = metric
        self.reported: dict[int, float] = {}
        self._trial = trial  # on the group's rank 0 only

    def report(self, value: float, step: int) -> None:
        """Report an intermediate value; raises ``optuna.TrialPruned`` on every rank of the group if
        the pruner stops this candidate. Collective on the group."""
        prune = False
        if self._trial is not None:
            self._trial.report(float(value), step)
            prune = self._trial.should_prune()
        self.reported[step] = float(value)
        if broadcast_object(prune, group=self.group):
            raise optuna.TrialPruned(f"pruned at step {step} ({self.metric} {value:.4g})")

    def on_validation_end(self, trainer: Any, metrics: Mapping[str, float]) -> None:
        """As a Trainer's callback (``Trainer(..., callbacks=[candidate])``): report a validation
        metric after each validation, so the pruner can stop the candidate: at the epoch's number
        when the Trainer validates at epoch ends, at the optimizer step with ``val_every_steps``."""
        if not self.metric.startswith("val/"):
            return  # a metric of the training records: reported by on_epoch_end
        if self.metric not in metrics:
            raise ConfigError(
                f"SearchConfig.metric={self.metric!r} is not among the validation metrics "
                f"{sorted(k for k in metrics if k.startswith('val/'))}: set metric to one of these"
            )
        if getattr(getattr(trainer, "config", None), "val_every_steps", None):
            step = int(metrics["step"])
        # epochs completed; where max_steps stopped inside an epoch, the epoch begun (not the last
        # one again)
        else:
            step = int(metrics["epoch"]) + (1 if getattr(trainer, "cursor", 0) else 0)
        self.report(metrics[self.metric], step)

    def on_epoch_end(self, trainer: Any, metrics: Mapping[str, float]) -> None:
        """As a Trainer's callback: report a metric of the epoch's records (``train/epoch_loss``)
        after each epoch. A validation metric is reported by :meth:`on_validation_end`."""
        if self.metric.startswith("val/"):
            if getattr(trainer, "val_data", None) is None:
                raise ConfigError(
                    f"SearchConfig.metric={self.metric!r} is a validation metric and the Trainer "
                    "validates on nothing: give the Trainer val_data, or set metric to one of the "
                    f"epoch's metrics {sorted(k for k in metrics if '/' in k)}"
                )
            return
        if self.metric not in metrics:
            raise ConfigError(
                f"SearchConfig.metric={self.metric!r} is not among the Trainer's epoch metrics "
                f"{sorted(metrics)}: set metric to one of these, or to a validation metric "
                "(val/...) with val_data"
            )
        self.report(metrics[self.metric], int(metrics["epoch"]))


def search(
    objective: Callable[[Candidate], float | Mapping[str, float]],
    space: Mapping[str, Any],
    config: SearchConfig,
) -> optuna.Study:
    """Run the search on every rank of the job; return the study (on every rank).

    ``objective(candidate)`` builds and trains one candidate on ``candidate.group`` with
    ``candidate.params`` (with the Trainer: ``Trainer(..., group=candidate.group,
    callbacks=[candidate])``, its run_dir ``candidate.run_dir``) and returns the metric, or the
    Trainer's metrics dict holding ``config.metric``. The candidate as a callback reports
    ``config.metric`` after each validation (or each epoch, for a metric of the training records),
    so the pruner can stop it. A candidate that diverges, raises or runs out of memory fails its
    trial only; the group goes on to the next. An error of the machine (a full disk, a read-only
    file system: see :mod:`ddpkit.search._environment`) stops the search with that error and leaves
    the trial to resume when the search is started again. One job at a time per ``search_dir``; a
    second is refused, naming the first.
    """
    distributions = to_distributions(space)
    rt = get_runtime()
    if rt.world_size % config.group_size:
        raise ConfigError(
            f"SearchConfig.group_size={config.group_size} does not divide the job's "
            f"{rt.world_size} ranks: pick a divisor of {rt.world_size}, or launch a multiple of "
            f"{config.group_size} processes"
        )
    fs.make_dirs(Path(config.search_dir))
    # One rank takes search_dir and creates the study before the others open it; a refusal or an
    # unreachable storage is an error on every rank rather than a hang on those waiting.
    lock: SearchDirLock | None = None
    error: str | None = None
    begun: Start | None = None
    if rt.is_main:
        try:
            lock, begun = begin_search(config, distributions)
        except ConfigError as err:
            error = str(err)
    error, begun = broadcast_object((error, begun))
    if error is not None or begun is None:  # rank 0 found either an error or a Start
        raise ConfigError(str(error))
    try:
        _search_on_groups(objective, distributions, config, begun)
        if rt.is_main:
            final = open_study(config, distributions, create=False)
            write_results(final, trials_of(final, begun.search_id), config)
    except BaseException as err:
        _name_a_machine_error_between_trials(err, config)
        raise
    finally:
        if lock is not None:
            lock.release()
    return open_study(config, distributions, create=False)


def _search_on_groups(
    objective: _Objective, distributions: dict[str, Any], cfg: SearchConfig, begun: Start
) -> None:
    """Every group trains candidates until the budget is spent; returns once every group is done."""
    rt = get_runtime()
    grt = split_world(cfg.group_size)
    # A study per process: the storage is shared, the samplers' random state is not.
    handle = (
        open_search_study(
            cfg,
            distributions,
            create=False,
            group_index=grt.group_index,
            start=begun.start,
            search_id=begun.search_id,
        )  # fmt: skip
        if grt.is_main
        else None
    )
    study = None if handle is None else handle.study
    # The trials a killed job left running, shared out among the groups before any group asks for
    # new ones.
    n_groups = rt.world_size // cfg.group_size
    mine = begun.leftover[grt.group_index :: n_groups]
    if begun.leftover:
        print0(
            f"ddpkit search: resuming {len(begun.leftover)} trial(s) a stopped job left running: "
            f"{begun.leftover}"
        )
    search_dir = Path(cfg.search_dir)
    while True:
        trial = (
            next_trial(handle, cfg, distributions, begun.search_id, mine, search_dir)
            if handle is not None
            else None
        )
        payload = broadcast_object(
            None if trial is None else (trial.number, trial.params), group=grt.group
        )
        if payload is None:
            break
        number, params = payload
        candidate = Candidate(number, params, grt, trial_dir(search_dir, number), trial, cfg.metric)
        state, value, error = _run_candidate(objective, candidate, cfg)
        if study is not None and trial is not None:  # the group's rank 0
            if error:
                trial.set_user_attr("error", error[-2000:])
            study.tell(number, value if state == TrialState.COMPLETE else None, state=state)
            _progress(study, cfg, begun.search_id, candidate, state, value, error)
    _wait_for_every_group()


def _run_candidate(
    objective: _Objective, candidate: Candidate, cfg: SearchConfig
) -> tuple[TrialState, float | None, str | None]:
    """Train one candidate; the group agrees on how it ended (every rank learns every other's
    outcome)."""
    state, value, error = TrialState.COMPLETE, None, None
    try:
        result = objective(candidate)
        if isinstance(result, Mapping) and cfg.metric not in result:
            raise ConfigError(
                f"the objective returned metrics without SearchConfig.metric={cfg.metric!r}: "
                f"{sorted(result)}; return that metric, or set metric to one of these"
            )
        value = float(result[cfg.metric] if isinstance(result, Mapping) else result)
    except optuna.TrialPruned:
        state = TrialState.PRUNED
    except BaseException as err:
        machine = environment_error(err)
        if machine is not None:
            _stop_for_machine(candidate, machine, err)
            raise
        # KeyboardInterrupt, SystemExit (Preempted): not the candidate's
        if not isinstance(err, Exception):
            raise
        # A failed candidate fails its trial, not the search.
        state, error = (
            TrialState.FAIL,
            "".join(traceback.format_exception_only(type(err), err)).strip(),
        )
        if "out of memory" in error.lower():
            error = f"out of memory: {error}"
        _free_accelerator_memory()
    outcomes = all_gather_object((state.name, value, error), group=candidate.group)
    errors = [e for _, _, e in outcomes if e]
    if errors:
        return TrialState.FAIL, None, errors[0]
    if any(s == TrialState.PRUNED.name for s, _, _ in outcomes):
        return TrialState.PRUNED, None, None
    if value is None or value != value:  # NaN: a diverged candidate that did not raise
        return TrialState.FAIL, None, f"the objective returned {value!r}"
    return state, value, None


def _name_a_machine_error_between_trials(err: BaseException, cfg: SearchConfig) -> None:
    """A full disk (or another error of the machine) met by the study's own writes, between trials:
    say so in one line; a trial it met inside was named by :func:`_stop_for_machine` already."""
    machine = environment_error(err)
    if machine is None or any(
        "stopped by the machine" in note for note in getattr(err, "__notes__", ())
    ):
        return
    message = (
        f"ddpkit search: the study's storage ({describe_storage(cfg)}) could not be written: "
        f"{machine}. The search stops here; finished trials are kept, and it goes on from them "
        "when started again once that is fixed"
    )
    print(message, file=sys.stderr, flush=True)
    if hasattr(err, "add_note"):
        err.add_note(message)


def _stop_for_machine(candidate: Candidate, machine: OSError, err: BaseException) -> None:
    # No agreement with the group's other ranks first: they may be inside a collective of the
    # training step, and this rank's exit is what ends them (the launcher stops the job when a rank
    # fails). The trial is not told: it stays running in the study, and the next start of the search
    # resumes it.
    message = (
        f"ddpkit search: trial {candidate.number} was stopped by the machine, not by the "
        f"candidate: {machine}. The search stops here; the trial is neither failed nor counted "
        "twice, and resumes from its last snapshot when the search is started again once that is "
        "fixed"
    )
    print(message, file=sys.stderr, flush=True)
    if hasattr(err, "add_note"):
        err.add_note(message)


def _free_accelerator_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _progress(
    study: optuna.Study,
    cfg: SearchConfig,
    search_id: str,
    candidate: Candidate,
    state: TrialState,
    value: float | None,
    error: str | None,
) -> None:
    trials = trials_of(study, search_id)
    finished = sum(t.state.is_finished() for t in trials)
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    best = (
        (min if cfg.direction == "minimize" else max)(complete, key=lambda t: t.value)
        if complete
        else None
    )
    if state == TrialState.COMPLETE:
        what = f"{cfg.metric} {value:.4g}"
    else:
        what = (
            "pruned"
            if state == TrialState.PRUNED
            else f"failed: {(error or '?').splitlines()[0][:160]}"
        )
    best_text = f"best #{best.number} {best.value:.4g}" if best else "no complete trial yet"
    print(
        f"[group {candidate.runtime.group_index}] trial {candidate.number} {what} | "
        f"{finished}/{cfg.n_trials} finished, {best_text} | {candidate.params}",
        flush=True,
    )


def _wait_for_every_group() -> None:
    """Wait until every group has finished its last candidate.

    Groups end at different times, up to a whole candidate apart, which can be longer than the
    process group's collective timeout; this barrier runs on a gloo group of its own whose timeout
    is a day. Without it a group that finished first would tear down the job's process group under
    the others.
    """
    if not dist.is_initialized():
        return
    waiting = dist.new_group(backend="gloo", timeout=timedelta(days=1))
    dist.barrier(group=waiting)
    dist.destroy_process_group(waiting)
