"""Classifier-free guidance as a pipeline does it: whether a step's denoiser output holds an
unconditional and a conditional half, so that the guidance gap can be measured.

>>> cfg_batch(2, output_batch=2, guidance_scale=4.0, guidance_embedded=False)
1

Most pipelines pass ``scheduler.step`` the batch of latents (B) and call the denoiser on 2B; DiT
passes the doubled latents (2B) as the step's ``sample``, so the halves are found from the
pipeline's ``guidance_scale`` instead, unless the batch is the one the call asked for (prompts or
class labels times ``num_*_per_prompt``): Wan's two videos of one prompt, each guided by a call of
its own, are not an unconditional and a conditional half.

Limits: a guidance-distilled model (``guidance_embeds`` in its config, as Flux) does no
classifier-free guidance whatever its ``guidance_scale``; a pipeline that doubles its latents for
another reason than guidance with ``guidance_scale > 1``, and whose call's batch is not found from
its arguments, would have its two halves compared.
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


def asked_batch(values: dict[str, Any]) -> int | None:
    """The batch a pipeline call asked for, from its arguments: the prompts (or prompt embeddings,
    or class labels) times every ``num_*_per_prompt``; None where no such argument says.

    >>> asked_batch({"prompt": ["a", "b"], "num_videos_per_prompt": 2}), asked_batch({"class_labels": [1]})
    (4, 1)
    """
    prompt, embeds, labels = values.get("prompt"), values.get("prompt_embeds"), values.get("class_labels")
    if isinstance(prompt, str):
        count = 1
    elif isinstance(prompt, (list, tuple)):
        count = len(prompt)
    elif isinstance(embeds, torch.Tensor) and embeds.dim() > 0:
        count = embeds.shape[0]
    elif isinstance(labels, (list, tuple)):
        count = len(labels)
    elif isinstance(labels, int) or (isinstance(labels, torch.Tensor) and labels.dim() <= 1):
        count = 1 if isinstance(labels, int) else labels.numel()
    else:
        return None
    for name, copies in values.items():
        if name.startswith("num_") and name.endswith("_per_prompt") and isinstance(copies, int) and copies > 0:
            count *= copies
    return count


def with_cfg_batch(inputs: StepInputs, denoiser: Any, pipe: Any) -> StepInputs:
    """``inputs`` whose batch counts the latents once when the pipeline doubled its sample for
    guidance (DiT); the pipeline's ``guidance_scale`` is read (a frame walk, no tensor op) only
    for such a step. ``denoiser``: the denoiser's Component (or None)."""
    output, batch = inputs.denoiser_output, inputs.batch
    if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.shape[0] != batch or denoiser is None:
        return inputs
    values = pipeline_inputs(pipe)
    if asked_batch(values) == batch:  # the images asked for, each guided apart (Wan) or not at all
        return inputs
    scale = values.get("guidance_scale")
    halved = cfg_batch(
        batch, output_batch=output.shape[0], guidance_scale=scale, guidance_embedded=guidance_embedded(denoiser.module)
    )
    return dataclasses.replace(inputs, batch=halved) if halved != batch else inputs
