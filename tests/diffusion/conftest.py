"""Shared fixture for the DiffusionModelDebugger tests: one tiny pipeline per kind."""

from __future__ import annotations

import pytest

from diffusion_debug.testing import tiny_pipeline


@pytest.fixture(scope="session")
def pipes():
    """fp32 tiny pipelines, seed 0; tests must leave them as they found them."""
    return {kind: tiny_pipeline(kind) for kind in ("sd", "sdxl", "sd3")}
