"""Where a NaN/Inf came from when no watched module made it: a pipeline input (``latents=``,
``image=``, ``prompt_embeds=``, ``guidance_scale``...), the scheduler, or the pipeline's own
arithmetic between two components (classifier-free guidance between the denoiser and
``scheduler.step``).

>>> import torch
>>> nonfinite_names({"latents": torch.tensor([1.0, float("nan")]), "guidance_scale": 7.5, "prompt": "a cat"})
['latents']

Each function takes plain values (the pipeline's call arguments, a component call's kept
arguments) and returns names or one :class:`~diffusion_debug.record.Anomaly`. These run only
after a NaN/Inf was seen (they read tensors on the host: one sync each, never per step).

Limits: a pipeline's inputs are read from its running ``__call__`` frame (the frame whose
``self`` is the pipeline), so an argument the pipeline reassigned before the NaN surfaced is seen
as reassigned (``latents`` after ``prepare_latents``: still non-finite when the user's were); a
pipeline run through another method than ``__call__`` has no inputs to read; an input is seen
only as a tensor, a float, a numpy array or a list / tuple / dict of those (PIL images cannot
hold NaN).
"""

from __future__ import annotations

import inspect
import math
import sys
from typing import Any

import torch

from ..record import Anomaly, make_anomaly

GUIDANCE_NAMES = ("guidance_scale", "image_guidance_scale", "guidance_rescale", "true_cfg_scale")
MAX_DEPTH = 60  # frames walked up from a hook to the pipeline's __call__


def is_nonfinite(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` (a tensor, float, numpy array, or a list / tuple / dict of them) holds a NaN/Inf."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and value.numel() > 0 and not bool(torch.isfinite(value.detach()).all())
    if isinstance(value, float):
        return not math.isfinite(value)
    if depth > 2:
        return False
    if isinstance(value, (list, tuple)):
        return any(is_nonfinite(v, depth + 1) for v in value[:64])
    if isinstance(value, dict):
        return any(is_nonfinite(v, depth + 1) for v in list(value.values())[:64])
    if type(value).__module__ == "numpy" and getattr(value, "dtype", None) is not None:
        try:
            import numpy as np

            return value.dtype.kind == "f" and not bool(np.isfinite(value).all())
        except Exception:  # an object array: not a numeric input
            return False
    return False


def nonfinite_names(values: dict[str, Any]) -> list[str]:
    """The names whose values hold a NaN/Inf, in order."""
    return [name for name, value in values.items() if is_nonfinite(value)]


def pipeline_inputs(pipe: Any) -> dict[str, Any]:
    """The arguments of the running ``pipe.__call__`` (from its frame), with the guidance scales
    the pipeline stored on itself; empty when no such frame is on the stack."""
    frame = sys._getframe(1)
    found = None
    for _ in range(MAX_DEPTH):
        if frame is None:
            break
        if frame.f_code.co_name == "__call__" and frame.f_locals.get("self") is pipe:
            found = frame  # the outermost one: a pipeline calling itself keeps the user's arguments
        frame = frame.f_back
    if found is None:
        return {}
    code = found.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    local = found.f_locals
    values = {name: local[name] for name in names if name != "self" and name in local}
    if "kwargs" in local and isinstance(local["kwargs"], dict):
        values.update({k: v for k, v in local["kwargs"].items() if k not in values})
    for name in GUIDANCE_NAMES:
        stored = vars(pipe).get(f"_{name}")
        if name not in values and isinstance(stored, (int, float)):
            values[name] = float(stored)
    return values


def call_arguments(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A component call's arguments by parameter name (``arg0``... where the signature says none)."""
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
        return dict(bound.arguments)
    except (TypeError, ValueError):
        return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}


def input_origin(names: list[str], *, seen_in: str, step: int | None, timestep: float | None, phase: str) -> Anomaly:
    """The one error for NaN/Inf passed to the pipeline as its inputs ``names``."""
    first = names[0]
    listed = ", ".join(f"{n}=" for n in names)
    return make_anomaly(
        kind="nonfinite",
        severity="error",
        component="input",
        module=first,
        step=step,
        timestep=timestep,
        message=(
            f"The pipeline input {listed} held NaN/Inf (first seen by {seen_in}); pass finite values "
            f"(check how {first} was made, its dtype and any division or log before it)."
        ),
        details={"localized_by": "pipeline inputs", "inputs": names, "seen_in": seen_in, "phase": phase},
    )


def between_origin(
    arguments: list[str], *, seen_in: str, step: int | None, timestep: float | None, phase: str
) -> Anomaly:
    """The one error for NaN/Inf that reached ``seen_in`` (as ``arguments``) from no watched
    component and no input: the pipeline's own code made it between two calls."""
    shown = ", ".join(arguments) if arguments else "its inputs"
    return make_anomaly(
        kind="nonfinite",
        severity="error",
        component="pipeline",
        module="",
        step=step,
        timestep=timestep,
        message=(
            f"{seen_in} received non-finite {shown} that no watched component and no pipeline input made: the "
            f"pipeline's own code between calls produced it (a division, a log, a dtype cast); check the "
            f"pipeline's options and the dtypes of its components."
        ),
        details={"localized_by": "call arguments", "arguments": arguments, "seen_in": seen_in, "phase": phase},
    )


def scheduler_origin(
    *,
    denoiser: str,
    model_output_finite: bool,
    sample_finite: bool,
    guidance: list[str],
    step: int | None,
    timestep: float | None,
    scheduler: str,
) -> Anomaly:
    """The one error for latents that became non-finite in a step whose denoiser output was
    finite: a non-finite guidance input, the guidance arithmetic, or ``scheduler.step`` itself."""
    if guidance:
        return input_origin(guidance, seen_in="the guidance step", step=step, timestep=timestep, phase="guidance")
    if not model_output_finite:
        return make_anomaly(
            kind="nonfinite",
            severity="error",
            component="pipeline",
            module="guidance",
            step=step,
            timestep=timestep,
            message=(
                f"{denoiser}'s output was finite but the model output passed to scheduler.step was not: the "
                f"guidance arithmetic between them made it (check guidance_scale, guidance_rescale and the dtype)."
            ),
            details={"localized_by": "scheduler.step arguments", "phase": "guidance"},
        )
    made = "its input latents were already non-finite" if not sample_finite else "from finite inputs"
    return make_anomaly(
        kind="nonfinite",
        severity="error",
        component="scheduler",
        module="step",
        step=step,
        timestep=timestep,
        message=(
            f"{scheduler}.step returned non-finite latents {made} (the model output was finite); check the "
            f"scheduler's config (prediction_type, sigmas, final_sigmas_type) and the latents' dtype."
        ),
        details={"localized_by": "scheduler.step arguments", "phase": "scheduler", "scheduler": scheduler},
    )


def downstream(anomaly: Anomaly, origin: Anomaly) -> Anomaly:
    """``anomaly`` as a warning that points at the run's one error ``origin`` by its ``where()``."""
    import dataclasses

    message = anomaly.message.rstrip(".")
    if anomaly.kind == "latent_divergence":  # its own guess at the cause gives way to the origin
        message = message.split(";")[0]
    return dataclasses.replace(
        anomaly,
        severity="warning",
        message=f"{message}; it follows the first NaN/Inf at {origin.where()}: fix that first.",
        details={**anomaly.details, "origin": origin.where()},
    )


def explain_received(
    component: str,
    kept: tuple[torch.nn.Module, tuple, dict] | None,
    pipe: Any,
    *,
    step: int | None,
    timestep: float | None,
    phase: str,
) -> Anomaly:
    """The origin of a NaN/Inf that ``component`` received (its kept call ``kept``: module, args,
    kwargs) while no watched module had made one: a non-finite pipeline input, else the
    pipeline's own code."""
    bad_inputs = nonfinite_names(pipeline_inputs(pipe))
    if bad_inputs:
        return input_origin(bad_inputs, seen_in=component, step=step, timestep=timestep, phase=phase)
    arguments = nonfinite_names(call_arguments(*kept)) if kept is not None else []
    return between_origin(arguments, seen_in=component, step=step, timestep=timestep, phase=phase)


def explain_latents(
    step_call: tuple[tuple, dict] | None,
    pipe: Any,
    *,
    step: int | None,
    timestep: float | None,
) -> Anomaly:
    """The origin of latents that became non-finite in a step whose denoiser output was finite,
    from that ``scheduler.step(*args, **kwargs)`` call (``step_call``) and the pipeline inputs."""
    from .components import find_denoiser

    inputs = pipeline_inputs(pipe)
    denoiser = find_denoiser(pipe)
    args, kwargs = step_call if step_call is not None else ((), {})
    model_output = kwargs.get("model_output", args[0] if args else None)
    sample = kwargs.get("sample", args[2] if len(args) > 2 else None)
    guidance = nonfinite_names({k: inputs[k] for k in GUIDANCE_NAMES if k in inputs})
    return scheduler_origin(
        denoiser=denoiser.name if denoiser is not None else "the denoiser",
        model_output_finite=not is_nonfinite(model_output),
        sample_finite=not is_nonfinite(sample),
        guidance=guidance,
        step=step,
        timestep=timestep,
        scheduler=type(getattr(pipe, "scheduler", None)).__name__,
    )
