"""What ddpkit relies on in another project's private code (:class:`Internal`), and the words for
what differs."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Internal:
    """One private name of torch, CPython, numpy or Optuna that ddpkit uses."""

    name: str
    """Where it lives, dotted."""
    owner: str
    """``"torch"``, ``"CPython"``, ``"numpy"``, ``"Optuna"`` or ``"Ray"``."""
    used_for: str
    """What ddpkit does with it, and what a user gets where it is gone."""
    check: Callable[[], str | None]
    """None where the shape ddpkit relies on holds; otherwise what differs, in a few words."""


def version_of(owner: str) -> str:
    """The installed version of ``owner``, for messages: ``torch 2.13.0``."""
    if owner == "CPython":
        return f"CPython {sys.version.split()[0]}"
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
    except Exception as e:  # what it raised is what differs
        found = f"checking it raised {type(e).__name__}: {e}"
    if found is None:
        return None
    return f"{internal.name} ({version_of(internal.owner)}): {found}; {internal.used_for}"


_warned: set[str] = set()


def warn_lost(internal: str, owner: str, lost: str) -> None:
    """One warning per process that ``internal`` of ``owner`` is not as relied on and ``lost`` (the
    feature it served) is off: the job goes on without it."""
    if internal not in _warned:
        _warned.add(internal)
        warnings.warn(
            f"ddpkit: {internal} is not what ddpkit relies on in {version_of(owner)}: {lost} is "
            "off for this job (`ddpkit env` lists what differs)",
            RuntimeWarning,
            stacklevel=3,
        )
