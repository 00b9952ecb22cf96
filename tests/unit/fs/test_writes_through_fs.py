"""Every write of ddpkit goes through :mod:`ddpkit._fs`: a scan of the package's source for the
calls that write, replace, truncate, rename, delete or create files and folders by path, anywhere
but ``ddpkit/_fs/``.

A new write that bypasses the module fails here; a true exception is added to ``ALLOWED`` with its
reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ddpkit

PACKAGE = Path(ddpkit.__file__).parent

ALLOWED: dict[tuple[str, str], str] = {
    (
        "snapshot/_folders.py",
        "os.unlink",
    ): "prune: the marker first, relative to a descriptor of its step folder opened O_NOFOLLOW "
    "(a link has none); the folder then goes by ddpkit._fs.remove_tree_in",
    (
        "_launch/agent/forkserver.py",
        "os.open",
    ): "os.devnull opened read-write for a child's standard streams",
    (
        "_internals/interpreter.py",
        "open",
    ): "/proc/self/mem opened r+b to rename the process: its memory, not a file",
}
"""``(module, call)``: why that module may make that call itself."""

_OS_PATH_CALLS = {
    "replace", "rename", "renames", "unlink", "remove", "rmdir", "removedirs", "mkdir", "makedirs",
    "truncate", "symlink", "link", "mkfifo", "mknod", "chmod", "chown",
}  # fmt: skip
_SHUTIL_CALLS = {
    "rmtree",
    "move",
    "copy",
    "copy2",
    "copyfile",
    "copytree",
    "copymode",
    "copystat",
    "make_archive",
}
_PATH_METHODS = {
    "write_text",
    "write_bytes",
    "unlink",
    "mkdir",
    "rename",
    "touch",
    "rmdir",
    "symlink_to",
    "hardlink_to",
    "chmod",
}
_WRITE_FLAGS = {"O_CREAT", "O_WRONLY", "O_RDWR", "O_TRUNC", "O_APPEND"}
_TO_FILE_OBJECT = {"savefig": 0, "save": 1, "savez": 0, "savetxt": 0, "tofile": 0}
"""Calls that write to their argument at this position: fine into a file object (``io.BytesIO``, the
file :func:`ddpkit._fs.write_with` hands a callback), not to a path."""


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return "?"


def _file_objects(tree: ast.AST) -> set[str]:
    """Names bound to an ``io.BytesIO()``/``io.StringIO()``, and the parameters of lambdas
    (callbacks of :func:`ddpkit._fs.write_with`, handed its file)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            if _name(node.value.func).split(".")[-1] in ("BytesIO", "StringIO"):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.Lambda):
            names |= {a.arg for a in node.args.args}
    return names


def _writes(call: ast.Call, file_objects: set[str]) -> str | None:
    """The call's name if it writes by path, else None."""
    func = call.func
    full = _name(func)
    if isinstance(func, ast.Name) and func.id == "open":
        mode = (
            call.args[1]
            if len(call.args) > 1
            else next((k.value for k in call.keywords if k.arg == "mode"), None)
        )
        if mode is None:
            return None
        if not isinstance(mode, ast.Constant) or set(str(mode.value)) & set("wax+"):
            return "open"
        return None
    if not isinstance(func, ast.Attribute):
        return None
    receiver = _name(func.value)
    if receiver == "fs" or receiver.startswith("fs.") or receiver == "dataclasses":
        return None
    if full == "os.open":
        flags = (
            {n.attr for n in ast.walk(call.args[1]) if isinstance(n, ast.Attribute)}
            if len(call.args) > 1
            else set()
        )
        return "os.open" if flags & _WRITE_FLAGS else None
    if receiver == "os":
        return full if func.attr in _OS_PATH_CALLS else None
    if receiver == "shutil":
        return full if func.attr in _SHUTIL_CALLS else None
    if func.attr in _PATH_METHODS:
        return f".{func.attr}"
    # Path.replace, not str.replace
    if func.attr == "replace" and len(call.args) == 1 and not call.keywords:
        return ".replace"
    if func.attr in _TO_FILE_OBJECT and (
        func.attr != "save" or receiver in ("torch", "np", "numpy")
    ):
        at = _TO_FILE_OBJECT[func.attr]
        target = call.args[at] if len(call.args) > at else None
        if isinstance(target, ast.Name) and target.id in file_objects:
            return None
        return f"{receiver}.{func.attr}" if func.attr == "save" else f".{func.attr}"
    return None


def bypasses(source: str) -> list[tuple[int, str]]:
    """``(line, call)`` of each write by path in ``source``."""
    tree = ast.parse(source)
    file_objects = _file_objects(tree)
    return [
        (node.lineno, what)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and (what := _writes(node, file_objects)) is not None
    ]


def test_every_write_of_the_package_goes_through_ddpkit_fs():
    found = []
    used = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module.startswith("_fs/"):
            continue
        for line, what in bypasses(path.read_text()):
            if (module, what) in ALLOWED:
                used.add((module, what))
            else:
                found.append(f"src/ddpkit/{module}:{line}: {what}(...)")
    assert not found, (
        "writes that bypass ddpkit._fs (use fs.write_atomic, fs.write_with, fs.open_append, "
        "fs.make_dirs, fs.remove, fs.rename...; or add the call to ALLOWED with "
        "its reason):\n" + "\n".join(found)
    )
    assert used == set(ALLOWED), f"ALLOWED entries no longer needed: {sorted(set(ALLOWED) - used)}"


@pytest.mark.parametrize(
    "source, call",
    [
        ("open(p, 'w')", "open"),
        ("open(p, mode='ab')", "open"),
        ("open(p, m)", "open"),
        ("os.open(p, os.O_RDWR | os.O_CREAT)", "os.open"),
        ("os.replace(a, b)", "os.replace"),
        ("os.unlink(p)", "os.unlink"),
        ("shutil.rmtree(p)", "shutil.rmtree"),
        ("shutil.copyfile(a, b)", "shutil.copyfile"),
        ("Path(p).write_text('x')", ".write_text"),
        ("p.mkdir(parents=True)", ".mkdir"),
        ("tmp.replace(path)", ".replace"),
        ("p.touch()", ".touch"),
        ("a.tofile(tmp)", ".tofile"),
        ("fig.savefig(path)", ".savefig"),
        ("torch.save(state, path)", "torch.save"),
    ],
)
def test_the_scan_finds_each_kind_of_write(source, call):
    # Controls for the scan: each pattern the old code used (``os.open(O_RDWR | O_CREAT)`` for the
    # search lock, ``tmp.replace`` of a fixed temporary name, ``savefig(path)``, ``tofile(tmp)``) is
    # found.
    assert bypasses(source) == [(1, call)]


@pytest.mark.parametrize(
    "source",
    [
        "open(p)",
        "open(p, 'rb')",
        "os.open(p, os.O_RDONLY | os.O_NOFOLLOW)",
        "'a-b'.replace('-', '_')",
        "dataclasses.replace(x, a=1)",
        "fs.write_atomic(p, b'')",
        "b = io.BytesIO()\ntorch.save(state, b)\nfig.savefig(b, format='png')",
        "fs.write_with(p, lambda f: fig.savefig(f, format='png'))",
    ],
)
def test_the_scan_passes_reads_and_writes_through_the_module(source):
    assert bypasses(source) == []
