"""The guide's code runs, and the API reference covers the public API.

A ```python block under a ``<!-- test: python -->`` line runs in this process from the repository root; one under
``<!-- test: torchrun N -->`` runs as a script on N local ranks, launched as users launch. The strict site build
(``mkdocs build --strict`` in ``make test``) checks the rest: links, and that every ``::: hetdp.NAME`` exists.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import hetdp
from hetdp.launch import run_local

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^<!-- test: (python|torchrun \d+) -->\n```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def _examples(kind: str) -> list[pytest.param]:
    """Every marked block of ``kind`` ("python" or "torchrun"), named by its page and line."""
    found = []
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text()
        for match in BLOCK.finditer(text):
            how, code = match.groups()
            if how.split()[0] == kind:
                line = text.count("\n", 0, match.start()) + 1
                found.append(pytest.param(how, code, id=f"{page.relative_to(DOCS)}:{line}"))
    return found


def test_the_guide_has_examples_of_both_kinds():
    assert len(_examples("python")) >= 5 and _examples("torchrun")


@pytest.mark.parametrize(("how", "code"), _examples("python"))
def test_a_python_example_runs(how, code, monkeypatch):
    monkeypatch.chdir(ROOT)
    exec(compile(code, f"<{how} example>", "exec"), {"__name__": "__docs__"})


@pytest.mark.distributed
@pytest.mark.parametrize(("how", "code"), _examples("torchrun"))
def test_a_multi_rank_example_runs(how, code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    completed = run_local(script, int(how.split()[1]), capture=True, timeout_s=120)
    assert completed.returncode == 0, completed.stdout


def test_every_public_name_has_a_reference_entry():
    documented = re.findall(r"^::: hetdp\.(\w+)$", "".join(p.read_text() for p in (DOCS / "reference").glob("*.md")),
                            re.MULTILINE)
    assert sorted(documented) == sorted(hetdp.__all__)
