"""Every python block of the README runs as written, each in a fresh process in an empty folder.

A block that is a sketch (it uses names the reader supplies) is marked with the line ``<!-- not run: why -->``
right before its opening fence; the marker is invisible on a rendered page.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"(?:^(<!-- not run[^\n]*-->)\n)?^```python\n(.*?)^```", re.M | re.S)


def blocks() -> list[tuple[int, str | None, str]]:
    text = README.read_text()
    return [(text[: m.start(2)].count("\n") + 1, m.group(1), m.group(2)) for m in _BLOCK.finditer(text)]


def test_the_readme_has_python_blocks_and_few_are_sketches():
    found = blocks()
    assert len(found) >= 2
    assert sum(marker is None for _, marker, _ in found) >= len(found) - 1, "most blocks must run"


@pytest.mark.parametrize("line, marker, code", blocks(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_readme_block_runs(line, marker, code, run_python):
    if marker is not None:
        pytest.skip(f"README line {line}: {marker}")
    done = run_python(code, timeout=120)
    assert done.returncode == 0, f"README block at line {line} failed:\n{done.stderr[-3000:]}"
