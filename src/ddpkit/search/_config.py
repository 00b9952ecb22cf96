"""What a search is asked to do: :class:`SearchConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ddpkit._errors import ConfigError, check_types

Sampler = Literal["tpe", "evolution", "nsga2", "cmaes", "random", "grid"]
SAMPLERS: tuple[str, ...] = get_args(Sampler)


Pruner = Literal["median", "halving", "hyperband", "none"]
PRUNERS: tuple[str, ...] = get_args(Pruner)


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
        check_types(self)
        checks = {
            "n_trials": self.n_trials >= 1,
            "group_size": self.group_size >= 1,
            "direction": self.direction in ("minimize", "maximize"),
            "sampler": self.sampler in SAMPLERS,
            "pruner": self.pruner in PRUNERS,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} is not valid: see SearchConfig.{name}"
                )
