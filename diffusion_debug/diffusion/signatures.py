"""Pipeline-first calls answered with one clear TypeError.

``monitor_diffusion_step(pipe, step, latents)`` and ``analyze_diffusion_pipeline(pipe)`` are
natural guesses, but the debugger already holds the pipeline (``DiffusionModelDebugger(pipe,
...)``), so both calls name the right one instead of failing somewhere further in.

Limits: only the argument kinds are checked (a pipeline-like object, a non-integer step); a
wrong but well-typed value (a step index from another run) is not detected.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from ..errors import DiffusionDebugError

MONITOR_CALL = "dbg.monitor_diffusion_step(step, latents, timestep=timestep)"


def _looks_like_pipeline(value: Any) -> bool:
    return hasattr(value, "scheduler") or hasattr(value, "components") or isinstance(value, torch.nn.Module)


def check_monitor_arguments(step: Any, latents: Any) -> None:
    """Raise a TypeError naming the right call when ``step`` is not a step index (e.g. the
    pipeline, passed first); a DiffusionDebugError when the latents are
    not a tensor."""
    if _looks_like_pipeline(step):
        raise TypeError(
            "monitor_diffusion_step takes the step first: the pipeline was given to "
            f"DiffusionModelDebugger(pipe, ...); call {MONITOR_CALL}."
        )
    is_index = isinstance(step, numbers.Integral) or (isinstance(step, torch.Tensor) and step.numel() == 1)
    if not is_index:
        raise TypeError(
            f"monitor_diffusion_step needs the step as an integer, not {type(step).__name__}; call {MONITOR_CALL}."
        )
    if not isinstance(latents, torch.Tensor):
        raise DiffusionDebugError(
            f"monitor_diffusion_step needs the latents as a torch.Tensor, not {type(latents).__name__}."
        )


def check_no_pipeline_argument(arguments: tuple) -> None:
    """``analyze_diffusion_pipeline`` takes no argument: the debugger has the pipeline."""
    if arguments:
        raise TypeError(
            "analyze_diffusion_pipeline takes no arguments: the debugger analyses the pipeline it was given "
            "(DiffusionModelDebugger(pipe, ...)); call dbg.analyze_diffusion_pipeline()."
        )
