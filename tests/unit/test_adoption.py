"""The adoption diff of the README and of the guide is what examples/adopt_ddp.py changed in the plain DDP script
(tests/unit/adoption/plain_ddp_loop.py, a copy of ../shared/adoption/plain_ddp_loop.py), line for line, and stays
within five changed lines."""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = pytest.mark.parametrize("page", ["README.md", "docs/guide/dropin.md"])


def _below_docstring(path: Path) -> list[str]:
    text = path.read_text()
    docstring = ast.parse(text).body[0]
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant), path
    return text.splitlines()[docstring.end_lineno :]


@PAGES
def test_the_pages_diff_is_every_line_the_adoption_changed(page):
    plain = _below_docstring(Path(__file__).parent / "adoption" / "plain_ddp_loop.py")
    diff = difflib.unified_diff(plain, _below_docstring(ROOT / "examples" / "adopt_ddp.py"), lineterm="", n=0)
    changed = [line for line in diff if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))]
    assert [line for line in _diff_block(page) if line.startswith(("+", "-"))] == changed


def _diff_block(page: str) -> list[str]:
    """The page's first diff: the adoption."""
    return re.search(r"```diff\n(.*?)```", (ROOT / page).read_text(), re.S).group(1).splitlines()


@PAGES
def test_the_adoption_diff_is_what_the_example_changed(page):
    example = (ROOT / "examples" / "adopt_ddp.py").read_text().splitlines()
    for line in _diff_block(page):
        if line.startswith(("+", " ")) and line[1:].strip() not in ("", "..."):
            assert line[1:] in example, line  # every added or context line is in the adopted script
        if line.startswith("-"):
            assert line[1:] not in example, line  # every removed line is gone from it


@PAGES
def test_adoption_changes_at_most_five_lines(page):
    lines = _diff_block(page)
    assert sum(line.startswith("+") for line in lines) <= 5
    assert sum(line.startswith("-") for line in lines) <= 5
