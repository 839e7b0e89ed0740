"""examples/adopt_fsdp2.py is the reference FSDP2 script (a copy of ../shared/adoption/plain_fsdp2.py) with at most
three lines added below the docstring, and the diff docs/guide/sharded.md shows is true of it."""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _below_docstring(path: Path) -> list[str]:
    text = path.read_text()
    docstring = ast.parse(text).body[0]
    assert isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant), path
    return text.splitlines()[docstring.end_lineno :]


def _changes() -> tuple[list[str], list[str]]:
    plain = _below_docstring(Path(__file__).parent / "adoption" / "plain_fsdp2.py")
    diff = difflib.unified_diff(plain, _below_docstring(ROOT / "examples" / "adopt_fsdp2.py"), lineterm="", n=0)
    body = [line for line in diff if not line.startswith(("---", "+++", "@@"))]
    return [line[1:] for line in body if line.startswith("+")], [line[1:] for line in body if line.startswith("-")]


def test_the_sharded_adoption_adds_at_most_three_lines_below_the_docstring():
    added, removed = _changes()
    assert "from hetdp import fully_shard" in added and "    loader = model.allocate(loader)" in added
    assert len(added) <= 3 and len(removed) <= 2, (added, removed)


def test_the_guides_diff_is_what_the_example_changed():
    added, removed = _changes()
    shown = re.search(r"```diff\n(.*?)```", (ROOT / "docs" / "guide" / "sharded.md").read_text(), re.DOTALL).group(1)
    lines = shown.splitlines()
    assert [line[1:] for line in lines if line.startswith("+")] == added
    assert [line[1:] for line in lines if line.startswith("-")] == removed
