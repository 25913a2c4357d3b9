"""pytest imports test modules by their base name (rootdir mode, no __init__.py): two test files
with one name in different folders stop the whole suite at collection. Mirrored rooms with one
name on both sides (diffusion/checks.py, training/checks.py) get a prefixed test file."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_test_module_names_are_unique():
    names = Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert not [name for name, n in names.items() if n > 1]
