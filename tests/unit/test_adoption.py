"""The README's adoption diff is true of examples/adopt_ddp.py, and stays within five changed lines."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]


def _diff_block() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Adopting hetdp in an existing DDP script") :]
    return re.search(r"```diff\n(.*?)```", section, re.S).group(1).splitlines()


def test_the_readme_diff_is_what_the_example_changed():
    example = (ROOT / "examples" / "adopt_ddp.py").read_text().splitlines()
    for line in _diff_block():
        if line.startswith(("+", " ")) and line[1:].strip() not in ("", "..."):
            assert line[1:] in example, line  # every added or context line is in the adopted script
        if line.startswith("-"):
            assert line[1:] not in example, line  # every removed line is gone from it


def test_adoption_changes_at_most_five_lines():
    lines = _diff_block()
    assert sum(line.startswith("+") for line in lines) <= 5
    assert sum(line.startswith("-") for line in lines) <= 5
