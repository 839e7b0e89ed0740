"""The guide's code runs, and the API reference covers the public API.

A ```python block under a ``<!-- test: python -->`` line runs in this process from the repository root; one under
``<!-- test: torchrun N -->`` runs as a script on N local ranks, launched as users launch. Each asserts what it prints
or computes: an example that only runs would pass by not raising. The strict site build
(``mkdocs build --strict`` in ``make test``) checks the rest: links, and that every ``::: hetdp.NAME`` exists.
The command-line page (docs/reference/cli.md) lists every command and flag of the parsers, and no other; the
package's docstrings use the Google sections the reference renders, not reStructuredText.
"""

from __future__ import annotations

import argparse
import ast
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


@pytest.mark.parametrize(("how", "code"), _examples("python") + _examples("torchrun"))
def test_every_example_asserts_what_it_prints_or_computes(how, code):
    assert any(isinstance(node, ast.Assert) for node in ast.walk(ast.parse(code)))


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


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every command line of hetdp, by the heading of its section on the CLI page: ``hetdp``, ``hetdp run``,
    ``hetdp bench chaos``, ``python -m hetdp.hosts``."""
    from hetdp.cli import build_parser
    from hetdp.hosts.__main__ import build_parser as hosts_parser

    found = {"python -m hetdp.hosts": hosts_parser()}
    pending = [("hetdp", build_parser())]
    while pending:
        name, parser = pending.pop()
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend((f"{name} {sub}", subparser) for sub, subparser in action.choices.items())
    return found


def _cli_sections() -> dict[str, str]:
    """The CLI page's text by section heading (the command in backticks); the text above the first is ``hetdp``'s."""
    text = (DOCS / "reference" / "cli.md").read_text()
    parts = re.split(r"^#{2,3} `([^`]+)`$", text, flags=re.MULTILINE)
    return {"hetdp": parts[0], **dict(zip(parts[1::2], parts[2::2]))}


def test_the_cli_page_lists_every_command_and_flag():
    sections = _cli_sections()
    for name, parser in _commands().items():
        if name == "hetdp":
            listed = sections["hetdp"]
        else:
            assert name in sections, f"no section for `{name}` on docs/reference/cli.md"
            # the flags every benchmark takes are listed once, under `hetdp bench`
            listed = sections[name] + (sections["hetdp bench"] if name.startswith("hetdp bench ") else "")
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert re.search(rf"`{re.escape(flag)}(?![\w-])", listed), f"`{name} {flag}` is not on the CLI page"


def test_every_flag_on_the_cli_page_exists():
    commands = _commands()
    for name, text in _cli_sections().items():
        assert name in commands, f"docs/reference/cli.md has a section for `{name}`, which is no command"
        flags = {flag for action in commands[name]._actions for flag in action.option_strings}
        common = {"--quick", "--json", "--seed"}  # what every benchmark takes, listed once under `hetdp bench`
        if name == "hetdp bench":
            flags |= common
        elif name.startswith("hetdp bench "):
            flags -= common
        for row in re.findall(r"^\| (`[^|]*`) \|", text, flags=re.MULTILINE):
            for flag in re.findall(r"`(-{1,2}[a-z][\w-]*)", row):
                assert flag in flags, f"docs/reference/cli.md lists `{name} {flag}`, which the parser lacks"


RST_MARKUP = re.compile(r"^\s*\.\. \w+::|::$|:(func|class|meth|mod|attr):`", re.MULTILINE)


def test_docstrings_use_the_sections_the_reference_renders_not_restructuredtext():
    # mkdocstrings reads Google sections (Warning:, Examples:); a reST directive or role shows as raw text there.
    package = Path(hetdp.__file__).parent
    found = [f"{path.relative_to(package)}:{text.count(chr(10), 0, match.start()) + 1}"
             for path in sorted(package.rglob("*.py")) for text in [path.read_text()]
             for match in RST_MARKUP.finditer(text)]
    assert found == []


PUBLIC_MODULES = ("hetdp.integrations", "hetdp.integrations.lightning", "hetdp.integrations.accelerate",
                  "hetdp.integrations.transformers", "hetdp.hosts")
"""Modules a user imports from by name (the guide's adapters and emulated hosts), beside ``hetdp`` itself."""


def _reference_entries() -> list[str]:
    """Every ``::: hetdp...`` entry of the API reference, in page order."""
    pages = "".join(page.read_text() for page in sorted((DOCS / "reference").glob("*.md")))
    return re.findall(r"^::: (hetdp[\w.]*)$", pages, re.MULTILINE)


def test_no_object_has_two_reference_entries():
    entries = _reference_entries()
    assert sorted(entries) == sorted(set(entries))


@pytest.fixture(scope="module")
def package():
    """hetdp as griffe reads it for the reference: docstrings of attributes included."""
    griffe = pytest.importorskip("griffe", reason="griffe comes with the docs tools (mkdocstrings-python)")
    loader = griffe.GriffeLoader(search_paths=[str(ROOT / "src")])
    package = loader.load("hetdp")
    loader.resolve_aliases(implicit=False, external=False)
    return package


def _target(obj):
    return obj.final_target if obj.is_alias else obj


def _documented(package) -> dict[str, object]:
    """What the reference shows: every public name and reference entry, and their members without a leading
    underscore (inherited ones included, as a subclass shows them), by path."""
    pending = [_target(package[name]) for name in hetdp.__all__]
    pending += [_target(package[path.removeprefix("hetdp.")]) for path in _reference_entries()]
    found: dict[str, object] = {}
    while pending:
        obj = pending.pop()
        if obj.path in found:
            continue
        found[obj.path] = obj
        if obj.is_class:
            members = {**obj.inherited_members, **obj.members}
            for name, member in members.items():
                if not name.startswith("_") and not (member.is_alias and member.target_path.split(".")[0] != "hetdp"):
                    pending.append(_target(member))
    return found


def _internal_names(package) -> set[str]:
    """Classes and functions of hetdp that are not public: a docstring that names one points where users cannot go."""
    public = set(hetdp.__all__) | {path.rsplit(".", 1)[1] for path in _reference_entries()}
    defined: set[str] = set()
    pending = [package]
    while pending:
        module = pending.pop()
        for name, member in module.members.items():
            if member.is_alias:
                continue
            if member.is_module:
                if member.path not in PUBLIC_MODULES:
                    pending.append(member)
            elif (member.is_class or member.is_function) and name[0].isupper():
                defined.add(name)
    return defined - public


MODULE_PATH = re.compile(r"\bhetdp(?:\.\w+)+")
UNDERSCORE_NAME = re.compile(r"(?:(?<=\s)|(?<=`)|(?<=\()|^)_[A-Za-z]\w*", re.MULTILINE)
QUOTED_NAME = re.compile(r"`+(\w+)[\w.]*(?:\(\))?`+")


def test_public_docstrings_name_no_internal_module_or_private_name(package):
    public_paths = [*(f"hetdp.{name}" for name in hetdp.__all__), *_reference_entries(), *PUBLIC_MODULES]
    internal = _internal_names(package)
    found = []
    for path, obj in sorted(_documented(package).items()):
        text = obj.docstring.value if obj.docstring else ""
        found += [f"{path}: {m}" for m in MODULE_PATH.findall(text)
                  if not any(m == public or m.startswith(public + ".") for public in public_paths)]
        found += [f"{path}: {m}" for m in UNDERSCORE_NAME.findall(text)]
        found += [f"{path}: {m}" for m in QUOTED_NAME.findall(text) if m in internal]
    assert found == []
