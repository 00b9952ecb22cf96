"""Every place ddpkit touches private code of torch, CPython, numpy, Optuna or Ray, and nowhere
else: each module lists what it touches as :class:`~ddpkit._internals.contract.Internal` records
(``INTERNALS``), each with a check of the shape relied on. One module per owner (:data:`MODULES`).
"""

from __future__ import annotations

import importlib

from ddpkit._internals.contract import Internal, problem

MODULES = (
    "versions", "store", "dcp", "elastic", "groups", "interpreter", "optim", "compiler", "modules",
    "optuna_journal", "ray_train",
)  # fmt: skip


def all_internals() -> list[Internal]:
    """Every private name ddpkit touches, module by module."""
    found: list[Internal] = []
    for name in MODULES:
        found += importlib.import_module(f"ddpkit._internals.{name}").INTERNALS
    return found


def broken() -> list[str]:
    """A line for each internal whose shape is not the one ddpkit relies on (empty: all hold)."""
    return [line for line in map(problem, all_internals()) if line is not None]
