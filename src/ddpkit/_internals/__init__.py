"""Every place ddpkit touches private code of torch, CPython, numpy, Optuna or Ray, and nowhere
else.

Each module names what it touches as :class:`~ddpkit._internals.contract.Internal` records
(``INTERNALS``), with a check of the shape it relies on. Outside this package ddpkit uses public
APIs only: no ``ctypes``, no ``torch._`` name other than the documented ``torch._foreach_*``
operators (``tests/unit/internals/test_internals_seam.py`` enforces both).

- :mod:`~ddpkit._internals.versions`: the torch version, and features refused below the version that
  has them;
- :mod:`~ddpkit._internals.store`: the TCPStore a launcher hands its workers, on a listening socket;
- :mod:`~ddpkit._internals.dcp`: distributed checkpoint's file-system storage;
- :mod:`~ddpkit._internals.elastic`: torchrun's elastic agent and its worker processes;
- :mod:`~ddpkit._internals.interpreter`: CPython's process: exit handlers, the command line,
  ``prctl``;
- :mod:`~ddpkit._internals.optim`: optimizers and learning-rate schedulers;
- :mod:`~ddpkit._internals.modules`: ``torch.nn`` modules (BatchNorm's base, compiled and buffer
  internals);
- :mod:`~ddpkit._internals.compiler`: ``torch.compile``'s configuration and its compiler probe, and
  the autograd engine's callbacks at a backward's end;
- :mod:`~ddpkit._internals.optuna_journal`: Optuna's storages: a journal's operation codes, the
  storage a study writes through;
- :mod:`~ddpkit._internals.ray_train`: Ray's key-value store, where each rank counts Ray Train's
  restarts.
"""

from __future__ import annotations

import importlib

from ddpkit._internals.contract import Internal, problem

MODULES = (
    "versions", "store", "dcp", "elastic", "interpreter", "optim", "compiler", "modules",
    "optuna_journal", "ray_train",
)  # fmt: skip


def all_internals() -> list[Internal]:
    """Every private name ddpkit touches, module by module (Optuna's too: their checks pass where it
    is absent)."""
    found: list[Internal] = []
    for name in MODULES:
        found += importlib.import_module(f"ddpkit._internals.{name}").INTERNALS
    return found


def broken() -> list[str]:
    """A line for each internal whose shape is not the one ddpkit relies on (empty: all hold)."""
    return [line for line in map(problem, all_internals()) if line is not None]
