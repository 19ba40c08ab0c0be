"""Every chapter's core prose is read in one sitting, and its Build it shows focused excerpts.

The rule (issue 13): about 300 lines of Markdown without code in the core of a chapter; validation
rules, boundary tables and benchmark narratives live in collapsible "Deep dive" blocks
(sphinx-design's ``dropdown`` directive, titled ``Deep dive: ...``) or in the notebook. Build it
quotes the focused excerpt (the loop, the step), not whole classes: an excerpt in the core is at
most MAX_EXCERPT_LINES lines of code; longer ones go into a Deep dive.

Counted here: non-blank lines outside every fenced block (code, directives, dropdowns), so a
table or a paragraph in the core counts, and a Deep dive does not.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("s[0-9][0-9]-*.md"))
MAX_CORE_LINES = 320        # "about 300"
MAX_EXCERPT_LINES = 45      # one method or one loop, with its docstring
FENCE = re.compile(r"^(`{3,}|:{3,})(.*)$")


def blocks(text: str):
    """Top-level fenced blocks and core lines: yields ("line", text) or ("block", opener, body)."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if not m:
            yield ("line", lines[i])
            i += 1
            continue
        fence, opener = m.group(1), m.group(2).strip()
        body, i = [], i + 1
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"unclosed fence {fence}{opener}"
        yield ("block", opener, body)
        i += 1


def core_lines(text: str) -> list[str]:
    return [b[1] for b in blocks(text) if b[0] == "line" and b[1].strip()]


def excerpt_length(opener: str, body: list[str]) -> int | None:
    """Lines a core ``literalinclude`` shows (None for another block)."""
    m = re.match(r"\{literalinclude\}\s+(\S+)", opener)
    if not m:
        return None
    source = (ROOT / "chapters" / m.group(1)).resolve()
    options = dict(re.match(r":(\S+):\s*(.*)", line).groups() for line in body if line.startswith(":"))
    code = source.read_text()
    if "pyobject" in options:
        node = find(ast.parse(code), options["pyobject"].split("."))
        return node.end_lineno - node.lineno + 1
    if "start-after" in options or "lines" in options:
        text = code
        if "start-after" in options:
            text = text.split(options["start-after"], 1)[1]
        if "end-before" in options:
            text = text.split(options["end-before"], 1)[0]
        if "lines" in options:
            a, _, b = options["lines"].partition("-")
            return int(b or a) - int(a) + 1
        return len(text.strip("\n").splitlines())
    return len(code.splitlines())


def find(tree: ast.AST, path: list[str]) -> ast.AST:
    for node in ast.iter_child_nodes(tree):
        if getattr(node, "name", None) == path[0]:
            return node if len(path) == 1 else find(node, path[1:])
    raise LookupError(f"no {'.'.join(path)}")


@pytest.mark.parametrize("md", CHAPTERS, ids=lambda p: p.stem)
def test_core_prose_is_one_sitting(md):
    n = len(core_lines(md.read_text()))
    assert n <= MAX_CORE_LINES, (
        f"{md.name}: {n} core lines (rule: about 300, at most {MAX_CORE_LINES}); move validation "
        f"rules, boundary tables and benchmark narratives into a ```{{dropdown}} Deep dive: ...")


@pytest.mark.parametrize("md", CHAPTERS, ids=lambda p: p.stem)
def test_deep_dives_are_titled_and_build_it_is_focused(md):
    for block in blocks(md.read_text()):
        if block[0] != "block":
            continue
        _, opener, body = block
        if opener.startswith("{dropdown}"):
            assert opener.removeprefix("{dropdown}").strip().startswith("Deep dive: "), \
                f"{md.name}: a dropdown is titled 'Deep dive: ...' (got {opener!r})"
            # CommonMark: a backtick fence's info string may not contain a backtick; the block
            # would silently render as raw text (and swallow the next one).
            assert "`" not in opener, f"{md.name}: no backtick in a Deep dive title ({opener!r})"
            continue
        n = excerpt_length(opener, body)
        assert n is None or n <= MAX_EXCERPT_LINES, (
            f"{md.name}: {opener} shows {n} lines; the core quotes focused excerpts "
            f"(at most {MAX_EXCERPT_LINES}), a whole class goes into a Deep dive")


def test_counter_sees_fences_and_dropdowns():
    text = "# T\n\nprose\n\n````{dropdown} Deep dive: x\nhidden\n```python\ncode\n```\n````\n| a |\n"
    assert core_lines(text) == ["# T", "prose", "| a |"]
