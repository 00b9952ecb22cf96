"""Mark ddpkit's internal modules private (issue 40, item 1): a one-off refactoring tool, safe to
run again.

    python scripts/privatize.py [--root .] [--dry-run] [--no-ruff]

What a user imports is ``ddpkit`` and the ``__init__`` of each public subpackage; every other module
gets a leading underscore (PEP 8), as Lightning Fabric marks its internals:

1. ``git mv``: each module ``ddpkit/<public package>/foo.py`` becomes ``_foo.py``, each subpackage
   below a public package ``bar/`` becomes ``_bar/`` (its own modules keep their names: the folder
   already marks them), and the packages and modules of :data:`PRIVATE_TOP` become private whole.
2. Every reference in :data:`SCOPE` is rewritten: dotted module paths (imports, monkeypatch targets,
   ``python -m`` lines, Sphinx targets), file paths (``ddpkit/launch/agent.py``), and
   ``from P import mod`` of a renamed module (``from P import _mod as mod``, so the code that uses
   ``mod`` is unchanged). A dotted name is rewritten component by component, so
   ``ddpkit.data.loader_x`` is never taken for ``ddpkit.data.loader``.
3. In the pages users read (docs/, README.md, examples/), an import or a dotted name of a name that
   a public package re-exports (:data:`USER_HOMES`, :data:`USER_NAMES`) is rewritten to the public
   place.
4. docs/api: the sections of private modules are dropped (the reference documents the ``__all__`` of
   the public packages only), and a page whose own package is private is removed with its toctree
   entry.
5. ``ruff check --fix --select I`` and ``ruff format`` on the Python files it changed (imports
   re-sorted).

Running it twice changes nothing: the renames are computed from the tree (a module already private
is left alone), and an old path whose private twin exists is still rewritten (stale references from
a later merge).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
import sys
from pathlib import Path

# Top-level parts of ddpkit that are public: the package itself, its entry point, the testing
# helpers, and the subpackages users import from. Every other top-level package or module is private
# whole (PRIVATE_TOP).
PUBLIC_TOP_MODULES = ("__init__", "cli", "testing")
PUBLIC_PACKAGES = (
    "data", "distributed", "training", "snapshot", "strategies", "tracking", "search", "nn", "demo", "platforms",
    "tools",
)  # fmt: skip
PRIVATE_TOP = ("internals", "launch", "fs", "errors")

SCOPE = (
    "src", "tests", "docs", "examples", "bench", "scripts", ".ci", "README.md", "pyproject.toml", "MANIFEST.in",
    ".pre-commit-config.yaml",
)  # fmt: skip
SUFFIXES = {
    ".py",
    ".md",
    ".rst",
    ".toml",
    ".sh",
    ".txt",
    ".cfg",
    ".ini",
    ".yml",
    ".yaml",
    ".in",
    "",
}
USER_PAGES = ("docs", "README.md", "examples")

# Where a user imports a module's names from once the module is private (the names must be in that
# package's ``__all__``). Used for the imports in USER_PAGES only: inside the package, imports stay
# on the defining module (no import cycles through the package's ``__init__``).
USER_HOMES = {
    "ddpkit.demo.datasets": "ddpkit.demo",
    "ddpkit.demo.models": "ddpkit.demo",
    "ddpkit.data.stream_sources": "ddpkit.data",
    "ddpkit.data.stream": "ddpkit.data",
    "ddpkit.training.config": "ddpkit",
    "ddpkit.training.trainer": "ddpkit",
}
# Dotted names in USER_PAGES: old -> the public name (the old name, through the private module,
# still works).
USER_NAMES = {
    "ddpkit.nn.dropout.GlobalBatchDropout": "ddpkit.nn.GlobalBatchDropout",
    "ddpkit.nn.batchnorm.CPUSyncBatchNorm": "ddpkit.nn.CPUSyncBatchNorm",
    "ddpkit.data.stream.Stream": "ddpkit.data.Stream",
    "ddpkit.training.step.loss_divisor": "ddpkit.training.loss_divisor",
    "ddpkit.training.step_output.StepOutput": "ddpkit.training.StepOutput",
    "ddpkit.snapshot.manager.SnapshotManager": "ddpkit.snapshot.SnapshotManager",
    "ddpkit.snapshot.schedule.SnapshotSchedule": "ddpkit.snapshot.SnapshotSchedule",
    "ddpkit.platforms.base.Platform": "ddpkit.platforms.Platform",
    "ddpkit.distributed.runtime.NotInitializedError": "ddpkit.distributed.NotInitializedError",
    "ddpkit.distributed.seeding.seed_rank": "ddpkit.distributed.seed_rank",
    "ddpkit.distributed.seeding.mix_seed": "ddpkit.distributed.mix_seed",
    "ddpkit.distributed.signals.pending_stop_signal": "ddpkit.distributed.pending_stop_signal",
    "ddpkit.demo.models.TinyGPT": "ddpkit.demo.TinyGPT",
    "ddpkit.demo.datasets.python_source": "ddpkit.demo.python_source",
    "ddpkit.data.stream_sources": "ddpkit.data",
    "ddpkit.tools.workload.Workload": "ddpkit.tools.Workload",
}

DOTTED = re.compile(r"(?<![\w.])ddpkit(?:\.[A-Za-z_]\w*)+")
SLASHED = re.compile(r"(?<![\w.])ddpkit(?:/[A-Za-z_]\w*)+(?:\.py\b)?")
ITEM = re.compile(r"(?<![\w.])([A-Za-z_]\w*)(\s+as\s+\w+)?")
REL_PATH = re.compile(r"(?<=[\"'])([a-z][a-z_0-9]*(?:/[A-Za-z_]\w*)*)(\.py|/)(?=[\"':])")
# Path(...) / "ddpkit" / "launch" / "proctree.py"
JOINED = re.compile(r'"ddpkit"((?:\s*/\s*"[\w.]+")+)')
FROM_IMPORT = re.compile(r"^(\s*from\s+)(ddpkit(?:\.\w+)*)(\s+import\s+)(\([^)]*\)|[^\n]*)", re.M)


def renames(package: Path) -> dict[str, str]:
    """Old dotted module name -> new, for every module or package the run moves (or moved before: an
    old name whose private twin exists maps there, so that references a later merge brought back are
    rewritten too)."""
    moves: dict[str, str] = {}

    def private(parent: str, path: Path) -> None:
        stem = path.stem if path.suffix == ".py" else path.name
        if (
            stem.startswith("_")
            or stem == "__pycache__"
            or not (path.suffix == ".py" or path.is_dir())
        ):
            return
        moves[f"{parent}.{stem}"] = f"{parent}._{stem}"

    def twins(parent: str, folder: Path) -> None:
        for path in folder.iterdir():
            stem = path.stem if path.suffix == ".py" else path.name
            if (
                stem.startswith("_")
                and not stem.startswith("__")
                and (path.suffix == ".py" or path.is_dir())
            ):
                old = folder / (stem[1:] + path.suffix)
                if not old.exists():
                    moves.setdefault(f"{parent}.{stem[1:]}", f"{parent}.{stem}")

    for name in PRIVATE_TOP:
        for path in (package / name, package / f"{name}.py"):
            if path.exists():
                private("ddpkit", path)
    twins("ddpkit", package)
    for name in PUBLIC_PACKAGES:
        folder = package / name
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            private(f"ddpkit.{name}", path)
        twins(f"ddpkit.{name}", folder)
    return {old: new for old, new in moves.items() if old != new}


def rename_dotted(name: str, moves: dict[str, str]) -> str:
    """``ddpkit.launch.agent.main`` -> ``ddpkit._launch.agent.main``: the longest moved prefix is
    replaced, component by component, and again below it (a module inside a moved package may move
    too)."""
    parts = name.split(".")
    done = 1
    while done < len(parts):
        for cut in range(len(parts), done, -1):
            head = ".".join(parts[:cut])
            if head in moves:
                new = moves[head].split(".")
                parts = new + parts[cut:]
                done = len(new)
                break
        else:
            break
    return ".".join(parts)


def package_paths(text: str, moves: dict[str, str], package: Path) -> str:
    """Paths relative to the package in a string (``"launch/worker.py"``, ``"fs/"``), rewritten only
    where the renamed path is a module or package that exists: ``tmp_path / "fs"`` or
    ``"data/train.py"`` stay."""

    def one(m: re.Match[str]) -> str:
        path, end = m.group(1), m.group(2)
        new = (
            rename_dotted("ddpkit." + path.replace("/", "."), moves)
            .removeprefix("ddpkit.")
            .replace(".", "/")
        )
        target = package / (new + ".py" if end == ".py" else new)
        return new + end if new != path and target.exists() else m.group(0)

    def joined(m: re.Match[str]) -> str:
        parts = re.findall(r'"([\w.]+)"', m.group(1))
        py = parts[-1].endswith(".py")
        dotted = ".".join(["ddpkit", *parts[:-1], parts[-1].removesuffix(".py")])
        new = rename_dotted(dotted, moves).split(".")[1:]
        if py:
            new[-1] += ".py"
        return '"ddpkit"' + "".join(f' / "{part}"' for part in new)

    return JOINED.sub(joined, REL_PATH.sub(one, text))


def rewrite(text: str, moves: dict[str, str], user_page: bool, package: Path | None = None) -> str:
    text = DOTTED.sub(lambda m: rename_dotted(m.group(0), moves), text)
    if package is not None:
        text = package_paths(text, moves, package)

    def slashed(m: re.Match[str]) -> str:
        path = m.group(0)
        py = path.endswith(".py")
        dotted = rename_dotted(path[: -3 if py else None].replace("/", "."), moves)
        return dotted.replace(".", "/") + (".py" if py else "")

    text = SLASHED.sub(slashed, text)

    def from_import(m: re.Match[str]) -> str:
        parent = m.group(2)
        children = {}
        for old, new in moves.items():
            head, _, child = old.rpartition(".")
            new_head, _, new_child = new.rpartition(".")
            if head == parent and new_head == parent:
                children[child] = new_child

        def item(n: re.Match[str]) -> str:
            name, alias = n.group(1), n.group(2)
            if name not in children:
                return n.group(0)
            return f"{children[name]}{alias or f' as {name}'}"

        # Item by item (``name`` or ``name as alias``), so that an alias is never taken for a name;
        # comments are left alone.
        lines = [
            ITEM.sub(item, code) + comment
            for code, comment in (
                re.match(r"([^#]*)(.*)", line).groups() for line in m.group(4).split("\n")
            )  # type: ignore[union-attr]
        ]
        return m.group(1) + parent + m.group(3) + "\n".join(lines)

    text = FROM_IMPORT.sub(from_import, text)
    if user_page:
        text = user_imports(text, moves)
    return text


def user_imports(text: str, moves: dict[str, str]) -> str:
    """In a page users read: imports and dotted names of re-exported names point at the public
    package."""
    homes = {rename_dotted(old, moves): new for old, new in USER_HOMES.items()}
    names = {rename_dotted(old, moves): new for old, new in USER_NAMES.items()}

    def home(m: re.Match[str]) -> str:
        target = homes.get(m.group(2))
        return m.group(0) if target is None else m.group(1) + target + m.group(3) + m.group(4)

    text = FROM_IMPORT.sub(home, text)
    return DOTTED.sub(lambda m: names.get(m.group(0), m.group(0)), text)


API_SECTION = re.compile(
    r"^#+ `(ddpkit[\w.]*)`\n+```\{eval-rst\}\n\.\. ddpkit-module:: \1\n```\n*", re.M
)
API_TITLE = re.compile(
    r"\A# [^\n]*\n+```\{eval-rst\}\n\.\. ddpkit-module:: (ddpkit[\w.]*)\n```", re.M
)


def private_dotted(name: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in name.split("."))


def api_pages(root: Path, dry_run: bool) -> list[str]:
    """Drop the API reference's sections of private modules, and the pages of private packages."""
    done = []
    folder = root / "docs" / "api"
    if not folder.is_dir():
        return done
    index = folder / "index.md"
    for page in sorted(folder.glob("*.md")):
        text = page.read_text()
        title = API_TITLE.match(text)
        if title and private_dotted(title.group(1)):
            done.append(f"git rm {page.relative_to(root)}")
            if not dry_run:
                subprocess.run(["git", "rm", "-qf", str(page)], cwd=root, check=True)
                lines = index.read_text().splitlines(keepends=True)
                index.write_text("".join(line for line in lines if line.strip() != page.stem))
            continue
        own = title.group(1) if title else None
        new = (
            API_SECTION.sub(
                lambda m, own=own: (
                    "" if private_dotted(m.group(1)) or m.group(1) == own else m.group(0)
                ),
                text,
            ).rstrip("\n")
            + "\n"
        )
        if new != text:
            done.append(f"rewrote {page.relative_to(root)}")
            if not dry_run:
                page.write_text(new)
    return done


def files(root: Path) -> list[Path]:
    tracked = subprocess.run(
        ["git", "ls-files", "-z", *SCOPE], cwd=root, capture_output=True, check=True
    ).stdout
    out = []
    for rel in tracked.decode().split("\0"):
        path = root / rel
        if rel and path.is_file() and path.suffix in SUFFIXES and rel != "scripts/privatize.py":
            out.append(path)
    return out


def git_mv(
    root: Path, package: Path, moves: dict[str, str], dry_run: bool
) -> list[tuple[str, str]]:
    """Move every module of ``moves`` that is still at its old place, parents first (a package moved
    whole takes its modules with it)."""
    done = []
    for old in sorted(moves, key=lambda name: name.count(".")):
        rel_old = Path(*old.split(".")[1:])
        rel_new = Path(*rename_dotted(old, moves).split(".")[1:])
        for src, dst in (
            (rel_old, rel_new),
            (rel_old.with_suffix(".py"), rel_new.with_suffix(".py")),
        ):
            if (package / src).exists() and not (package / dst).exists():
                done.append((f"ddpkit/{src}", f"ddpkit/{dst}"))
                if not dry_run:
                    subprocess.run(
                        ["git", "mv", str(package / src), str(package / dst)], cwd=root, check=True
                    )
    return done


def check_public_imports(package: Path) -> list[str]:
    """Imports inside the package of a module the run made private through its public parent
    (``from ddpkit.data import loader``) would bind the package's attribute, not the module: listed
    to fix by hand."""
    problems = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("ddpkit")
            ):
                for alias in node.names:
                    target = package.parent / Path(*node.module.split("."), alias.name)
                    if target.with_suffix(".py").exists() or target.is_dir():
                        continue
                    twin = target.with_name("_" + alias.name)
                    if twin.with_suffix(".py").exists() or twin.is_dir():
                        problems.append(f"{path}: from {node.module} import {alias.name}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument(
        "--dry-run", action="store_true", help="print the moves and the files it would change"
    )
    parser.add_argument(
        "--no-ruff", action="store_true", help="leave the import order and the format alone"
    )
    args = parser.parse_args(argv)
    root = args.root.resolve()
    package = root / "src" / "ddpkit"
    if not (package / "__init__.py").exists():
        parser.error(f"--root {root}: no src/ddpkit/__init__.py there; give the tree's root")
    moves = renames(package)
    for src, dst in git_mv(root, package, moves, args.dry_run):
        print(f"git mv {src} {dst}")
    changed = []
    for path in files(root):
        rel = path.relative_to(root)
        # The API reference's headings name modules, which step 4 drops when private: left to it.
        user_page = rel.parts[0] in USER_PAGES and rel.parts[:2] != ("docs", "api")
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        # Package-relative paths are rewritten in the code only (tests name modules by them).
        code = path.suffix == ".py" and rel.parts[0] in ("src", "tests")
        new = rewrite(text, moves, user_page, package if code else None)
        if new != text:
            changed.append(path)
            if not args.dry_run:
                path.write_text(new)
    for path in changed:
        print(f"rewrote {path.relative_to(root)}")
    for line in api_pages(root, args.dry_run):
        print(line)
    python = [str(p) for p in changed if p.suffix == ".py"]
    if python and not args.dry_run and not args.no_ruff:
        ruff = [sys.executable, "-m", "ruff"]
        subprocess.run(
            [*ruff, "check", "--fix", "--select", "I", "--quiet", *python], cwd=root, check=False
        )
        subprocess.run([*ruff, "format", "--quiet", *python], cwd=root, check=False)
    for line in check_public_imports(package):
        print(f"check by hand: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
