"""Classifier-free guidance as a pipeline does it: whether a step's denoiser output holds an
unconditional and a conditional half, so that the guidance gap can be measured.

>>> cfg_batch(2, output_batch=2, guidance_scale=4.0, guidance_embedded=False)
1

Most pipelines pass ``scheduler.step`` the batch of latents (B) and call the denoiser on 2B; DiT
passes the doubled latents (2B) as the step's ``sample``, so the halves are found from the
pipeline's ``guidance_scale`` instead.

Limits: a guidance-distilled model (``guidance_embeds`` in its config, as Flux) does no
classifier-free guidance whatever its ``guidance_scale``; a pipeline that doubles its latents for
another reason than guidance with ``guidance_scale > 1`` would have its two halves compared.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch

from .origins import pipeline_inputs
from .step_values import StepInputs


def cfg_batch(
    batch: int | None, *, output_batch: int | None, guidance_scale: Any, guidance_embedded: bool
) -> int | None:
    """The batch a step's halves split into: ``batch`` unchanged, or half of it when the
    scheduler's sample was itself doubled for classifier-free guidance (DiT)."""
    doubled = batch is not None and output_batch == batch and batch % 2 == 0
    scale = guidance_scale if isinstance(guidance_scale, numbers.Real) else None  # numpy's numbers too
    if doubled and scale is not None and scale > 1.0 and not guidance_embedded:
        return batch // 2
    return batch


def guidance_embedded(module: Any) -> bool:
    """Whether a denoiser takes the guidance scale as an input (no classifier-free guidance)."""
    config = getattr(module, "config", None) or {}
    try:
        return bool(config.get("guidance_embeds", False))
    except AttributeError:
        return False


def with_cfg_batch(inputs: StepInputs, denoiser: Any, pipe: Any) -> StepInputs:
    """``inputs`` whose batch counts the latents once when the pipeline doubled its sample for
    guidance (DiT); the pipeline's ``guidance_scale`` is read (a frame walk, no tensor op) only
    for such a step. ``denoiser``: the denoiser's Component (or None)."""
    output, batch = inputs.denoiser_output, inputs.batch
    if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[0] != batch or denoiser is None:
        return inputs
    scale = pipeline_inputs(pipe).get("guidance_scale")
    halved = cfg_batch(
        batch, output_batch=output.shape[0], guidance_scale=scale, guidance_embedded=guidance_embedded(denoiser.module)
    )
    return dataclasses.replace(inputs, batch=halved) if halved != batch else inputs
