"""Module paths of ddpkit 0.1 that are private now: ``ddpkit.training.trainer`` is
``ddpkit.training._trainer``, ``ddpkit.launch.agent`` is ``ddpkit._launch.agent``. For one release
an old path still imports (the private module, under both names) with a FutureWarning naming where
its public names are; then it goes.

Written here rather than as a stub module per old path: one finder serves every path, and none can
be left behind when a module moves again.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType


def private_path(fullname: str) -> str | None:
    """The private module an old public path of ddpkit names (one of its components with an
    underscore), or None where there is none."""
    parts = fullname.split(".")
    if parts[0] != "ddpkit" or len(parts) < 2 or any(p.startswith("_") for p in parts[1:]):
        return None
    for i in range(1, len(parts)):
        candidate = ".".join([*parts[:i], "_" + parts[i], *parts[i + 1 :]])
        try:
            if importlib.util.find_spec(candidate) is not None:
                return candidate
        except ModuleNotFoundError:  # a parent of the candidate does not exist either
            continue
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, old: str, new: str, warn: bool) -> None:
        self.old, self.new, self.warn = old, new, warn

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        if self.warn:
            package = self.new.split("._", 1)[0]
            where = "ddpkit" if package == "ddpkit" else f"{package} (its __all__) or from ddpkit"
            warnings.warn(
                f"{self.old} is private from this release on ({self.new}) and goes in the next "
                f"one: import its public names from {where}",
                FutureWarning,
                stacklevel=2,
            )
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        pass  # the private module ran when it was imported


class _MovedModules(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``, and answering only for ddpkit paths that no file has.

    First, because a module under an old package path (``ddpkit.launch.agent``, once
    ``ddpkit.launch`` is the alias of ``ddpkit._launch``) would otherwise be found by the path
    finder in the aliased package's folder and run a second time as another module, with state of
    its own."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("ddpkit."):
            return None
        parent, _, last = fullname.rpartition(".")
        module = sys.modules.get(parent)
        # under an old path: the private module's child
        if module is not None and module.__name__ != parent:
            child = f"{module.__name__}.{last}"
            return importlib.util.spec_from_loader(fullname, _Alias(fullname, child, warn=False))
        if (
            path is not None
            and importlib.machinery.PathFinder.find_spec(fullname, path) is not None
        ):
            return None  # a module of that name exists: the usual import
        new = private_path(fullname)
        return (
            None
            if new is None
            else importlib.util.spec_from_loader(fullname, _Alias(fullname, new, warn=True))
        )


def install() -> None:
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())
