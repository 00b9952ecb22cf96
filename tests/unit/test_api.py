"""The public surface: the names scripts call, frozen so that it changes only on purpose."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

import ddpkit

PUBLIC = {
    "init", "shutdown", "get_runtime", "Runtime", "split_world", "spawn", "seed_everything",
    "prepare_model", "unwrap", "no_sync", "build_loader", "build_eval_loader", "to_device",
    "evaluate", "classification_metrics", "regression_metrics", "Trainer", "TrainerConfig",
    "SnapshotConfig", "EarlyStoppingConfig", "LoggingConfig", "DDPConfig", "ZeroConfig",
    "FSDPConfig", "Callback", "Snapshots", "print0", "get_logger", "barrier", "main_first",
    "all_reduce", "broadcast_object", "all_gather_object", "gather_tensors", "MetricSums",
    "ConfigError", "Preempted",
}  # fmt: skip


def test_the_public_names_are_the_frozen_list():
    assert set(ddpkit.__all__) == PUBLIC, (
        "a public name was added or removed: update PUBLIC and the README"
    )
    assert len(ddpkit.__all__) == len(PUBLIC)
    for name in PUBLIC:
        assert getattr(ddpkit, name) is not None
    # Nothing else public leaks through `from ddpkit import *`.
    namespace: dict = {}
    exec("from ddpkit import *", namespace)
    assert set(namespace) - {"__builtins__"} == PUBLIC


def _is_module(package: Path, dotted: str) -> bool:
    """Whether ``ddpkit.x._y`` is a module or package of ddpkit (a private module is imported by
    name)."""
    path = package.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def private_name_imports(package: Path) -> list[str]:
    """``from ddpkit.x import _name`` where ``_name`` is not a module: a private name taken from
    another module."""
    offenders = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ddpkit"):
                offenders += [
                    f"{path.name}: {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_")
                    and not a.name.startswith("__")
                    and not _is_module(package, f"{node.module}.{a.name}")
                ]
    return offenders


def test_no_module_imports_another_modules_private_names():
    assert not private_name_imports(Path(ddpkit.__file__).parent)


def test_a_private_function_imported_is_flagged_and_a_private_module_is_not(tmp_path):
    """Control: ``from ddpkit.a import _helper`` is caught, ``from ddpkit import _a`` (a module) is
    not."""
    package = tmp_path / "ddpkit"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "_a.py").write_text("def _helper(): pass\n")
    (package / "b.py").write_text("from ddpkit import _a\nfrom ddpkit._a import _helper\n")
    assert private_name_imports(package) == ["b.py: ddpkit._a._helper"]


def public_modules(package: Path) -> list[str]:
    """Every module a user may import: no part of its path starts with an underscore (``__init__``
    aside)."""
    out = []
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if not any(part.startswith("_") and part != "__init__" for part in parts):
            out.append(".".join(part for part in parts if part != "__init__"))
    return out


def undeclared(package: Path) -> list[str]:
    """Public modules without an ``__all__`` (what a user may import from them is then not
    declared)."""
    missing = []
    for name in public_modules(package):
        path = package.parent.joinpath(*name.split("."))
        source = (path / "__init__.py") if path.is_dir() else path.with_suffix(".py")
        tree = ast.parse(source.read_text())
        assigned = {
            t.id
            for node in tree.body
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Name)
        }
        if "__all__" not in assigned:
            missing.append(name)
    return missing


def test_every_public_module_declares_its_names_and_they_import():
    package = Path(ddpkit.__file__).parent
    assert not undeclared(package), "declare __all__ (or give the module a leading underscore)"
    public = public_modules(package)
    assert len(public) <= 16 and "ddpkit.cli" in public and "ddpkit.data" in public
    for name in public:
        if name == "ddpkit.search" and importlib.util.find_spec("optuna") is None:
            continue
        module = importlib.import_module(name)
        assert [n for n in module.__all__ if not hasattr(module, n)] == [], name
    assert (
        sum(len(importlib.import_module(n).__all__) for n in public if n != "ddpkit.search") <= 200
    )


def test_a_public_module_without_all_is_flagged(tmp_path):
    """Control: a public module without ``__all__`` is reported; a private one, and one with it, are
    not."""
    package = tmp_path / "ddpkit"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("__all__ = []\n")
    (package / "data" / "__init__.py").write_text("x = 1\n")
    (package / "data" / "_loader.py").write_text("y = 1\n")
    (package / "cli.py").write_text("__all__ = ['main']\n")
    assert undeclared(package) == ["ddpkit.data"]


def test_no_module_reads_another_modules_private_attributes():
    src = Path(ddpkit.__file__).parent
    offenders = []
    for path in sorted(src.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {  # names bound to ddpkit modules in this file
            (a.asname or a.name)
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "ddpkit"
            for a in node.names
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
            ):
                offenders.append(f"{path.name}: {node.value.id}.{node.attr}")
    assert not offenders, offenders


# The extras: each imported by the feature or the command that uses it, never by ``import ddpkit``.
EXTRAS = (
    "ddpkit._launch.agent.forkserver", "ddpkit._launch.rendezvous.backend",
    "ddpkit._launch.rendezvous.auth", "ddpkit._launch.cli.k8s",
    "ddpkit._launch.cli.sbatch", "ddpkit.snapshot._memory", "ddpkit.snapshot._slots",
    "ddpkit.tools", "ddpkit.search", "ddpkit.data._stream_sources", "ddpkit.data._stream",
)  # fmt: skip
LOADED = "import sys\n{}\nprint(' '.join(sorted(m for m in sys.modules if m in {!r})))"


@pytest.mark.heavy
def test_import_ddpkit_loads_none_of_the_extras(run_python):
    done = run_python(LOADED.format("import ddpkit", EXTRAS))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == []
    # Control: a stream adapter taken from ddpkit.data loads its module, and the check sees it.
    done = run_python(LOADED.format("import ddpkit.data\nddpkit.data.JsonlStream", EXTRAS))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ddpkit.data._stream_sources" in done.stdout.split()
