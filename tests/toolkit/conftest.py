"""One tiny SD pipeline for the toolkit's tests (built once: construction is most of their time)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def sd_pipe():
    """fp32 tiny SD pipeline, seed 0; tests must leave it as they found it."""
    from diffusion_debug.testing import tiny_pipeline

    return tiny_pipeline("sd")
