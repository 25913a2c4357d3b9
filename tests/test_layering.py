"""The layers of DESIGN.md, read from the source: no import runs up the layers, none makes a circle.

Every import counts, also one inside a function: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "diffusion_debug"

# Layer of each top-level room of the package (DESIGN.md, "Layers"); a room imports only from
# lower layers, and from itself. Below the stats layer: errors, then the other foundations.
LAYERS = {
    "errors": 0,
    "config": 1,
    "installed": 1,
    "memory": 1,
    "op_count": 1,
    "stats": 1,
    "probes": 2,
    "record": 3,
    "report": 4,
    "core": 5,
    "toolkit": 5,
    "diffusion": 6,
    "training": 6,
    "testing": 6,
    "jobs": 7,
    "cli": 8,
    "pytest_plugin": 8,
}
FACADE = "diffusion_debug"  # the package's own __init__ re-exports the public API (lazily)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's own modules that ``name`` imports (resolved, submodules preferred)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from . import checks` imports the submodule `checks`, not the package
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else module


MODULES = _modules()  # walked once: a walk for each module's known names was most of this file's collection
GRAPH = {name: _imports(name, path, set(MODULES)) for name, path in MODULES.items()}


def test_every_room_has_a_layer():
    rooms = {_room(m) for m in GRAPH if m != FACADE}
    assert rooms <= set(LAYERS), f"rooms with no layer in this test: {sorted(rooms - set(LAYERS))}"


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m != FACADE))
def test_no_import_runs_up_the_layers(module):
    room = _room(module)
    upward = [
        target
        for target in sorted(GRAPH[module])
        if _room(target) != room and (target == FACADE or LAYERS[_room(target)] >= LAYERS[room])
    ]
    assert not upward, f"{module} (layer {LAYERS[room]}) imports {upward}: a layer imports only from below"


def test_no_import_circle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(GRAPH[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (circle := visit(target)):
                return circle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(GRAPH):
        if start not in state and (circle := visit(start)):
            pytest.fail("import circle: " + " -> ".join(circle))


def test_the_checker_sees_a_planted_upward_import_and_circle(tmp_path):
    """The test above would fail on the kinds of import it is there to catch."""
    known = {"diffusion_debug.record", "diffusion_debug.report", "diffusion_debug.report.html"}
    planted = tmp_path / "record.py"
    planted.write_text("def save():\n    from .report import html\n")
    assert _imports("diffusion_debug.record", planted, known) == {"diffusion_debug.report.html"}
    assert LAYERS[_room("diffusion_debug.report.html")] > LAYERS[_room("diffusion_debug.record")]


# Inside a room that has grown sub-packages, the sub-packages are floors of their own: each imports
# only from floors below it. A module directly in the room is the room's face (top floor) unless it
# is listed here with a floor of its own (shared plumbing the floors below may use).
SUB_FLOORS = {
    "training": {
        "hangs": 0,
        "measure": 0,
        "failures": 0,
        "watched_models": 1,
        "judges": 1,
        "ranks": 2,
        "step": 3,
    },
}
TOP_FLOOR = 9
MAX_MODULES_IN_A_FOLDER = 20
LONG_FILE = 500


def _floor(module: str) -> tuple[str, float] | None:
    parts = module.split(".")
    if len(parts) < 3 or parts[1] not in SUB_FLOORS:
        return None
    return parts[2], SUB_FLOORS[parts[1]].get(parts[2], TOP_FLOOR)


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if _floor(m)))
def test_no_import_runs_up_the_floors_of_a_room(module):
    sub, floor = _floor(module)
    upward = [
        target
        for target in sorted(GRAPH[module])
        if _room(target) == _room(module)
        and _floor(target)
        and _floor(target)[0] != sub
        and (_floor(target)[1] > floor or _floor(target)[1] == floor < TOP_FLOOR)
    ]
    assert not upward, f"{module} (floor {floor}) imports {upward}: a sub-package imports only from floors below"


def test_no_folder_holds_more_than_twenty_modules():
    crowded = {}
    for folder in [PACKAGE, *(p for p in PACKAGE.rglob("*") if p.is_dir() and (p / "__init__.py").exists())]:
        entries = [p for p in folder.iterdir() if p.suffix == ".py" and p.name != "__init__.py"]
        entries += [p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
        if len(entries) > MAX_MODULES_IN_A_FOLDER:
            crowded[str(folder.relative_to(PACKAGE.parent))] = len(entries)
    assert not crowded, (
        f"folders over {MAX_MODULES_IN_A_FOLDER} modules: {crowded}; group them in sub-packages by concept"
    )


def test_every_sub_package_opens_with_a_sentence():
    silent = [
        str(p.relative_to(PACKAGE.parent))
        for p in PACKAGE.rglob("__init__.py")
        if not (ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or "").strip()
    ]
    assert not silent, f"sub-packages without a docstring saying what they hold: {silent}"


def test_a_long_file_says_why_it_is_long():
    """No hard line cap (a split made to dodge a number cuts a concept in two); a file over
    LONG_FILE lines states in its docstring why its concept needs the length ("Long because ...")."""
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > LONG_FILE and "Long because" not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(f"{path.relative_to(PACKAGE.parent)} ({text.count(chr(10))} lines)")
    assert not unexplained, f"files over {LONG_FILE} lines whose docstring does not say why: {unexplained}"
