"""Every platform's variables are read in ``ddpkit.platforms`` and nowhere else in the package.

A string constant naming a platform's variable (``SLURM_NTASKS``, a prefix such as ``PET_``,
``RANK``) outside ``platforms/`` is flagged with its file and line, unless it is written there: a
key of a dict literal (the environment a launcher gives its workers), the target of an assignment or
``del``, or the name given to ``pop``/``setdefault``. Docstrings and comments may name variables.
The files below may name them freely.
"""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import ddpkit

PACKAGE = Path(ddpkit.__file__).parent

PLATFORM_VARIABLE = re.compile(
    r"(SLURM_|SGE_|PET_|OMPI_|PMI_|MPI_LOCAL|RAY_|TORCHELASTIC_|KUBERNETES_)[A-Z0-9_]*"
    r"|JOB_COMPLETION_INDEX|NSLOTS|JOB_ID|(LOCAL_|GROUP_|ROLE_)?(RANK|WORLD_SIZE)|MASTER_(ADDR|PORT)"
)

ALLOWED = {
    "platforms": "the platforms themselves",
    "tools/_env.py": "`ddpkit env` lists the variables that are set",
    "_launch/cli/sbatch.py": "writes the batch script that SLURM reads",
    "_launch/cli/k8s.py": "writes the manifests whose operators set the variables",
    "_internals/store.py": "torch's private switch to the agent's store, behind the seam's check",
}
"""Files (or folders) of the package that may name platform variables, and why."""

WRITING_CALLS = frozenset({"pop", "setdefault"})


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the constants that are docstrings (of the module, a class, a function, or an
    attribute)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for statement in body if isinstance(body, list) else []:
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                found.add(id(statement.value))
    return found


def _written(tree: ast.AST) -> set[int]:
    """ids of the constants in a writing position: dict keys, assigned or deleted subscripts,
    pop/setdefault."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            found.update(id(key) for key in node.keys if key is not None)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            found.add(id(node.slice))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in WRITING_CALLS:
                found.add(id(node.args[0]))
    return found


def readers(package: Path) -> list[str]:
    """``path:line: 'NAME'`` for each platform variable named outside the allowed files of
    ``package``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if any(relative == allowed or relative.startswith(f"{allowed}/") for allowed in ALLOWED):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        exempt = _docstrings(tree) | _written(tree)
        named = sorted(
            (node.lineno, node.col_offset, node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and PLATFORM_VARIABLE.fullmatch(node.value)
            and id(node) not in exempt
        )
        found += [f"{relative}:{line}: {name!r}" for line, _, name in named]
    return found


def test_no_module_outside_platforms_reads_a_platform_variable() -> None:
    assert readers(PACKAGE) == []


def _copy(tmp_path: Path, module: str, extra: str) -> Path:
    """The package's ``module`` copied into a package tree under ``tmp_path``, with ``extra``
    appended."""
    copy = tmp_path / "ddpkit" / module
    copy.parent.mkdir(parents=True)
    shutil.copyfile(PACKAGE / module, copy)
    with copy.open("a") as f:
        f.write(extra)
    return copy


def test_a_module_that_reads_slurm_ntasks_is_flagged_by_file_and_line(tmp_path: Path) -> None:
    """Control: a copy of the launcher that reads ``SLURM_NTASKS`` is named with the line of the
    read."""
    copy = _copy(
        tmp_path,
        "_launch/cli/run.py",
        '\n\ndef tasks():\n    return os.environ.get("SLURM_NTASKS")\n',
    )
    line = len(copy.read_text().splitlines())
    assert readers(tmp_path / "ddpkit") == [f"_launch/cli/run.py:{line}: 'SLURM_NTASKS'"]


def test_reads_in_other_forms_are_flagged_and_writes_are_not(tmp_path: Path) -> None:
    """Control: a membership test, a subscript, a prefix and a tuple of names are reads; a dict of
    the workers' variables, an assignment, a pop and a docstring are not."""
    reads = """

def reads(env):
    \"\"\"Reads SLURM_NTASKS.\"\"\"
    a = "RANK" in env
    b = env["MASTER_ADDR"]
    c = [n for n in env if n.startswith("PET_")]
    d = ("OMPI_COMM_WORLD_RANK", "NSLOTS")
    os.environ["TORCHELASTIC_RUN_ID"] = "x"
    os.environ.pop("GROUP_WORLD_SIZE", None)
    return {"WORLD_SIZE": "2"}, a, b, c, d
"""
    copy = _copy(tmp_path, "_launch/agent/worker.py", reads)
    first = len(copy.read_text().splitlines()) - 8  # the line of `def reads`
    assert readers(tmp_path / "ddpkit") == [
        f"_launch/agent/worker.py:{first + 2}: 'RANK'",
        f"_launch/agent/worker.py:{first + 3}: 'MASTER_ADDR'",
        f"_launch/agent/worker.py:{first + 4}: 'PET_'",
        f"_launch/agent/worker.py:{first + 5}: 'OMPI_COMM_WORLD_RANK'",
        f"_launch/agent/worker.py:{first + 5}: 'NSLOTS'",
    ]


def test_the_same_read_inside_platforms_is_not_flagged(tmp_path: Path) -> None:
    _copy(
        tmp_path, "platforms/_slurm.py", '\n\ndef tasks(env):\n    return env.get("SLURM_NTASKS")\n'
    )
    assert readers(tmp_path / "ddpkit") == []
