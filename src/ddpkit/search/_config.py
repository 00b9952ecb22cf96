"""What a search is asked to do: :class:`SearchConfig`, and the space its candidates are drawn
from (names mapped to Optuna distributions, checked before any rank starts a candidate)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from ddpkit._errors import ConfigError, check_fields, check_types, checked_arguments

Sampler = Literal["tpe", "evolution", "nsga2", "cmaes", "random", "grid"]
Pruner = Literal["median", "halving", "hyperband", "none"]


@dataclass(kw_only=True)
class SearchConfig:
    """What to search for, how, and for how long."""

    n_trials: int
    """Budget: finished trials (complete, pruned or failed) the search ends with."""
    group_size: int = 1
    """Ranks per candidate; the job's world size must divide by it."""
    metric: str = "val/loss"
    """The validation metric a Trainer reports each epoch (pruning) and the objective's result, if
    the objective returns the Trainer's metrics dict."""
    direction: Literal["minimize", "maximize"] = "minimize"
    sampler: Sampler = "tpe"
    """``tpe`` (default), ``evolution`` (Propulate's asynchronous evolution), ``nsga2``, ``cmaes``,
    ``random``, ``grid`` (choices only)."""
    pruner: Pruner = "median"
    """``median``, ``halving`` (successive halving), ``hyperband``, or ``none``."""
    search_dir: str = "runs/search"
    """Trials' run directories, the study's journal file (default storage), trials.csv and plots."""
    storage: str | None = None
    """An RDB URL (``sqlite:///path.db``, ``postgresql://...``) to share a study between jobs;
    default: a journal file in ``search_dir`` (nothing to start)."""
    study_name: str = "ddpkit"
    seed: int = 0
    """Seeds the sampler: the same seed and the same order of results give the same candidates."""
    plots: bool = True
    """Save Optuna's matplotlib plots (needs matplotlib)."""
    sampler_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_types(self)  # direction, sampler and pruner among their literals too
        check_fields(self, {"n_trials": self.n_trials >= 1, "group_size": self.group_size >= 1})


@checked_arguments
def uniform(
    low: float, high: float, *, log: bool = False, step: float | None = None
) -> FloatDistribution:
    """A float in ``[low, high]``, log-uniform with ``log=True``."""
    return _checked("uniform", FloatDistribution, low, high, log=log, step=step)


@checked_arguments
def integer(low: int, high: int, *, log: bool = False, step: int = 1) -> IntDistribution:
    """An integer in ``[low, high]``."""
    return _checked("integer", IntDistribution, low, high, log=log, step=step)


def choice(options: Sequence[Any]) -> CategoricalDistribution:
    """One of ``options`` (None, bool, int, float or str)."""
    return _checked("choice", CategoricalDistribution, list(options))


def _checked(what: str, cls: type, *args: Any, **kwargs: Any) -> Any:
    try:
        return cls(*args, **kwargs)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{what}{args}: {err}") from None


def to_distributions(space: Mapping[str, Any]) -> dict[str, BaseDistribution]:
    """``space`` as Optuna distributions; a list or tuple means a choice among its items."""
    if not space:
        raise ConfigError(
            "the search space is empty: give at least one parameter, e.g. {'lr': uniform(1e-4, "
            "1e-1, log=True)}"
        )
    out = {}
    for name, spec in space.items():
        try:
            if isinstance(spec, BaseDistribution):
                out[name] = spec
            elif isinstance(spec, (list, tuple)):
                out[name] = choice(spec)
            else:
                raise ConfigError(f"{type(spec).__name__} is not a distribution")
        except ConfigError as err:
            raise ConfigError(
                f"search space parameter {name!r}: {err}; use ddpkit.search.uniform(low, high, "
                "log=...), integer(low, high) or choice([...]) (or a list of options)"
            ) from None
    return out
