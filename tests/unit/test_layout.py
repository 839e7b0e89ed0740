"""The package's shape: the drop-in's coordinator stays short, its parts do not reach back to it, imports run one way
(no circle, nothing of the library above the benchmarks, the command line and the launcher), and no module of the
launcher or the runtime lies loose at the package's root."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import hetdp

PACKAGE = Path(hetdp.__file__).parent


@functools.cache
def imports() -> dict[str, set[str]]:
    """Module -> the hetdp modules it imports (also under TYPE_CHECKING and inside functions)."""
    modules = {_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hetdp"):
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
                found.add(next(target for target in targets if target in modules))
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name in modules)
        graph[name] = found - {name}
    return graph


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_through_others():
    assert circles(imports()) == []


def test_no_folder_imports_itself_through_other_folders():
    folders: dict[str, set[str]] = {}
    for module, targets in imports().items():
        folder = ".".join(module.split(".")[:2])
        folders.setdefault(folder, set()).update(".".join(t.split(".")[:2]) for t in targets)
    assert circles({folder: targets - {folder} for folder, targets in folders.items()}) == []


def test_the_library_never_imports_the_benchmarks_or_the_command_line():
    above = ("hetdp.bench", "hetdp.cli")
    for module, targets in imports().items():
        if not module.startswith(above):
            assert not {t for t in targets if t.startswith(above)}, module
    for module, targets in imports().items():
        if module.startswith("hetdp.bench"):
            assert not {t for t in targets if t.startswith("hetdp.cli")}, module


def test_the_drop_in_stays_a_short_coordinator():
    assert len((PACKAGE / "ddp" / "model.py").read_text().splitlines()) <= 350


def test_the_drop_in_s_parts_see_the_model_through_protocols_not_its_module():
    graph = imports()
    for part in ("hetdp.data.loader", "hetdp.checkpoint.checkpointer", "hetdp.figures.gather", "hetdp.ddp.step",
                 "hetdp.figures.tally", "hetdp.ddp.hook", "hetdp.allocate.caps", "hetdp.ddp.seams"):
        assert "hetdp.ddp.model" not in graph[part], part


SHARED_AT_THE_ROOT = {"__init__", "errors", "files", "flags", "floor", "report"}
"""The package's face and the modules every part uses: the launcher and the runtime have folders of their own."""


def test_the_package_root_holds_its_face_and_shared_modules_only():
    assert {path.stem for path in PACKAGE.glob("*.py")} <= SHARED_AT_THE_ROOT


def test_only_the_command_line_and_the_benchmarks_import_the_launcher():
    for module, targets in imports().items():
        if not module.startswith(("hetdp.launch", "hetdp.cli", "hetdp.bench")):
            assert not {t for t in targets if t.startswith("hetdp.launch")}, module
