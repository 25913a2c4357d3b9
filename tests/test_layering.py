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
    "config_checks": 0.5,  # below config: how a config value is checked and told
    "config": 1,
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


GRAPH = {name: _imports(name, path, set(_modules())) for name, path in _modules().items()}


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
