"""A search space: names mapped to Optuna distributions, checked before any rank starts a
candidate."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from ddpkit._errors import ConfigError


def uniform(
    low: float, high: float, *, log: bool = False, step: float | None = None
) -> FloatDistribution:
    """A float in ``[low, high]``, log-uniform with ``log=True``."""
    return _checked("uniform", FloatDistribution, low, high, log=log, step=step)


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
