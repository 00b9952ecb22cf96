"""Hyper-parameter search whose candidates each train with DDP on their own group of ranks: every
group of ``group_size`` ranks trains one candidate at a time (docs/hyperparameter-search.md). Needs
``pip install 'ddpkit[search]'`` (Optuna).
"""

try:
    import optuna  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the optional extra
    raise ImportError("ddpkit.search needs Optuna: pip install 'ddpkit[search]'") from err

from ddpkit.search._config import SearchConfig, choice, integer, uniform
from ddpkit.search._engine import Candidate, search

__all__ = ["Candidate", "SearchConfig", "choice", "integer", "search", "uniform"]
