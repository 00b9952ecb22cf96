"""Sphinx configuration of ddpkit's docs. Build (offline; seconds):

    .venv/bin/python -m sphinx -W --keep-going -n -b html docs docs/_build/html

Markdown pages through myst; the API reference by autodoc from the docstrings; the CLI reference
from the argparse parsers (docs/_ext/ddpkit_docs.py). Nitpicky: a reference that does not resolve is
an error.
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent / "src"))  # the checkout's ddpkit, installed or not

import ddpkit  # noqa: E402

project = "ddpkit"
copyright = "the ddpkit authors"
release = version = ddpkit.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "ddpkit_docs"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3  # [text](#a-heading) links within and across pages

html_theme = "furo"
html_title = f"ddpkit {release}"
html_static_path = ["_static"]
html_css_files = ["tables.css"]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
# A method without a docstring of its own shows none: torch's (nn.Module.forward's) would cite names
# of torch.
autodoc_inherit_docstrings = False

nitpicky = True
# No intersphinx: the build runs offline, so names of other projects (torch, optuna, the standard
# library beyond builtins and typing) have no inventory to resolve against. They are shown as text,
# not links. Only dotted names under these top-level modules are let through; any other dotted name
# (``Stream.read`` written without its module, a ``ddpkit.`` name that moved) must resolve, so a
# broken reference fails the build.
OUTSIDE = (
    "torch",
    "numpy",
    "np",
    "fcntl",
    "optuna",
    "mlflow",
    "wandb",
    "safetensors",
    "tensorboard",
    "mpi4py",
    "sklearn",
    "collections",
    "typing",
    "os",
    "pathlib",
    "multiprocessing",
    "concurrent",
    "socket",
    "threading",
    "subprocess",
    "signal",
    "contextlib",
    "dataclasses",
    "enum",
    "types",
    "io",
    "json",
    "logging",
    "abc",
    "argparse",
    "datetime",
    "random",
    "queue",
    "weakref",
    "re",
    "functools",
    "itertools",
    "asyncio",
)
nitpick_ignore_regex = [
    (r"py:.*", rf"(?:{'|'.join(OUTSIDE)})\..+"),
]
