"""The search loop: every group of ``group_size`` ranks trains one candidate at a time until the
budget is spent; rank 0 of each group talks to the study (docs/hyperparameter-search.md)."""

from __future__ import annotations

import csv
import errno
import functools
import gc
import io
import sys
import traceback
import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import optuna
import torch
import torch.distributed as dist
from optuna.trial import FrozenTrial, TrialState

from ddpkit import _fs as fs
from ddpkit._errors import ConfigError
from ddpkit._fs.lock import FolderLock
from ddpkit._internals.groups import align_group_count
from ddpkit.distributed._collectives import all_gather_object, broadcast_object
from ddpkit.distributed._groups import split_world
from ddpkit.distributed._runtime import Runtime, get_runtime, print0
from ddpkit.search._config import SearchConfig, to_distributions
from ddpkit.search._study import (
    Start,
    begin_search,
    describe_storage,
    next_trial,
    open_search_study,
    trial_dir,
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
        else:  # epochs completed, or the epoch begun where max_steps stopped inside one
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

    ``objective(candidate)`` trains one candidate on ``candidate.group`` with ``candidate.params``
    and returns the metric, or the Trainer's metrics dict holding ``config.metric``. A candidate
    that fails fails its trial only; an error of the machine (:data:`ENVIRONMENT_ERRNOS`) stops the
    search. A second job on ``search_dir`` is refused.
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
    # rank 0 takes search_dir and creates the study first; its refusal is an error on every rank
    lock: FolderLock | None = None
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
        study = open_search_study(config, distributions, create=False).study
        if rt.is_main:
            write_results(study, trials_of(study, begun.search_id), config)
    except BaseException as err:
        # an error of the machine met by the study's own writes, between trials: said in one line
        machine = environment_error(err)
        if machine is not None and not any(
            "stopped by the machine" in note for note in getattr(err, "__notes__", ())
        ):
            _say(
                err,
                f"ddpkit search: the study's storage ({describe_storage(config)}) could not be "
                f"written: {machine}. The search stops here; finished trials are kept, and it goes "
                "on from them when started again once that is fixed",
            )
        raise
    finally:
        if lock is not None:
            lock.release()
    return study


def _search_on_groups(
    objective: _Objective, distributions: dict[str, Any], cfg: SearchConfig, begun: Start
) -> None:
    """Every group trains candidates until the budget is spent; returns once every group is done."""
    rt = get_runtime()
    grt = split_world(cfg.group_size)
    handle = None
    if grt.is_main:  # a study per process: the storage is shared, the samplers' state is not
        handle = open_search_study(
            cfg, distributions, False, grt.group_index, begun.start, begun.search_id
        )
    # the trials a killed job left running, shared out before any group asks for new ones
    n_groups = rt.world_size // cfg.group_size
    mine = begun.leftover[grt.group_index :: n_groups]
    if begun.leftover:
        print0(
            f"ddpkit search: resuming {len(begun.leftover)} trial(s) a stopped job left running: "
            f"{begun.leftover}"
        )
    search_dir = Path(cfg.search_dir)
    while True:
        trial = None
        if handle is not None:
            trial = next_trial(handle, cfg, distributions, begun.search_id, mine)
        payload = broadcast_object(
            None if trial is None else (trial.number, trial.params), group=grt.group
        )
        if payload is None:
            break
        number, params = payload
        candidate = Candidate(number, params, grt, trial_dir(search_dir, number), trial, cfg.metric)
        state, value, error = _run_candidate(objective, candidate, cfg)
        if handle is not None and trial is not None:  # the group's rank 0
            if error:
                trial.set_user_attr("error", error[-2000:])
            handle.study.tell(number, value if state == TrialState.COMPLETE else None, state=state)
            _progress(handle.study, cfg, begun.search_id, candidate, state, value, error)
    # groups end up to a candidate apart, past a collective's timeout: wait for every group's last
    # candidate on a gloo group whose timeout is a day
    if dist.is_initialized():
        align_group_count()  # the candidates' groups were made by their ranks alone
        waiting = dist.new_group(backend="gloo", timeout=timedelta(days=1))
        dist.barrier(group=waiting)
        dist.destroy_process_group(waiting)


def _run_candidate(
    objective: _Objective, candidate: Candidate, cfg: SearchConfig
) -> tuple[TrialState, float | None, str | None]:
    """Train one candidate; the group agrees on how it ended."""
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
            # no agreement with the group first: its ranks may be in a collective of the step, and
            # this rank's exit ends them. The trial stays running; the next start resumes it.
            _say(
                err,
                f"ddpkit search: trial {candidate.number} was stopped by the machine, not by the "
                f"candidate: {machine}. The search stops here; the trial is neither failed nor "
                "counted twice, and resumes from its last snapshot when the search is started "
                "again once that is fixed",
            )
            raise
        if not isinstance(err, Exception):  # KeyboardInterrupt, SystemExit (Preempted)
            raise
        state = TrialState.FAIL
        error = "".join(traceback.format_exception_only(type(err), err)).strip()
        if "out of memory" in error.lower():
            error = f"out of memory: {error}"
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    outcomes = all_gather_object((state.name, value, error), group=candidate.group)
    errors = [e for _, _, e in outcomes if e]
    if errors:
        return TrialState.FAIL, None, errors[0]
    if any(s == TrialState.PRUNED.name for s, _, _ in outcomes):
        return TrialState.PRUNED, None, None
    if value is None or value != value:  # NaN: a diverged candidate that did not raise
        return TrialState.FAIL, None, f"the objective returned {value!r}"
    return state, value, None


def _say(err: BaseException, message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    if hasattr(err, "add_note"):
        err.add_note(message)


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
    best = best_trials(trials, cfg.direction, k=1)
    what = {
        TrialState.COMPLETE: f"{cfg.metric} {value or 0.0:.4g}",
        TrialState.PRUNED: "pruned",
    }.get(state, f"failed: {(error or '?').splitlines()[0][:160]}")
    best_text = f"best #{best[0].number} {best[0].value:.4g}" if best else "no complete trial yet"
    print(
        f"[group {candidate.runtime.group_index}] trial {candidate.number} {what} | "
        f"{finished}/{cfg.n_trials} finished, {best_text} | {candidate.params}",
        flush=True,
    )


# -- errors of the machine -------------------------------------------------------------------------

# Errors every candidate would meet: failing trials on them would spend the budget on nothing.
ENVIRONMENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.ESTALE})


def environment_error(err: BaseException) -> OSError | None:
    """The error of the machine behind ``err`` (in its causes, contexts, rank failures), or None."""
    todo: list[BaseException | None] = [err]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS:
            return e
        todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
        failures = getattr(e, "failures", None)  # CheckpointException: rank -> (error, traceback)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


# -- what a search leaves behind -------------------------------------------------------------------


def best_trials(trials: list[FrozenTrial], direction: str, k: int = 5) -> list[FrozenTrial]:
    complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    return sorted(complete, key=lambda t: cast(float, t.value), reverse=direction == "maximize")[:k]


def write_csv(trials: list[FrozenTrial], path: Path) -> None:
    params = sorted({name for t in trials for name in t.params})
    text = io.StringIO(newline="")
    w = csv.writer(text)
    w.writerow(["number", "state", "value", *params, "epochs_reported", "seconds", "error"])
    for t in sorted(trials, key=lambda t: t.number):
        done, start = t.datetime_complete, t.datetime_start
        seconds = (done - start).total_seconds() if done and start else ""
        w.writerow(
            [
                t.number,
                t.state.name,
                "" if t.value is None else t.value,
                *[t.params.get(p, "") for p in params],
                len(t.intermediate_values),
                f"{seconds:.2f}" if seconds != "" else "",
                " / ".join(t.user_attrs.get("error", "").splitlines()),
            ]
        )
    fs.write_atomic(path, text.getvalue().encode())


def format_table(trials: list[FrozenTrial], metric: str) -> str:
    if not trials:
        return "no trial completed"
    params = sorted({name for t in trials for name in t.params})
    rows = [["trial", metric, *params]] + [
        [str(t.number), f"{t.value:.4g}", *[_fmt(t.params.get(p)) for p in params]] for t in trials
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def save_plots(study: Any, out_dir: Path) -> list[Path]:
    """Optuna's history, importances and intermediate values, as PNG (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import optuna.visualization.matplotlib as vis
    except ImportError:
        print("ddpkit search: no plots (pip install 'ddpkit[plot]' for matplotlib)")
        return []
    saved = []
    plots: list[tuple[str, Callable[[Any], Any]]] = [
        ("history", vis.plot_optimization_history),
        ("importances", vis.plot_param_importances),
        ("intermediate", vis.plot_intermediate_values),
    ]
    for name, draw in plots:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib plots experimental
                ax = draw(study)
            path = out_dir / f"{name}.png"
            # into a file of ours, renamed over the name: never written through a link
            fs.write_with(
                path,
                functools.partial(ax.figure.savefig, format="png", dpi=100, bbox_inches="tight"),
            )
            plt.close(ax.figure)
            saved.append(path)
        except (ValueError, RuntimeError) as err:  # e.g. importances need two complete trials
            print(f"ddpkit search: no {name} plot ({err})")
    return saved


def write_results(study: Any, trials: list[FrozenTrial], config: Any) -> None:
    out = Path(config.search_dir)
    write_csv(trials, out / "trials.csv")
    counts = {
        s.name.lower(): sum(t.state == s for t in trials)
        for s in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
    }
    print(
        f"ddpkit search: {len(trials)} trials ({', '.join(f'{n} {k}' for k, n in counts.items())})"
    )
    print(format_table(best_trials(trials, config.direction), config.metric))
    saved = save_plots(study, out) if config.plots else []
    print(
        f"ddpkit search: trials in {out / 'trials.csv'}"
        + (f", plots {', '.join(p.name for p in saved)}" if saved else "")
    )
