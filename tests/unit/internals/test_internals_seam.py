"""Outside :mod:`ddpkit._internals`, ddpkit touches no private code of another project: no
``ctypes``, no ``torch._`` name other than the ``torch._foreach_*`` operators, no private module,
name or attribute of torch, CPython, numpy or Optuna where it can be seen in the source, and no
override of another project's private method.

What the source shows is checked (``ast``): a private name reached through a variable whose type is
only known at run time (``obj._x`` where ``obj`` is one of ddpkit's own objects) cannot be told from
another project's, so every ``x._y`` outside ``self``/``cls`` and ddpkit's own modules is flagged
unless listed below with its reason.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "src" / "ddpkit"
SEAM = PACKAGE / "_internals"

# Names spelled with an underscore that are public where they are used.
PUBLIC_UNDERSCORE_ATTRIBUTES = {
    "_exit": "os._exit: CPython's documented exit without clean-up, for forked children",
    "_fields": "a named tuple's documented field names",
    "_replace": "a named tuple's documented copy with changes",
    "_asdict": "a named tuple's documented dict",
    "_make": "a named tuple's documented constructor from an iterable",
    # ddpkit's own: ShardedBatchSampler._first_step, read by ddpkit's loader on ddpkit's sampler.
    "_first_step": "ddpkit.data._sampler.ShardedBatchSampler's own method",
}
NEUTRAL_BASES = {"object", "Protocol", "Generic", "ABC", "NamedTuple", "TypedDict"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _private_module(module: str) -> bool:
    parts = module.split(".")
    return parts[0] != "ddpkit" and (parts[0] == "ctypes" or any(_private(p) for p in parts))


class _Classes:
    """ddpkit's classes by name: the names each defines (methods, class attributes,
    ``self.x = ...``) and its bases, to tell ``self._x`` of ddpkit's own from one inherited from
    another project's class."""

    def __init__(self, trees: list[ast.Module]) -> None:
        self.own: dict[str, set[str]] = {}
        self.bases: dict[str, list[str]] = {}
        for tree in trees:
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    self.own.setdefault(node.name, set()).update(_defined_in(node))
                    self.bases[node.name] = [_base_name(b) for b in node.bases]

    def names(
        self, cls: str, foreign_imports: set[str], seen: frozenset[str] = frozenset()
    ) -> tuple[set[str], bool]:
        """The names ddpkit defines on ``cls`` and its ddpkit bases; whether another project's class
        is a base."""
        names, foreign = set(self.own.get(cls, ())), False
        for base in self.bases.get(cls, []):
            if base in NEUTRAL_BASES:
                continue
            if "." in base or base in foreign_imports or base not in self.own or base in seen:
                foreign = True
                continue
            more, further = self.names(base, foreign_imports, seen | {cls})
            names |= more
            foreign = foreign or further
        return names, foreign


def _base_name(node: ast.expr) -> str:
    if isinstance(node, ast.Subscript):
        node = node.value
    return ast.unparse(node)


def _defined_in(cls: ast.ClassDef) -> set[str]:
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    for node in ast.walk(cls):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        for target in targets:
            for t in ast.walk(target):
                if (
                    isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name)
                    and t.value.id in ("self", "cls")
                ):
                    names.add(t.attr)
    return names


def private_touches(
    source: str, where: str = "<snippet>", classes: _Classes | None = None
) -> list[str]:
    """Each place in ``source`` that touches private code of another project, as
    ``where:line: what``."""
    tree = ast.parse(source)
    classes = classes or _Classes([tree])
    found: list[str] = []

    def flag(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{getattr(node, 'lineno', 0)}: {what}")

    ours: set[str] = set()  # names bound to ddpkit's own modules and objects
    foreign_imports: set[str] = set()  # names imported from another project
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _private_module(alias.name):
                    flag(node, f"import {alias.name}")
                bound = alias.asname or alias.name.split(".")[0]
                (ours if alias.name.split(".")[0] == "ddpkit" else foreign_imports).add(bound)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or module.split(".")[0] == "ddpkit":
                ours |= {a.asname or a.name for a in node.names}
                continue
            if _private_module(module):
                flag(node, f"from {module} import ...")
            for alias in node.names:
                if _private(alias.name):
                    flag(node, f"from {module} import {alias.name}")
                foreign_imports.add(alias.asname or alias.name)
        elif isinstance(node, ast.Name) and node.id == "ctypes":
            flag(node, "ctypes")
        elif isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            text = (
                node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
            )
            if func in ("__import__", "importlib.import_module", "import_module") and isinstance(
                text, str
            ):
                if _private_module(text):
                    flag(node, f"{func}({text!r})")
            if func in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1:
                name = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
                target = node.args[0]
                public = name in PUBLIC_UNDERSCORE_ATTRIBUTES
                if (
                    isinstance(name, str)
                    and _private(name)
                    and not public
                    and not _self_like(target)
                ):
                    if not (isinstance(target, ast.Name) and target.id in ours):
                        flag(node, f"{func}({ast.unparse(target)}, {name!r})")

    def attribute(node: ast.Attribute) -> None:
        base = node.value
        if isinstance(base, ast.Name) and (base.id in ours or base.id in ("self", "cls")):
            return
        if node.attr.startswith("_foreach_") and ast.unparse(base) == "torch":
            return  # torch's documented multi-tensor operators
        if node.attr in PUBLIC_UNDERSCORE_ATTRIBUTES:
            return
        flag(node, ast.unparse(node)[:100])

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            attribute(node)
    # self._x in a class with another project's base, where ddpkit never defines _x: that project's
    # private.
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        names, foreign = classes.names(cls.name, foreign_imports)
        if not foreign:
            continue
        for node in ast.walk(cls):
            name = None
            if isinstance(node, ast.Attribute) and _self_like(node.value):
                name = node.attr
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "getattr",
                "hasattr",
                "setattr",
            ):
                if (
                    len(node.args) > 1
                    and _self_like(node.args[0])
                    and isinstance(node.args[1], ast.Constant)
                ):
                    name = node.args[1].value
            if isinstance(name, str) and _private(name) and name not in names:
                flag(node, f"{cls.name}: self.{name}, inherited from another project's class")
    return found


def _self_like(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def overridden_privates(cls: type) -> list[str]:
    """The private methods ``cls`` defines in its body that a class of another project in its MRO
    defines too (what a metaclass adds, ``_abc_impl`` or an enum's ``_sunder_`` names, is not
    ddpkit's writing)."""
    found = []
    for name, value in vars(cls).items():
        function = getattr(value, "__func__", value)
        written = inspect.isfunction(function) and function.__qualname__.startswith(
            f"{cls.__qualname__}."
        )
        if not _private(name) or name.endswith("_") or not written:
            continue
        for other in cls.__mro__[1:]:
            if (
                other is not object
                and not other.__module__.startswith("ddpkit")
                and name in vars(other)
            ):
                found.append(
                    f"{cls.__module__}.{cls.__qualname__}.{name} overrides "
                    f"{other.__module__}.{other.__name__}"
                )
                break
    return found


def _sources() -> dict[str, str]:
    return {
        str(p.relative_to(PACKAGE.parent)): p.read_text()
        for p in sorted(PACKAGE.rglob("*.py"))
        if SEAM not in p.parents
    }


def test_outside_the_seam_no_private_code_of_another_project_is_touched() -> None:
    sources = _sources()
    classes = _Classes([ast.parse(s) for s in sources.values()])
    found = [
        line
        for where, source in sources.items()
        for line in private_touches(source, where, classes)
    ]
    found.sort(key=lambda line: (line.split(":")[0], int(line.split(":")[1])))
    assert not found, "private code touched outside ddpkit._internals:\n" + "\n".join(found)


def test_no_class_outside_the_seam_overrides_another_projects_private_method() -> None:
    found = []
    for where, source in _sources().items():
        tree = ast.parse(source)
        if not any(isinstance(n, ast.ClassDef) and n.bases for n in tree.body):
            continue
        module_name = where[: -len(".py")].replace("/", ".").removesuffix(".__init__")
        try:
            module = importlib.import_module(module_name)
        # an optional extra not installed: its classes cannot be looked at
        except ImportError as err:
            if err.name and err.name.split(".")[0] == "ddpkit":
                raise
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                found += overridden_privates(cls)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "import ctypes",
        "import ctypes.util",
        "from ctypes import c_int",
        "lib = __import__('ctypes')",
        "import importlib\nimportlib.import_module('ctypes')",
        "import torch\ntorch._C._get_tracing_state()",
        "import torch as th\nth._dynamo.reset()",
        "import torch._dynamo",
        "from torch._inductor import config",
        "from torch.distributed.checkpoint.filesystem import _StorageInfo",
        "import torch\ntorch._amp_foreach_non_finite_check_and_unscale_(a, b, c)",
        "from torch import nn\nclass B(nn.modules.batchnorm._BatchNorm): pass",
        "def f(handler):\n    return handler._stdout",
        "def f(handler):\n    return getattr(handler, '_stdout', None)",
        "import threading\nthreading._shutdown()",
        "from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent\n"
        "class A(LocalElasticAgent):\n    def f(self):\n        return self._pcontext",
        "from torch.distributed.elastic.agent.server.local_elastic_agent import "
        "LocalElasticAgent\nclass A(LocalElasticAgent):\n    def f(self):\n        return "
        "getattr(self, '_pcontext', None)",
        "class A(Base):\n    def _popen(self):\n        return super()._popen()",
    ],
)
def test_each_kind_of_private_touch_is_flagged(snippet: str) -> None:
    """Control: each kind the guard looks for, written as ddpkit would write it, is found."""
    assert private_touches(snippet), snippet


@pytest.mark.parametrize(
    "snippet",
    [
        "import torch\ntorch._foreach_mul_(grads, 0.5)",
        "import os\nos._exit(1)",
        "def f(batch):\n    return batch._fields",
        "class A:\n    def __init__(self):\n        self._mine = 1\n    def f(self):\n        "
        "return self._mine",
        "from torch import nn\nclass M(nn.Module):\n    def __init__(self):\n        "
        "super().__init__()\n        self._scale = 2\n    def forward(self, x):\n        return x "
        "* self._scale",
        "from ddpkit.search import study\nstudy._SEARCH_KEY",
        "from . import helpers\nhelpers._private_helper()",
        "x.__class__.__name__",
    ],
)
def test_public_names_and_ddpkits_own_are_not_flagged(snippet: str) -> None:
    assert private_touches(snippet) == [], snippet


def test_an_override_of_another_projects_private_method_is_flagged() -> None:
    import threading

    class Overrides(threading.Thread):
        def _bootstrap(self) -> None:  # threading.Thread's private
            pass

    class Adds(threading.Thread):
        def _helper(self) -> None:
            pass

    assert overridden_privates(Overrides) and overridden_privates(Adds) == []
