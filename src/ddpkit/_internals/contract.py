"""What ddpkit relies on in another project's private code, and a check that it is still there.

Each module of :mod:`ddpkit._internals` lists the private names it touches as :class:`Internal`
records. A record's ``check`` looks at the shape ddpkit relies on (a method, an attribute, a
keyword, a layout) without side effects and says what differs; :func:`broken` runs them all. The
contract tests run every check on each torch and Python of the tested range, and ``ddpkit env``
prints them, so a new release that renames one is named at once, with its version, rather than found
as a silent change of behaviour.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    """One private name of torch, CPython, numpy or Optuna that ddpkit uses."""

    name: str
    """Where it lives, dotted:
    ``torch.distributed.elastic.agent.server.api.SimpleElasticAgent._monitor_workers``."""
    owner: str
    """The project it belongs to: ``"torch"``, ``"CPython"``, ``"numpy"``, ``"Optuna"`` or
    ``"Ray"``."""
    used_for: str
    """What ddpkit does with it, and what a user gets where it is gone."""
    check: Callable[[], str | None]
    """None where the shape ddpkit relies on holds; otherwise what differs, in a few words."""


def version_of(owner: str) -> str:
    """The installed version of ``owner``, for messages: ``torch 2.13.0``."""
    if owner == "CPython":
        return f"CPython {sys.version.split()[0]}"
    # its version without importing it (see ddpkit._internals.ray_train.kv_source)
    if owner == "Ray":
        from importlib import metadata

        try:
            return f"Ray {metadata.version('ray')}"
        except metadata.PackageNotFoundError:
            return "Ray (not installed)"
    module = {"torch": "torch", "numpy": "numpy", "Optuna": "optuna"}[owner]
    try:
        version = __import__(module).__version__
    except ImportError:
        return f"{owner} (not installed)"
    return f"{owner} {version}"


def problem(internal: Internal) -> str | None:
    """A line naming ``internal``, the installed version and what differs; None where it holds."""
    try:
        found = internal.check()
    except Exception as e:  # a check must not stop the others: what it raised is what differs
        found = f"checking it raised {type(e).__name__}: {e}"
    if found is None:
        return None
    return f"{internal.name} ({version_of(internal.owner)}): {found}; {internal.used_for}"


_warned: set[str] = set()


def warn_lost(internal: str, owner: str, lost: str) -> None:
    """One warning per process that ``internal`` of ``owner`` is not as ddpkit relies on, and that
    ``lost`` (the feature it served) is turned off: the job goes on without it, never silently."""
    if internal not in _warned:
        _warned.add(internal)
        warnings.warn(
            f"ddpkit: {internal} is not what ddpkit relies on in {version_of(owner)}: {lost} is "
            "off for this job (`ddpkit env` lists what differs)",
            RuntimeWarning,
            stacklevel=3,
        )
