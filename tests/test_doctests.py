"""Docstring examples are tests: an example that no longer runs fails here.

Only modules that hold examples are collected (a module with none cannot fail), and each one must
run at least one example, so an example that stops being found fails too.
"""

import doctest
import importlib
import pkgutil

import pytest

import diffusion_debug

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
ALL_MODULES = ["diffusion_debug"] + sorted(
    name for _, name, _ in pkgutil.walk_packages(diffusion_debug.__path__, "diffusion_debug.")
)


def _examples(name: str) -> int:
    module = importlib.import_module(name)
    return sum(len(test.examples) for test in doctest.DocTestFinder().find(module))


WITH_EXAMPLES = [name for name in ALL_MODULES if _examples(name)]


def test_examples_are_found():
    # the modules whose docstrings show how to use them; a module dropping out of this list has
    # lost its examples
    assert {
        "diffusion_debug",
        "diffusion_debug.config",
        "diffusion_debug.stats.tensors",
        "diffusion_debug.stats.host",
    } <= set(WITH_EXAMPLES)
    assert len(WITH_EXAMPLES) >= 8


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=FLAGS)
    assert result.attempted > 0, f"no example ran in {name}"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
