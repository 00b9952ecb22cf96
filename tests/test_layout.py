"""The test tree mirrors the package: ``tests/unit/<package>/`` holds one process's tests of
``ddpkit.<package>``, ``tests/jobs/<package>/`` its tests with real ranks. Tests of the whole
package (its public API, every format it reads, planted links, the examples, the GPU tier) sit at
the top of ``tests/unit`` or ``tests/jobs``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ddpkit

ROOT = Path(__file__).resolve().parent
PACKAGE = Path(ddpkit.__file__).parent
NOT_TESTS = frozenset({"scripts", "__pycache__"})  # tests/jobs/scripts: the programs the jobs run


def strays(tree: Path, package: Path) -> list[str]:
    """Test folders under ``tree`` that name no subpackage or module of ``package`` (a private one,
    ``_launch``, by its name without the underscore: ``tests/unit/launch``)."""
    names = {p.stem.lstrip("_") for p in package.iterdir() if p.is_dir() or p.suffix == ".py"} - {
        "init",
        "pycache",
    }
    return sorted(
        str(d.relative_to(tree.parent))
        for d in tree.iterdir()
        if d.is_dir() and d.name not in NOT_TESTS and d.name not in names
    )


def test_every_test_folder_names_a_part_of_the_package() -> None:
    assert strays(ROOT / "unit", PACKAGE) == [] and strays(ROOT / "jobs", PACKAGE) == []


def test_a_folder_named_for_nothing_in_the_package_is_flagged(tmp_path: Path) -> None:
    """Control: a folder ``trainers`` (the package has ``training``) is reported, ``training`` is
    not."""
    (tmp_path / "unit" / "trainers").mkdir(parents=True)
    (tmp_path / "unit" / "training").mkdir()
    assert strays(tmp_path / "unit", PACKAGE) == ["unit/trainers"]


def test_no_test_module_is_left_between_the_tiers() -> None:
    """Every test module is under ``unit`` or ``jobs`` (or is a test of the tests' own tooling at
    the top)."""
    top = sorted(p.name for p in ROOT.glob("test_*.py"))
    assert top == ["test_docs.py", "test_layout.py"]


RANKS = frozenset({"run_on_ranks", "spawn"})  # ddpkit.testing.run_on_ranks, ddpkit.spawn


def ranked(tree: Path) -> list[str]:
    """The modules under ``tree`` that run a function on ranks (a call of ``run_on_ranks`` or
    ``spawn``, however imported)."""
    found = []
    for path in sorted(tree.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                owner = func.value if isinstance(func, ast.Attribute) else None
                # a fork server's spawn (``server.spawn``) starts one worker, not ranks
                if name in RANKS and not (isinstance(owner, ast.Name) and owner.id == "server"):
                    found.append(str(path.relative_to(tree.parent)))
                    break
    return found


def test_no_unit_test_runs_ranks() -> None:
    """A unit test is pure logic or a single process: tests with ranks are under ``jobs``."""
    assert ranked(ROOT / "unit") == []


def test_a_unit_module_that_runs_ranks_is_flagged(tmp_path: Path) -> None:
    """Control: ``ddpkit.spawn`` and ``run_on_ranks`` in a unit module are found, a fork server's
    ``spawn`` is not."""
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_a.py").write_text("import ddpkit\nddpkit.spawn(print, 2)\n")
    (tmp_path / "unit" / "test_b.py").write_text("from x import run_on_ranks\nrun_on_ranks(f)\n")
    (tmp_path / "unit" / "test_c.py").write_text("server.spawn(['a'], {}, '.', [0, 1, 2])\n")
    assert ranked(tmp_path / "unit") == ["unit/test_a.py", "unit/test_b.py"]
