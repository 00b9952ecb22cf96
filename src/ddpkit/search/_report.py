"""What a search leaves behind: the best trials printed, every trial as CSV, and Optuna's plots as
PNG."""

from __future__ import annotations

import csv
import functools
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from optuna.trial import FrozenTrial, TrialState

from ddpkit import _fs as fs


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
    """Optimization history, parameter importances and intermediate values, as PNG (needs
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import optuna.visualization.matplotlib as vis
    except ImportError:
        print("ddpkit search: no plots (pip install 'ddpkit[plot]' for matplotlib)")
        return []
    import warnings

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
            figure = ax.figure
            # Into a file of ours, renamed over the name: savefig(path) would write through a link
            # there.
            fs.write_with(
                path, functools.partial(figure.savefig, format="png", dpi=100, bbox_inches="tight")
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
