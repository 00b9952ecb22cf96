"""What ddpkit's docs generate from the code at build time.

``.. ddpkit-help:: run`` puts the output of ``ddpkit run -h`` in a literal block: the CLI reference
is the parsers' own help, never a copy that drifts.

``.. ddpkit-module:: ddpkit.data`` is ``automodule`` with ``:members:``, leaving out the members
described on another page. A name re-exported by a package (``ddpkit.Trainer``, defined in
``ddpkit.training._trainer``) is described once, where users import it from; an object described
twice is a warning, and the build treats warnings as errors. References by the defining module's
name (type hints, some docstrings) are sent there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import io
import os
import sys
from typing import Any, TypeVar

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles

# Where each class and function is described: a name exported by ``ddpkit`` there, one exported by a
# subpackage's ``__all__`` on that subpackage's page, the rest in the module that defines it. The
# configs have a page of their own (docs/api/configs.md), which names them as listed here.
CONFIGS_PAGE = "configs"
CONFIGS = (
    "ddpkit.TrainerConfig",
    "ddpkit.SnapshotConfig",
    "ddpkit.EarlyStoppingConfig",
    "ddpkit.LoggingConfig",
    "ddpkit.strategies.DDPConfig",
    "ddpkit.strategies.ZeroConfig",
    "ddpkit.strategies.FSDPConfig",
    "ddpkit.search.SearchConfig",
)
# Every public package: the rest of ddpkit is private (a leading underscore in its path) and not
# described.
EXPORTING_PACKAGES = (
    "ddpkit", "ddpkit.data", "ddpkit.distributed", "ddpkit.nn", "ddpkit.snapshot",
    "ddpkit.strategies", "ddpkit.tracking", "ddpkit.training", "ddpkit.platforms", "ddpkit.search",
    "ddpkit.demo", "ddpkit.tools",
    "ddpkit.testing",
)  # fmt: skip


def _keyed(obj: Any) -> bool:
    # ints and strings share ids: never keyed
    return inspect.isclass(obj) or inspect.isfunction(obj)


@functools.cache
def _exports() -> tuple[tuple[str, str, Any], ...]:
    """(page, the name it is described by, object), first match wins, for every re-exported class
    and function."""
    out = []
    for dotted in CONFIGS:
        module, _, name = dotted.rpartition(".")
        out.append((CONFIGS_PAGE, dotted, getattr(importlib.import_module(module), name)))
    for package in EXPORTING_PACKAGES:
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", ()):
            if _keyed(obj := getattr(module, name)):
                out.append((package, f"{package}.{name}", obj))
    return tuple(out)


def _private(dotted: str) -> bool:
    """Whether ``dotted`` names a private module, or a name found only there (no public package
    exports it)."""
    if any(part.startswith("_") and not part.startswith("__") for part in dotted.split(".")):
        return True
    obj = _find(dotted)
    module = getattr(obj, "__module__", None) if obj is not None else None
    return _keyed(obj) and _home(obj) is None and module is not None and _private(module)


def _home(obj: Any) -> tuple[str, str] | None:
    """(page, name) where a re-exported ``obj`` is described; None for the rest (described where
    defined)."""
    return next(((page, name) for page, name, o in _exports() if o is obj), None)


def _find(dotted: str) -> Any:
    """The object a dotted name points to (a module, a class, a member of a class), or None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return None
        return obj
    return None


class ModuleDirective(SphinxDirective):
    """automodule with :members:, less the members whose home is another page."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        name = self.arguments[0]
        module = importlib.import_module(name)
        elsewhere = sorted(
            member
            for member, obj in list(vars(module).items())
            if _keyed(obj) and (home := _home(obj)) is not None and home[0] != name
        )
        lines = [f".. automodule:: {name}", "   :members:"]
        if elsewhere:
            lines.append(f"   :exclude-members: {', '.join(elsewhere)}")
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(
            self.state, StringList(lines, source=self.get_source_info()[0]), node
        )
        return node.children


class HelpDirective(SphinxDirective):
    """The ``-h`` output of one ``ddpkit`` command (``ddpkit`` alone: the command list), run in this
    process."""

    required_arguments = 1

    def run(self) -> list[nodes.Node]:
        from ddpkit import cli

        command = self.arguments[0]
        out = io.StringIO()
        old = os.environ.get("COLUMNS")
        # argparse wraps at $COLUMNS: the page is the same on every machine, and fits it
        os.environ["COLUMNS"] = "88"
        try:
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                cli.main(["-h"] if command == "ddpkit" else [command, "-h"])
        finally:
            if old is None:
                del os.environ["COLUMNS"]
            else:
                os.environ["COLUMNS"] = old
        text = out.getvalue().rstrip()
        if not text:
            raise self.error(f"`ddpkit {command} -h` printed nothing")
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def resolve_by_home(
    app: Sphinx, env: Any, node: Any, contnode: nodes.Element
) -> nodes.Element | None:
    """A reference by the module that defines an object resolves to where the object is described.

    Type hints name ``ddpkit.training._config.TrainerConfig``, described as
    ``ddpkit.TrainerConfig``; a docstring in ``ddpkit.snapshot._run_dir`` names ``ConfigError``,
    which that module imports: found there, as Python would. A TypeVar in a signature is shown as
    text.
    """
    if node.get("refdomain") != "py":
        return None
    target, module = node.get("reftarget", ""), node.get("py:module") or ""
    full = target if target.startswith("ddpkit.") else f"{module}.{target}" if module else target
    domain = env.get_domain("py")
    head, _, attr = full.rpartition(".")
    for owner, rest in ((full, ""), (head, attr)) if full.startswith("ddpkit.") else ():
        obj = _find(owner)
        if isinstance(obj, TypeVar):
            return contnode
        home = _home(obj) if obj is not None else None
        if home is not None and home[1] != owner:
            new = f"{home[1]}.{rest}" if rest else home[1]
            return domain.resolve_xref(
                env, node["refdoc"], app.builder, node["reftype"], new, node, contnode
            )
    # A private module or a name only a private module defines is not described: shown as text, not
    # a link.
    if full.startswith("ddpkit.") and _private(full):
        return contnode
    # A bare name that a module imports only for type checkers (``Trainer`` under ``TYPE_CHECKING``)
    # is not found there at run time: it resolves when exactly one object described in ddpkit has
    # that name.
    if "." not in target:
        named = [
            name
            for name, entry in domain.objects.items()
            if name.startswith("ddpkit.") and name.endswith(f".{target}") and not entry.aliased
        ]
        if len(named) == 1:
            return domain.resolve_xref(
                env, node["refdoc"], app.builder, node["reftype"], named[0], node, contnode
            )
        # A docstring of a re-exported object names its private neighbours bare (``SampleSeeder``).
        if not named and any(
            _private(name) and hasattr(mod, target)
            for name, mod in list(sys.modules.items())
            if name.startswith("ddpkit.") and mod is not None
        ):
            return contnode
    return None


def dataclass_defaults(
    app: Sphinx,
    what: str,
    name: str,
    obj: Any,
    options: Any,
    signature: str | None,
    return_annotation: str | None,
) -> tuple[str | None, str | None] | None:
    """A config's field with a default factory shows as ``snapshot=SnapshotConfig()``, not
    ``<factory>``, which is not Python: Sphinx would then split the signature at every comma, those
    inside types included."""
    if what != "class" or not signature or not dataclasses.is_dataclass(obj):
        return None
    for f in dataclasses.fields(obj):
        if f.default_factory is not dataclasses.MISSING:
            signature = signature.replace("<factory>", f"{f.default_factory.__name__}()", 1)
    return signature, return_annotation


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("ddpkit-module", ModuleDirective)
    app.add_directive("ddpkit-help", HelpDirective)
    app.connect("missing-reference", resolve_by_home)
    app.connect("autodoc-process-signature", dataclass_defaults)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
