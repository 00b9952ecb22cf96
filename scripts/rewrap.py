"""Rewrap the comments and docstrings that run past the line length (code is left to the formatter).

    python scripts/rewrap.py [PATH ...] [--width 100] [--check] [--report]

PATHs are files or folders (default: src tests bench examples scripts docs, from the current
folder). Only a paragraph with a line over the width is touched, refilled greedily to the width, so
a second run changes nothing. What is rewrapped:

- ``#`` comment blocks (comment-only lines at one column, in a row; a bare ``#`` line separates
  paragraphs); a line of code whose trailing comment takes it past the width gets that comment on
  its own line above;
- docstrings (every statement that is a plain triple-quoted string: modules, classes, functions and
  the attribute docstrings autodoc renders), paragraph by paragraph, a list item with its hanging
  indent.

What is never touched: pragmas (``# noqa``, ``# type:``, ``# pragma``, ``# fmt:`` and the like),
shebangs, a block after a line ending in ``::`` and its ``.. code-block::`` cousins, doctest lines
(``>>>``), tables, section titles, aligned lines (three spaces or more inside), lines indented past
their paragraph other than a list item's (code, quotations laid out by hand), and words longer than
the width (URLs: reported, and left to ``# noqa: E501``). A word that would begin a continuation
line as markup (``-``, ``1.``, ``>>>``, ``..``, ``noqa``, ``type:``) stays with the word before it.
A file is written only when its syntax tree (docstrings compared word by word) and its comments'
words are unchanged; ``--check`` writes nothing and exits 1 when a file would change. ``--report``
lists the lines still over the width, as code, comment or docstring.

``--strings`` (instead, between runs of ``ruff format``): a one-line string literal that crosses the
width is cut in two at a space (an f-string outside its fields), as two adjacent literals of the
same value, which the formatter then puts one a line; a run of adjacent literals that the formatter
already put one a line is refilled as a whole. Docstrings, ``# fmt: skip`` statements and ``# fmt:
off`` regions are left alone. The whole procedure, from a tree at 120 columns::

    python scripts/rewrap.py && ruff format .
    for i in 1 2 3; do python scripts/rewrap.py --strings && ruff format .; done
    python scripts/rewrap.py && ruff format .
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOTS = ("src", "tests", "bench", "examples", "scripts", "docs")
PRAGMA = re.compile(
    r"#\s*(noqa|type:|pragma|fmt:|isort:|ruff:|mypy:|pyright:|nosec|-\*-|!)", re.IGNORECASE
)
BULLET = re.compile(r"([-*+\u2022]|\d+[.)]|#\.|\(\w{1,3}\))\s+(?=\S)")
FIELD = re.compile(r":[^:\s][^:]*:\s+(?=\S)")
# A word that would read as markup or as a directive at the start of a line.
HAZARD = re.compile(
    r"([-*+\u2022]|\d+[.)]|#\.|\(\w{1,3}\)|>>>|\.\.\.?|\.\..*::|\|.*|[=\-~^`#*+]{2,}|:\w[^:\s]*:)"
)
DIRECTIVE_WORD = re.compile(
    r"noqa\b.*|type:.*|pragma\b.*|fmt:.*|isort:.*|ruff:.*|mypy:.*|pyright:.*|nosec\b.*", re.I
)
DIRECTIVE = re.compile(r"\.\.\s+[\w:-]+::")
TABLE = re.compile(r"(\|.*\||[+][-=+]+[+]|=+(\s+=+)+|[-=~^`#*+]{3,})$")
# A section of a module marked by a comment such as "# saving ------": the dashes are cut to fit.
RULE = re.compile(r"([-=#*~_])\1{9,}")
ALIGNED = re.compile(r"\S {3,}\S")
PROSE_DIRECTIVES = re.compile(
    r"\.\.\s+(note|warning|seealso|versionadded|versionchanged|deprecated|tip|important|caution|"
    r"attention|hint|danger|error|admonition)::"
)
TRAILING_PRAGMA = re.compile(
    r"(#\s*(?:type:\s*ignore(?:\[[^\]]*\])?|noqa(?::\s*[A-Z]+[0-9]+(?:,\s*[A-Z]+[0-9]+)*)?))\s+(#.*)"
)
GLUE = "\x00"


@dataclass
class Line:
    text: str  # relative to the block's indent: leading spaces are indentation within the block
    fixed: bool = False  # never merged, never moved: a docstring's bare quotes

    @property
    def indent(self) -> int:
        return len(self.text) - len(self.text.lstrip(" "))

    @property
    def blank(self) -> bool:
        return not self.text.strip()


def _words(texts: list[str], lead: str) -> list[str]:
    """The paragraph's words, each word that must not begin a line glued to the one before it.

    ``lead``: the ending of a line that ends a paragraph (``:`` in a comment, ``::`` in a
    docstring), which must stay at the end of the paragraph's last line.
    """
    words: list[str] = []
    literal = False  # inside a short ``literal``: kept on one line
    for word in " ".join(texts).split():
        short = literal and len(words[-1]) < 30
        glued = short or HAZARD.fullmatch(word) or DIRECTIVE_WORD.fullmatch(word)
        if words and (glued or words[-1].endswith(lead)):
            words[-1] += GLUE + word
        else:
            words.append(word)
        literal ^= word.count("``") % 2 == 1
    return words


def _fill(words: list[str], first: int, rest: int) -> list[str]:
    lines: list[str] = []
    current = ""
    for word in words:
        limit = first if not lines else rest
        if current and len(current) + 1 + len(word) > limit:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    lines.append(current)
    return [line.replace(GLUE, " ") for line in lines]


def _special(line: Line, code_comments: bool) -> bool:
    """A line kept as it is and ending any paragraph."""
    s = line.text.strip()
    return (
        line.fixed
        or s.startswith((">>>", "... ", ".. "))
        or s == "..."
        or bool(TABLE.fullmatch(s))
        or bool(ALIGNED.search(s))
        or not re.search(r"\w", s)
        or (code_comments and bool(PRAGMA.match("# " + s)))
    )


def reflow(lines: list[Line], width: int, *, comments: bool) -> list[str]:
    """``lines`` refilled to ``width`` (counted from the block's indent), paragraph by paragraph.

    ``comments``: the lines of a ``#`` block, where a lead-in line ending in ``:`` ends a paragraph.
    """
    lead = ":" if comments else "::"  # a comment's lead-in line is kept as it was
    out: list[str] = []
    i, n = 0, len(lines)
    while i < n:
        line = lines[i]
        s = line.text.strip()
        if line.blank or _special(line, comments) or line.indent > 0:
            # A line indented past the paragraphs and not a list item's is code, or a quotation
            # that may be laid out by hand.
            out.append(line.text)
            i += 1
            if s.startswith(">>>"):  # the example's output, up to the next blank line
                while i < n and not lines[i].blank and not lines[i].fixed:
                    i = _keep(lines, i, i + 1, out)
            elif DIRECTIVE.match(s) and not PROSE_DIRECTIVES.match(
                s
            ):  # a code block and its options
                while (
                    i < n
                    and (lines[i].blank or lines[i].indent > line.indent)
                    and not lines[i].fixed
                ):
                    i = _keep(lines, i, i + 1, out)
            continue
        indent = line.indent
        marker = BULLET.match(s) or FIELD.match(s)
        j = i + 1
        hang = indent
        if marker:
            hang = indent + (len(marker.group(0)) if BULLET.match(s) else 4)
            conts = []
            while (
                j < n
                and not lines[j].blank
                and lines[j].indent > indent
                and not _special(lines[j], comments)
                and not BULLET.match(lines[j].text.strip())
                and not lines[j - 1].text.rstrip().endswith("::")
            ):
                conts.append(lines[j].indent)
                j += 1
            if conts and len(set(conts)) == 1:
                hang = conts[0]
            elif conts:
                i = _keep(lines, i, j, out)
                continue
        elif not s.endswith(lead):
            while (
                j < n
                and not lines[j].blank
                and lines[j].indent == indent
                and not _special(lines[j], comments)
                and not BULLET.match(lines[j].text.strip())
                and not (j + 1 < n and _underline(lines[j + 1]))  # a section title
            ):
                j += 1
                if lines[j - 1].text.rstrip().endswith(lead):
                    break
        if j < n and _underline(lines[j]) and j == i + 1:
            i = _keep(lines, i, j + 1, out)  # a section title and its underline
            continue
        para = lines[i:j]
        if any(len(p.text) > width for p in para):
            words = _words([p.text.strip() for p in para], lead)
            filled = _fill(words, width - indent, width - hang)
            out.append(" " * indent + filled[0])
            out.extend(" " * hang + f for f in filled[1:])
        else:
            out.extend(p.text for p in para)
        i = j
        if para[-1].text.rstrip().endswith("::"):  # a literal block follows: kept as it is
            while i < n and (lines[i].blank or lines[i].indent > indent) and not lines[i].fixed:
                i = _keep(lines, i, i + 1, out)
    return out


def _underline(line: Line) -> bool:
    return not line.fixed and bool(TABLE.fullmatch(line.text.strip() or "x"))


def _keep(lines: list[Line], i: int, j: int, out: list[str]) -> int:
    out.extend(line.text for line in lines[i:j])
    return j


# --- comments -------------------------------------------------------------------------------------


def _tokens(source: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(source).readline))


def _inside_tokens(tokens: list[tokenize.TokenInfo]) -> set[int]:
    """Rows (1-based) that begin inside a token started on an earlier row (a multi-line string)."""
    rows: set[int] = set()
    for tok in tokens:
        if tok.start[0] < tok.end[0] and tok.type != tokenize.NL:
            rows.update(range(tok.start[0] + 1, tok.end[0] + 1))
    return rows


def move_trailing_comments(source: str, width: int) -> str:
    lines = source.splitlines(keepends=True)
    tokens = _tokens(source)
    inside = _inside_tokens(tokens)
    moves: dict[int, tuple[str, str]] = {}  # row -> (the comment above, what stays after the code)
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        row, col = tok.start
        line = lines[row - 1].rstrip("\r\n")
        code = line[:col].rstrip()
        comment, kept = tok.string, ""
        pragma = TRAILING_PRAGMA.fullmatch(comment)
        if pragma:  # "# type: ignore[x]  # why": the why goes above, the pragma stays
            kept, comment = "  " + pragma.group(1), pragma.group(2)
        if not code.strip() or len(line) <= width or len(code + kept) > width:
            continue
        if PRAGMA.match(comment) or row in inside:
            continue
        if row > 1 and lines[row - 2].rstrip("\r\n").endswith("\\"):
            continue
        indent = line[: len(line) - len(line.lstrip())]
        above = lines[row - 2].rstrip("\r\n") if row > 1 else ""
        if above.strip().startswith("#") and above[: len(above) - len(above.lstrip())] == indent:
            continue  # it would join the comment block above
        if len(indent) + len(comment) > width and len(comment.split()) < 3:
            continue
        moves[row] = (indent + comment, code + kept)
    if not moves:
        return source
    out = []
    for row, text in enumerate(lines, start=1):
        if row in moves:
            ending = text[len(text.rstrip("\r\n")) :]
            out.extend(part + ending for part in moves[row])
        else:
            out.append(text)
    return "".join(out)


def rewrap_comments(source: str, width: int) -> str:
    lines = source.splitlines(keepends=True)
    for tok in _tokens(source):
        if tok.type != tokenize.COMMENT:
            continue
        row, col = tok.start
        line = lines[row - 1].rstrip("\r\n")
        over = len(line) - width
        rule = max(RULE.finditer(tok.string), key=lambda m: len(m.group(0)), default=None)
        if not line[:col].strip() and over > 0 and rule:
            if len(rule.group(0)) - over >= 4:
                at = col + rule.start()
                lines[row - 1] = line[:at] + line[at + over :] + lines[row - 1][len(line) :]
    source = "".join(lines)
    tokens = _tokens(source)
    own: dict[int, tuple[int, str]] = {}  # row -> (column of '#', prefix)
    for tok in tokens:
        if tok.type != tokenize.COMMENT:
            continue
        row, col = tok.start
        if lines[row - 1][:col].strip() or (row <= 2 and PRAGMA.match(tok.string)):
            continue
        prefix = "#:" if tok.string.startswith("#:") else "#"
        rest = tok.string[len(prefix) :]
        if rest and not rest.startswith(" "):
            continue  # '#foo', '#!...': not prose
        own[row] = (col, prefix)
    replaced: dict[int, list[str]] = {}
    rows = sorted(own)
    k = 0
    while k < len(rows):
        start = rows[k]
        col, prefix = own[start]
        end = start
        while end + 1 in own and own[end + 1] == (col, prefix):
            end += 1
        k = rows.index(end) + 1
        texts = [lines[r - 1].rstrip("\r\n")[col:] for r in range(start, end + 1)]
        if not any(col + len(t) > width for t in texts):
            continue
        body = [Line(t[len(prefix) + 1 :] if len(t) > len(prefix) else "") for t in texts]
        for b, t in zip(body, texts, strict=True):
            b.fixed = bool(PRAGMA.match(t))
        new = reflow(body, width - col - len(prefix) - 1, comments=True)
        ending = lines[start - 1][len(lines[start - 1].rstrip("\r\n")) :] or "\n"
        pad = " " * col
        replaced[start] = [(pad + prefix + (" " + b if b else "")).rstrip() + ending for b in new]
        for r in range(start + 1, end + 1):
            replaced[r] = []
    if not replaced:
        return source
    return "".join(
        "".join(replaced[r]) if r in replaced else text for r, text in enumerate(lines, start=1)
    )


# --- docstrings -----------------------------------------------------------------------------------


def _docstrings(tree: ast.AST) -> Iterator[ast.Constant]:
    for node in ast.walk(tree):
        for stmt in (
            getattr(node, "body", []) if isinstance(getattr(node, "body", None), list) else []
        ):
            if (
                isinstance(stmt, ast.Expr)
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            ):
                yield stmt.value


def rewrap_docstrings(source: str, width: int) -> str:
    lines = source.splitlines(keepends=True)
    edits: list[tuple[int, int, list[str]]] = []
    for node in _docstrings(ast.parse(source)):
        first, last = node.lineno, node.end_lineno or node.lineno
        col, end_col = node.col_offset, node.end_col_offset or 0
        head = lines[first - 1]
        opening = re.match(r"([rRuU]?)(\"\"\"|''')", head[col:])
        if head[:col].strip() or not opening or first == last and len(head.rstrip()) <= width:
            continue
        quote = opening.group(2)
        tail = lines[last - 1].rstrip("\r\n")
        segment = ast.get_source_segment(source, node) or ""
        if (
            tail[end_col:].strip()
            or not tail[:end_col].endswith(quote)
            or segment.count(quote) != 2
        ):
            continue
        texts = [t.rstrip("\r\n") for t in lines[first - 1 : last]]
        if not any(len(t) > width for t in texts):
            continue
        body: list[Line] = []
        for idx, text in enumerate(texts):
            if idx == 0:
                text = text[col:]
            elif text.strip() and len(text) - len(text.lstrip(" ")) < col:
                body = []
                break
            else:
                text = text[col:]
            # A backslash at a line's end joins the lines in the string's value: both kept as they
            # are.
            joined = text.endswith("\\") or idx > 0 and texts[idx - 1].endswith("\\")
            body.append(Line(text, fixed=joined or text.strip() in (opening.group(0), quote)))
        if not body:
            continue
        new = reflow(body, width - col, comments=False)
        ending = lines[first - 1][len(lines[first - 1].rstrip("\r\n")) :] or "\n"
        rebuilt = [(" " * col + t).rstrip() + ending for t in new]
        rebuilt[0] = head[:col] + new[0].rstrip() + ending
        edits.append((first, last, rebuilt))
    for first, last, rebuilt in sorted(edits, reverse=True):
        lines[first - 1 : last] = rebuilt
    return "".join(lines)


# --- strings --------------------------------------------------------------------------------------


def _split_at(body: str, fstring: bool, limit: int) -> int | None:
    """The index just past the last space of ``body`` before ``limit``, outside an f-string's
    fields."""
    depth, best, i = 0, None, 0
    while i < len(body) and i < limit:
        c = body[i]
        if fstring and c in "{}" and body[i : i + 2] in ("{{", "}}") and depth == 0:
            i += 2
            continue
        if fstring and c == "{":
            depth += 1
        elif fstring and c == "}" and depth:
            depth -= 1
        elif c == " " and depth == 0 and i + 1 < len(body):
            best = i + 1
        i += 1
    return best


def _literal(prefix: str, quote: str, part: str) -> str:
    if "f" in prefix.lower() and not re.search(
        r"(?<!\{)\{(?!\{)|^\{(?!\{)", part.replace("{{", "")
    ):
        prefix = prefix.replace("f", "").replace("F", "")  # no field left: a plain string
        part = part.replace("{{", "{").replace("}}", "}")
    return prefix + quote + part + quote


def _unformatted(tokens: list[tokenize.TokenInfo]) -> set[int]:
    """Rows the formatter leaves alone: statements ending in ``# fmt: skip``, ``# fmt: off``
    regions."""
    rows: set[int] = set()
    start, off = 1, None
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            text = tok.string.replace(" ", "")
            if text.startswith("#fmt:skip") or text.endswith("#fmt:skip"):
                rows.update(range(start, tok.start[0] + 1))
            elif text == "#fmt:off":
                off = tok.start[0]
            elif text == "#fmt:on" and off is not None:
                rows.update(range(off, tok.start[0] + 1))
                off = None
        if tok.type == tokenize.NEWLINE:
            start = tok.end[0] + 1
    if off is not None:
        rows.update(range(off, 1 + max((t.end[0] for t in tokens), default=0)))
    return rows


def _runs(tokens: list[tokenize.TokenInfo]) -> list[list[tokenize.TokenInfo]]:
    """Adjacent string literals (one value), with nothing but line breaks between them."""
    runs: list[list[tokenize.TokenInfo]] = []
    current: list[tokenize.TokenInfo] = []
    for tok in tokens:
        if tok.type == tokenize.STRING:
            current.append(tok)
        elif tok.type != tokenize.NL:
            if current:
                runs.append(current)
            current = []
    return runs


def _refill_run(
    run: list[tokenize.TokenInfo], lines: list[str], width: int
) -> tuple[int, int, list[str]] | None:
    """The literals of ``run``, each alone on its line at one column (the first may follow code, as
    in ``help="..."``), refilled to ``width``."""
    col0, col = run[0].start[1], run[1].start[1]
    if any(
        t.start[0] != t.end[0] or t.start[1] != col or lines[t.start[0] - 1][:col].strip()
        for t in run[1:]
    ) or len({t.start[0] for t in run}) != len(run):
        return None
    if any(lines[t.start[0] - 1][t.end[1] :].strip() for t in run[:-1]):
        return None
    parts = [re.match(r"([rRbBuUfF]{0,2})(\"|')", t.string) for t in run]
    if any(
        p is None or t.string.startswith(p.group(0) + p.group(2) * 2) for p, t in zip(parts, run)
    ):
        return None
    kinds = {p.group(1).lower().replace("f", "") for p in parts if p}
    quotes = {p.group(2) for p in parts if p}
    if len(kinds) != 1 or len(quotes) != 1:
        return None
    fstring = any("f" in p.group(1).lower() for p in parts if p)
    bodies = []
    for p, t in zip(parts, run):
        assert p is not None
        body = t.string[len(p.group(0)) : -1]
        if fstring and "f" not in p.group(1).lower():
            body = body.replace("{", "{{").replace("}", "}}")
        bodies.append(body)
    prefix = kinds.pop() + ("f" if fstring else "")
    quote = quotes.pop()
    last = run[-1]
    tail = lines[last.start[0] - 1][last.end[1] :]
    text, room = "".join(bodies), width - col - len(prefix) - 2
    pieces: list[str] = []
    while len(text) > (room if pieces else width - col0 - len(prefix) - 2):
        cut = _split_at(text, fstring, room if pieces else width - col0 - len(prefix) - 2)
        if cut is None:
            break
        pieces.append(text[:cut])
        text = text[cut:]
    pieces.append(text)
    tail_room = room - len(tail.rstrip("\r\n"))
    if len(pieces[-1]) > tail_room:
        cut = _split_at(pieces[-1], fstring, tail_room)
        if cut:
            pieces[-1:] = [pieces[-1][:cut], pieces[-1][cut:]]
    if len(pieces) == 1:
        return None  # one literal: the formatter joins it where it fits
    new = [" " * col + _literal(prefix, quote, piece) + "\n" for piece in pieces]
    new[0] = lines[run[0].start[0] - 1][:col0] + new[0].lstrip(" ")
    new[-1] = new[-1][:-1] + tail
    return run[0].start[0], last.start[0], new


def split_strings(source: str, width: int) -> str:
    """Each one-line string literal that crosses ``width`` cut in two at a space, as two adjacent
    literals (one value): the formatter then lays them out, one a line."""
    lines = source.splitlines(keepends=True)
    skip = {
        r
        for node in _docstrings(ast.parse(source))
        for r in range(node.lineno, 1 + (node.end_lineno or 0))
    }
    edits: dict[int, tuple[int, int, str]] = {}
    tokens = _tokens(source)
    skip |= _unformatted(tokens)
    refilled: list[tuple[int, int, list[str]]] = []
    for run in _runs(tokens):
        if run[0].start[0] in skip or not any(
            len(lines[t.start[0] - 1].rstrip()) > width for t in run
        ):
            continue
        done = _refill_run(run, lines, width) if len(run) > 1 else None
        if done:
            refilled.append(done)
            skip.update(range(done[0], done[1] + 1))
    for tok in tokens:
        row, start = tok.start
        if tok.type != tokenize.STRING or row != tok.end[0] or row in skip or row in edits:
            continue
        line = lines[row - 1].rstrip("\r\n")
        after = line[tok.end[1] :].rstrip()  # what closes the line: '",' or ')'
        if len(after) > 3:
            after = ""
            if tok.end[1] <= width:
                continue  # something after it makes the line long
        if len(line) <= width or re.search(r"#\s*(noqa|fmt:|type:)", line):
            continue
        opening = re.match(r"([rRbBuUfF]{0,2})(\"|')", tok.string)
        if not opening or tok.string.startswith(opening.group(0) + opening.group(2) * 2):
            continue  # triple-quoted, or empty
        prefix, quote = opening.groups()
        body = tok.string[len(prefix) + 1 : -1]
        # the characters of the body that fit before the width
        room = width - start - len(prefix) - 2 - len(after)
        cut = _split_at(body, "f" in prefix.lower(), room)
        if cut is None or cut < 12:
            continue
        text = _literal(prefix, quote, body[:cut]) + " " + _literal(prefix, quote, body[cut:])
        edits[row] = (start, tok.end[1], text)
    for row, (start, end, text) in edits.items():
        line = lines[row - 1]
        lines[row - 1] = line[:start] + text + line[end:]
    for first, last, new in sorted(refilled, reverse=True):
        lines[first - 1 : last] = new
    return "".join(lines)


# --- checks and the command -----------------------------------------------------------------------


class _Normalise(ast.NodeTransformer):
    def visit_Constant(self, node: ast.Constant) -> ast.Constant:
        if isinstance(node.value, str):
            node.value = " ".join(node.value.split())
        return node


def _shape(source: str) -> tuple[str, list[str]]:
    """The syntax tree, strings' whitespace aside, and the comments' words (in any order: a comment
    moved above its line comes before the pragma left beside it)."""
    tree = _Normalise().visit(ast.parse(source))
    words = [
        re.sub(r"([-=#*~_])\1{3,}$", r"\1" * 4, w)
        for t in _tokens(source)
        if t.type == tokenize.COMMENT
        for w in re.split(r"[\s#]+", t.string)
        if w
    ]
    return ast.dump(tree), sorted(words)


def rewrap(source: str, width: int) -> str:
    new = move_trailing_comments(source, width)
    new = rewrap_comments(new, width)
    return rewrap_docstrings(new, width)


def _files(paths: list[str]) -> Iterator[Path]:
    for p in map(Path, paths):
        if p.is_dir():
            yield from sorted(
                q for q in p.rglob("*.py") if "_build" not in q.parts and ".venv" not in q.parts
            )
        elif p.suffix == ".py":
            yield p


def _report(path: Path, source: str, width: int) -> Iterator[str]:
    lines = source.splitlines()
    kinds: dict[int, str] = {}
    tokens = _tokens(source)
    for tok in tokens:
        if tok.type == tokenize.COMMENT and not lines[tok.start[0] - 1][: tok.start[1]].strip():
            kinds[tok.start[0]] = "comment"
    for node in _docstrings(ast.parse(source)):
        for r in range(node.lineno, (node.end_lineno or node.lineno) + 1):
            kinds[r] = "docstring"
    for row, text in enumerate(lines, start=1):
        if len(text) > width:
            yield f"{path}:{row}: {kinds.get(row, 'code')} ({len(text)}): {text.strip()[:80]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=[p for p in ROOTS if Path(p).exists()])
    parser.add_argument("--width", type=int, default=100)
    parser.add_argument(
        "--strings",
        action="store_true",
        help="instead: cut string literals that cross the width in two (run ruff format after it)",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 when a file would change"
    )
    parser.add_argument("--report", action="store_true", help="list the lines still over the width")
    args = parser.parse_args(argv)
    changed = failed = 0
    for path in _files(args.paths):
        source = path.read_text()
        try:
            new = (split_strings if args.strings else rewrap)(source, args.width)
        except (SyntaxError, tokenize.TokenError) as e:
            print(f"{path}: skipped, cannot parse: {e}", file=sys.stderr)
            failed += 1
            continue
        if new != source:
            unstable = not args.strings and rewrap(new, args.width) != new
            if _shape(new) != _shape(source) or unstable:
                print(
                    f"{path}: left as it is: rewrapped, its code or comments would change, or a "
                    "second run would change it again",
                    file=sys.stderr,
                )
                failed += 1
                continue
            changed += 1
            if args.check:
                print(f"{path}: would be rewrapped")
            else:
                path.write_text(new)
        if args.report:
            for line in _report(path, new if not args.check else source, args.width):
                print(line)
    print(
        f"{changed} file(s) {'to rewrap' if args.check else 'rewrapped'}, "
        f"{failed} left as they were",
        file=sys.stderr,
    )
    return 1 if failed or (args.check and changed) else 0


if __name__ == "__main__":
    sys.exit(main())
