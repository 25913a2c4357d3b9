"""Docstring examples are tests: an example that no longer runs fails here."""

import doctest
import importlib
import pkgutil

import pytest

import diffusion_debug

MODULES = sorted(
    name for _, name, _ in pkgutil.walk_packages(diffusion_debug.__path__, "diffusion_debug.")
)


@pytest.mark.parametrize("name", ["diffusion_debug", *MODULES])
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
