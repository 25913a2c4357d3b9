"""Test helpers, fully offline: tiny diffusers pipelines and planted faults.

* :mod:`~diffusion_debug.testing.pipelines` -- :func:`tiny_pipeline`, real SD / SDXL / SD3
  pipelines with tiny random weights (kinds in :data:`TINY_KINDS`), and through
  :mod:`~diffusion_debug.testing.zoo` img2img, inpaint, ControlNet, AnimateDiff, Kandinsky 2.2
  prior / decoder, PixArt-α and DiT.
* :mod:`~diffusion_debug.testing.faults` -- :func:`plant_nonfinite` and :func:`plant_overflow`,
  forward hooks that make a module misbehave on purpose.
"""

from __future__ import annotations

from .faults import plant_nonfinite, plant_overflow
from .pipelines import TINY_KINDS, tiny_pipeline

__all__ = ["TINY_KINDS", "plant_nonfinite", "plant_overflow", "tiny_pipeline"]
