"""The adoption diff of the README and of the guide is true of examples/adopt_ddp.py, and stays within five changed
lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
PAGES = pytest.mark.parametrize("page", ["README.md", "docs/guide/dropin.md"])


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
