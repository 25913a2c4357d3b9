"""Watch a diffusers pipeline: per-step record, the module that made a NaN/Inf, fp16 overflow
risk, previews, repro bundles.  See :class:`DiffusionModelDebugger`."""

from .bundle import replay, save_bundle
from .debugger import DiffusionModelDebugger

__all__ = ["DiffusionModelDebugger", "replay", "save_bundle"]
