"""Each framework adoption is its plain script with at most three lines changed below the docstring, and the diff
docs/guide/frameworks.md shows is true of it."""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PLAIN = Path(__file__).parent / "adoption"
"""The users' scripts before hetdp (copies of ../shared/adoption, and a small transformers run), each adopted by one
example."""

ADOPTIONS = [("adopt_lightning.py", "plain_lightning.py"), ("adopt_accelerate.py", "plain_accelerate.py"),
             ("adopt_transformers.py", "plain_transformers.py")]


def _below_docstring(path: Path) -> list[str]:
    text = path.read_text()
    docstring = ast.parse(text).body[0]
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant), path
    return text.splitlines()[docstring.end_lineno :]


def _changes(example: str, plain: str) -> tuple[list[str], list[str]]:
    diff = list(difflib.unified_diff(_below_docstring(PLAIN / plain), _below_docstring(ROOT / "examples" / example),
                                     lineterm="", n=0))
    body = [line for line in diff if not line.startswith(("---", "+++", "@@"))]
    return [line[1:] for line in body if line.startswith("+")], [line[1:] for line in body if line.startswith("-")]


def _doc_diff(example: str) -> list[str]:
    guide = (ROOT / "docs" / "guide" / "frameworks.md").read_text()
    section = guide[guide.index(f"examples/{example}") :]
    return re.search(r"```diff\n(.*?)```", section, re.S).group(1).splitlines()


@pytest.mark.parametrize(("example", "plain"), ADOPTIONS)
def test_adoption_changes_at_most_three_lines_below_the_docstring(example, plain):
    added, removed = _changes(example, plain)
    assert added and len(added) <= 3 and len(removed) <= 3, (added, removed)


@pytest.mark.parametrize(("example", "plain"), ADOPTIONS)
def test_the_guides_diff_is_what_the_example_changed(example, plain):
    added, removed = _changes(example, plain)
    shown = _doc_diff(example)
    assert [line[1:] for line in shown if line.startswith("+")] == added
    assert [line[1:] for line in shown if line.startswith("-")] == removed
