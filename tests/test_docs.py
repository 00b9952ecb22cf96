"""The docs say what the code does: every python block of the README and of docs/ runs as written,
each in a fresh process in an empty folder, and every test the docs cite exists.

A block that is a sketch (it uses names the reader supplies) is marked with the line
``<!-- not run: why -->`` right before its opening fence; the marker is invisible on a rendered
page. Blocks of other languages (``bash``, ``text``) are not run. The Sphinx build itself (warnings
as errors) is CI's, not a test here.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

# at any test depth
ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES = [p for p in PAGES if "_build" not in p.relative_to(ROOT).parts]
_BLOCK = re.compile(r"(?:^(<!-- not run[^\n]*-->)\n)?^```python\n(.*?)^```", re.M | re.S)
_FENCE = re.compile(r"^(`{3,}).*?^\1", re.M | re.S)


def blocks() -> list[tuple[str, int, str | None, str]]:
    """(page, line of the block's first line of code, its not-run marker or None, the code)."""
    found = []
    for page in PAGES:
        text = page.read_text()
        name = str(page.relative_to(ROOT))
        found += [
            (name, text[: m.start(2)].count("\n") + 1, m.group(1), m.group(2))
            for m in _BLOCK.finditer(text)
        ]
    return found


# Pages Sphinx writes itself into the site's root: a source page of the same name is overwritten by
# them.
SPHINX_PAGES = frozenset({"search", "genindex", "py-modindex"})
CODE_WIDTH = 88  # characters of a code line that the page shows whole


def built_name(source: Path) -> str:
    """The page a source under docs/ becomes: ``docs/api/data.md`` -> ``api/data`` (``.html`` left
    out)."""
    return source.relative_to(ROOT / "docs").with_suffix("").as_posix()


def page_name_clashes(names: list[str]) -> list[str]:
    """The built page names that Sphinx overwrites with a page of its own, or that two sources share
    (on a case-insensitive file system too)."""
    clashes = [
        f"{name}: Sphinx writes its own {name}.html over it"
        for name in names
        if name in SPHINX_PAGES
    ]
    seen: dict[str, str] = {}
    for name in names:
        if name.lower() in seen:
            clashes.append(f"{name}: the same page as {seen[name.lower()]}")
        seen.setdefault(name.lower(), name)
    return clashes


def test_every_docs_page_is_built_under_a_name_of_its_own():
    sources = [p for p in sorted((ROOT / "docs").rglob("*")) if p.suffix in (".md", ".rst")]
    names = [built_name(p) for p in sources if "_build" not in p.relative_to(ROOT).parts]
    assert "hyperparameter-search" in names and "index" in names
    clashes = page_name_clashes(names)
    assert not clashes, "rename these pages:\n  " + "\n  ".join(clashes)


def test_page_name_clashes_flags_sphinx_own_pages_and_shared_names():
    assert page_name_clashes(["index", "api/search", "hyperparameter-search"]) == []
    # the guide's old name: search.html lost it
    assert len(page_name_clashes(["index", "search"])) == 1
    assert len(page_name_clashes(["genindex", "py-modindex"])) == 2
    assert len(page_name_clashes(["data", "Data"])) == 1


def wide_code_lines(text: str, width: int = CODE_WIDTH) -> list[tuple[int, int]]:
    """(line number, characters) of each line inside a fenced block (```` ``` ```` or ``~~~``, any
    language) that is wider than ``width``. Prose is left out: the page wraps it."""
    wide, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        if fence is None:
            opening = re.match(r"\s*(`{3,}|~{3,})", line)
            fence = opening.group(1) if opening else None
        # its closing fence
        elif set(line.strip()) == {fence[0]} and len(line.strip()) >= len(fence):
            fence = None
        elif len(line) > width:
            wide.append((number, len(line)))
    return wide


def test_code_lines_fit_the_page():
    wide = [
        f"{page.relative_to(ROOT)}:{n}:{w}"
        for page in PAGES
        for n, w in wide_code_lines(page.read_text())
    ]
    assert not wide, (
        f"code lines wider than {CODE_WIDTH} characters are cut off on the page:\n  "
        + "\n  ".join(wide)
    )


def test_wide_code_lines_flags_an_89_character_line_in_a_block_only():
    text = "\n".join(
        ["x" * 120, "```python", "a" * 88, "b" * 89, "```", "~~~text", "c" * 100, "~~~", "d" * 95]
    )
    assert wide_code_lines(text) == [(4, 89), (7, 100)]  # prose (lines 1 and 9) wraps on the page
    nested = "\n".join(["````markdown", "```python", "```", "e" * 90, "````", "f" * 90])
    assert wide_code_lines(nested) == [(4, 90)]  # a shorter fence inside does not close the block


def docstring_literal_lines(doc: str) -> list[str]:
    """The lines of a docstring's literal blocks (``text::`` then an indented block) as the API page
    shows them: the block's common indent removed."""
    lines, out, i = inspect.cleandoc(doc).splitlines(), [], 0
    while i < len(lines):
        if not lines[i].rstrip().endswith("::"):
            i += 1
            continue
        base, i = len(lines[i]) - len(lines[i].lstrip()), i + 1
        body = []
        while i < len(lines) and (
            not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > base
        ):
            body += [lines[i]] if lines[i].strip() else []
            i += 1
        indent = min((len(line) - len(line.lstrip()) for line in body), default=0)
        out += [line[indent:] for line in body]
    return out


def test_docstring_code_fits_the_api_pages():
    wide = []
    for source in sorted((ROOT / "src" / "ddpkit").rglob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                wide += [
                    f"{source.relative_to(ROOT)}: {line[:50]}"
                    for line in docstring_literal_lines(doc)
                    if len(line) > CODE_WIDTH
                ]
    assert not wide, (
        f"docstring code wider than {CODE_WIDTH} characters is cut off on the API page:\n  "
        + "\n  ".join(wide)
    )


def test_docstring_literal_lines_takes_the_block_only_without_its_indent():
    doc = (
        "Prose " + "p" * 100 + "::\n\n        " + "a" * 89 + "\n          b\n\n    After the block."
    )
    assert [len(line) for line in docstring_literal_lines(doc)] == [89, 3]


def test_the_pages_have_python_blocks_and_few_are_sketches():
    found = blocks()
    assert {page for page, *_ in found} >= {"README.md", "docs/trainer.md"}
    assert len(found) >= 8
    assert sum(marker is None for *_, marker, _ in found) >= len(found) - 2, "most blocks must run"


def _tiered(found: list[tuple[str, int, str | None, str]]) -> list[Any]:
    """The README's blocks in the default tier (the first page a user runs); the docs pages' in the
    extended one (``-m extended``): nearly every block starts ranks, 5 to 20 s each, a third of the
    default suite, and the job tests run their code on every torch."""
    return [
        pytest.param(
            *block,
            id=f"{block[0]}:{block[1]}",
            marks=() if block[0] == "README.md" else pytest.mark.extended,
        )
        for block in found
    ]


@pytest.mark.parametrize("page, line, marker, code", _tiered(blocks()))
def test_block_runs(page, line, marker, code, run_python, tmp_path):
    if marker is not None:
        pytest.skip(f"{page} line {line}: {marker}")
    # In a folder of its own (what one block writes, such as a run directory, another must not
    # resume), and compiled under the page's name at the block's lines, so that a traceback points
    # into the page.
    program = (
        f"import os\nos.chdir({str(tmp_path)!r})\n"
        f"exec(compile({chr(10) * (line - 1) + code!r}, {page!r}, 'exec'), globals())\n"
    )
    done = run_python(program, timeout=120)
    assert done.returncode == 0, f"{page}: the block at line {line} failed:\n{done.stderr[-3000:]}"


def cited_tests(text: str) -> tuple[set[str], set[str], set[tuple[str, str]]]:
    """What the inline code of ``text`` cites: test files (``tests/....py``, globs allowed), test
    functions (``test_...``, a trailing ``*`` for a prefix) and ``file::function`` pairs. Fenced
    blocks are code, not citations, and are left out."""
    files, names, pairs = set(), set(), set()
    for span in re.findall(r"`([^`\n]+)`", _FENCE.sub("", text)):
        for path, name in re.findall(r"(tests/[\w/*]+\.py)(?:::(\w+))?", span):
            files.add(path)
            if name:
                pairs.add((path, name))
        names.update(re.findall(r"(?<![\w/:])(test_\w+\*?)", span))
    return files, names, pairs


def _defined(paths: list[Path]) -> set[str]:
    return {
        n
        for p in paths
        for n in re.findall(r"^\s*(?:async )?def (test_\w+)\(", p.read_text(), re.M)
    }


def test_the_tests_the_docs_cite_exist():
    everywhere = _defined(list((ROOT / "tests").rglob("*.py")))
    missing = []
    for page in PAGES:
        files, names, pairs = cited_tests(page.read_text())
        missing += [f"{page.name}: {f}" for f in sorted(files) if not list(ROOT.glob(f))]
        for name in sorted(names):
            prefix = name.rstrip("*")
            if not any(
                d == name or (name.endswith("*") and d.startswith(prefix)) for d in everywhere
            ):
                missing.append(f"{page.name}: {name}")
        for path, name in sorted(pairs):
            if name not in _defined(list(ROOT.glob(path))):
                missing.append(f"{page.name}: {path}::{name}")
    assert not missing, (
        "the docs cite tests that do not exist (moved or renamed?):\n  " + "\n  ".join(missing)
    )


def test_cited_tests_reads_inline_code_only():
    text = (
        "see `tests/test_a.py::test_one` and `test_two*`, not test_three\n```python\ntest_set = "
        "1\n```\n"
    )
    assert cited_tests(text) == (
        {"tests/test_a.py"},
        {"test_two*"},
        {("tests/test_a.py", "test_one")},
    )


def _resolves(dotted: str) -> bool:
    """Whether ``ddpkit.a.b`` names a module, or an attribute of one (a class, a function, a class's
    member)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_the_ddpkit_names_the_docs_and_docstrings_cite_exist():
    """``ddpkit.data.ShardedBatchSampler`` in a page or a docstring names something real (Sphinx
    checks the cross-references it resolves; this checks the names in plain code spans too)."""
    sources = PAGES + sorted((ROOT / "src" / "ddpkit").rglob("*.py"))
    cited = {
        (name, source.relative_to(ROOT))
        for source in sources
        for name in re.findall(r"\bddpkit(?:\.[A-Za-z_]\w*)+", source.read_text())
        if not name.endswith((".md", ".py"))
    }
    missing = sorted(f"{source}: {name}" for name, source in cited if not _resolves(name))
    assert not missing, "names that do not exist:\n  " + "\n  ".join(missing)


def test_the_strict_build_lets_through_only_names_of_other_projects():
    """docs/conf.py's ``nitpick_ignore_regex`` passes ``torch.nn.Module`` (no inventory offline) but
    not a bare ``Stream.read`` or a moved ``ddpkit.`` name: those must resolve, or the strict build
    fails."""
    conf = {"__file__": str(ROOT / "docs" / "conf.py")}
    exec(compile((ROOT / "docs" / "conf.py").read_text(), "conf.py", "exec"), conf)
    (_, pattern), *_ = conf["nitpick_ignore_regex"]
    passed = {
        name
        for name in (
            "torch.nn.Module",
            "collections.abc.Callable",
            "Stream.read",
            "ddpkit.data.Gone",
        )
        if re.fullmatch(pattern, name)
    }
    assert passed == {"torch.nn.Module", "collections.abc.Callable"}
