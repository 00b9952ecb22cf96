"""The house's weight, counted: what docs/architecture.md's table holds, and what a change to the
package's shape is measured by.

    python scripts/house_counts.py [--src src/ddpkit] [--trace] [--names]

Prints, for the package under ``--src``: its lines; docstring and comment lines over the other
lines (code and blank); docstrings over 20 lines; functions over 60 lines; classes named
``*Snapshot*``; the package's modules loaded by ``import ddpkit``; circles of modules that import
each other (at their top or inside a function; an ``if TYPE_CHECKING:`` import is none).
``--trace`` also runs a 2-rank Trainer job (``ddpkit.spawn``) and counts, on rank 0 with
``sys.setprofile``, the package's files and functions one step cycle calls (from one step's end to
the next's) and a snapshot saved and resumed into a new Trainer calls.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import subprocess
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def prose_and_code(text: str) -> tuple[int, int]:
    """Lines of docstrings and comments, and lines of code (blank lines in neither)."""
    prose: set[int] = set()
    code: set[int] = set()
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            if isinstance(node.value.value, str):
                prose.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            if tok.line.strip().startswith("#"):
                prose.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):  # fmt: skip
            for line in range(tok.start[0], tok.end[0] + 1):
                if line not in prose:
                    code.add(line)
    return len(prose), len(code - prose)


def imports_of(path: Path, module: str, modules: set[str]) -> set[str]:
    """The package's modules that ``module`` imports, at its top or inside a function, but not under
    ``if TYPE_CHECKING:``; ``from package import name`` names the module ``package.name`` where
    there is one."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
                for other in child.orelse:
                    visit(other)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name in modules)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                for alias in child.names:
                    named = f"{base}.{alias.name}"
                    found.add(named if named in modules else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    return (found & modules) - {module}


def import_circles(src: Path) -> list[str]:
    """The package's modules that import each other in a circle (each circle's modules, sorted)."""
    paths = {
        ".".join(p.relative_to(src.parent).with_suffix("").parts): p for p in src.rglob("*.py")
    }
    paths = {m.removesuffix(".__init__"): p for m, p in paths.items()}
    graph = {m: imports_of(p, m, set(paths)) for m, p in paths.items()}
    reach = {m: set(graph[m]) for m in graph}  # what each module reaches, by any number of imports
    changed = True
    while changed:
        changed = False
        for m in reach:
            more = set().union(*(reach[n] for n in reach[m])) - reach[m]
            if more:
                reach[m] |= more
                changed = True
    circles = {tuple(sorted(n for n in reach[m] if m in reach[n])) for m in reach if m in reach[m]}
    return [" ".join(c) for c in sorted(circles)]


def static_counts(src: Path) -> dict[str, object]:
    lines = prose = 0
    long_docs: list[str] = []
    long_functions: list[str] = []
    snapshot_classes: list[str] = []
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        lines += text.count("\n")
        prose += prose_and_code(text)[0]
        tree = ast.parse(text)
        name = str(path.relative_to(src.parent))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc is not None and doc.count("\n") + 1 > 20:
                    long_docs.append(f"{name}:{getattr(node, 'name', '<module>')}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (node.end_lineno or node.lineno) - node.lineno + 1 > 60:
                    long_functions.append(f"{name}:{node.name}")
            if isinstance(node, ast.ClassDef) and "Snapshot" in node.name:
                snapshot_classes.append(f"{name}:{node.name}")
    imported = subprocess.run(
        [sys.executable, "-c", "import sys, ddpkit; "
         "print(sum(1 for m in sys.modules if m == 'ddpkit' or m.startswith('ddpkit.')))"],
        capture_output=True, text=True, check=True, env={"PYTHONPATH": str(src.parent)},
    )  # fmt: skip
    return {
        "lines": lines,
        "prose_over_code": round(prose / (lines - prose), 3),
        "docstrings_over_20_lines": len(long_docs),
        "functions_over_60_lines": len(long_functions),
        "snapshot_classes": len(snapshot_classes),
        "modules_at_import": int(imported.stdout),
        "import_circles": len(circles := import_circles(src)),
        "long_docstrings": long_docs,
        "long_functions": long_functions,
        "snapshot_class_names": snapshot_classes,
        "import_circle_modules": circles,
    }


TRACE = r"""
import json, sys, tempfile, torch
from pathlib import Path
import ddpkit
from ddpkit import SnapshotConfig, Trainer, TrainerConfig, LoggingConfig

PACKAGE = str(Path(ddpkit.__file__).parent)


class Seen:
    def __init__(self):
        self.files, self.functions, self.on = set(), set(), False

    def __call__(self, frame, event, arg):
        if self.on and event in ("call", "c_call") and frame.f_code.co_filename.startswith(PACKAGE):
            self.files.add(frame.f_code.co_filename)
            self.functions.add((frame.f_code.co_filename, frame.f_code.co_name))


def build(run_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
    config = TrainerConfig(run_dir=run_dir, epochs=1, batch_size=8, resume=True,
                           logging=LoggingConfig(progress=False),
                           snapshot=SnapshotConfig(every_epochs=0, async_write=False))
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, config,
                   loss_fn=torch.nn.functional.cross_entropy)


def job(run_dir):
    rank = ddpkit.init().rank
    seen = Seen()
    sys.setprofile(seen)

    class Cycle:
        def on_step_end(self, trainer, taken, output):
            if trainer.step == 5:
                seen.on = True
            elif trainer.step == 6:
                seen.on = False

    trainer = build(run_dir)
    trainer.callbacks.append(Cycle())
    trainer.config.max_steps = 8
    trainer.fit()
    step, step_files = (len(seen.files), len(seen.functions)), set(seen.files)
    round_trip = Seen()
    sys.setprofile(round_trip)
    round_trip.on = True
    trainer.save()
    trainer.wait_for_snapshot()
    again = build(run_dir)
    again.snapshots.resume(again.load_state_dict)
    round_trip.on = False
    sys.setprofile(None)
    short = lambda files: sorted(f[len(PACKAGE):] for f in files)
    return {"step_cycle_files": step[0], "step_cycle_functions": step[1],
            "snapshot_round_trip_files": len(round_trip.files),
            "snapshot_round_trip_functions": len(round_trip.functions),
            "step_cycle_file_names": short(step_files),
            "snapshot_round_trip_file_names": short(round_trip.files)} if rank == 0 else None


out = ddpkit.spawn(job, 2, args=(tempfile.mkdtemp(),))
print(json.dumps(out[0]))
"""


def traced_counts(src: Path) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", TRACE], capture_output=True, text=True, timeout=600,
        env={"PYTHONPATH": str(src.parent), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--src", default=str(ROOT / "src" / "ddpkit"))
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--names", action="store_true", help="list the long docstrings, ...")
    a = parser.parse_args()
    counts = static_counts(Path(a.src))
    if a.trace:
        counts |= traced_counts(Path(a.src))
    for key, value in counts.items():
        if isinstance(value, list):
            if a.names:
                print(f"{key}:\n  " + "\n  ".join(value))
        else:
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()
