"""Docstring examples are tests: an example that no longer runs fails here.

Only modules that hold examples are collected (a module with none cannot fail), and each one must
run at least one example, so an example that stops being found fails too.
"""

import doctest
import importlib
import pkgutil

import pytest

import diffusion_debug
from diffusion_debug.testing.features import kind_missing

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


def _missing(name: str) -> str | None:
    """Why this stack cannot run a module's examples (they build what it lacks), else None."""
    if name == "diffusion_debug.testing.qwenimage":
        return kind_missing("qwenimage")
    if name == "diffusion_debug.testing.text_diffusion":
        return kind_missing("llada2")
    if name == "diffusion_debug.testing.zoo_recent":
        return kind_missing("flux2_klein")
    if name == "diffusion_debug.testing.zoo_recent_video":
        return kind_missing("ltx")
    return None


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.skipif(bool(_missing(n)), reason=str(_missing(n)))) for n in WITH_EXAMPLES],
)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=FLAGS)
    assert result.attempted > 0, f"no example ran in {name}"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
