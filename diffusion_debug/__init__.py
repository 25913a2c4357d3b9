"""diffusion-debug: find the first NaN, the fp16 overflow and the slow component in diffusers
pipelines and their fine-tuning runs.

>>> from diffusion_debug import DebugConfig
>>> DebugConfig(level="basic").probes
'sentinel'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .config import DebugConfig
from .errors import ConfigError, DiffusionDebugError

__version__ = "0.1.0"
__all__ = [
    "DebugConfig",
    "DiffusionModelDebugger",
    "TrainingDebugger",
    "DiffusionDebugError",
    "ConfigError",
    "analyze_tensor",
    "analyze_model",
    "inspect_model",
    "check_gradient_explosion",
    "check_gradient_vanishing",
    "compare_pipelines",
]
_TOOLKIT = ("analyze_tensor", "analyze_model", "inspect_model", "check_gradient_explosion", "check_gradient_vanishing")

# The debuggers pull in diffusers / accelerate: import them only when asked for.
_LAZY = {
    "DiffusionModelDebugger": ".diffusion",
    "TrainingDebugger": ".training",
    "compare_pipelines": ".diffusion.compare",
    **dict.fromkeys(_TOOLKIT, ".toolkit"),
}

if TYPE_CHECKING:
    from .diffusion import DiffusionModelDebugger
    from .diffusion.compare import compare_pipelines
    from .toolkit import (
        analyze_model,
        analyze_tensor,
        check_gradient_explosion,
        check_gradient_vanishing,
        inspect_model,
    )
    from .training import TrainingDebugger


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'diffusion_debug' has no attribute {name!r}")
