"""Determinism: the same call twice with the same seed must give the same image.

:func:`compare_runs` takes the step rows of two pipeline runs (as the debugger recorded them,
``run`` 1 and 2) and the two images, and returns a ``nondeterministic`` anomaly naming the first
step whose latents differ (by their recorded mean, std or L2) and the largest pixel difference;
nothing when the images are equal.

:func:`global_rng_drawn` sees the same fault in one call: given ``generator=``, the call drew from
torch's global CPU generator too (I2VGen-XL's ``vae.encode(image).latent_dist.sample()``), so the
same generator gives another image at the next call. The debugger compares the global generator's
state as the run began (its first component call) with its state as the call ends (diffusers'
``maybe_free_model_hooks``): one ``aten.equal`` of two 5 KB CPU tensors a pipeline call given a generator
of its own, none a step; a call given none, or the global one, copies and compares nothing.

Limits: a call given no generator draws from the global generator by design and is reproducible after
the same ``torch.manual_seed``, which cannot be seen, so it is not flagged; a draw before the run's
first component call, a CUDA generator's draws and a pipeline with no call end of diffusers' (Modular
Diffusers) are not seen. Two calls' latents are compared through their recorded statistics, not element by element (two
runs whose latents differ only in a way that leaves mean, std and L2 equal to the printed digits
are caught by the images alone, with ``step`` None); steps skipped by ``max_debug_iterations``
are not compared.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..record import Anomaly, make_anomaly

LATENT_KEYS = ("mean", "std", "l2")


def _latents(row: dict[str, Any]) -> tuple | None:
    stats = row.get("latents")
    return tuple(stats.get(key) for key in LATENT_KEYS) if isinstance(stats, dict) else None


def _same(a: Any, b: Any) -> bool:
    return a == b or (a != a and b != b)  # NaN equals NaN here: both runs broke the same way


def first_differing_step(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> int | None:
    """The first step whose latent statistics differ between the two runs' rows (None if none)."""
    by_step = {row["step"]: row for row in second if isinstance(row.get("step"), int)}
    for row in first:
        other = by_step.get(row.get("step"))
        a, b = _latents(row), _latents(other) if other is not None else None
        if a is None or b is None:
            continue
        if not all(_same(x, y) for x, y in zip(a, b)):
            return row["step"]
    return None


def pixels(image: Any) -> np.ndarray:
    """An image (PIL, numpy or tensor) as a float array."""
    if hasattr(image, "detach"):
        image = image.detach().float().cpu().numpy()
    return np.asarray(image, dtype=np.float64)


def compare_runs(
    first_rows: list[dict[str, Any]], second_rows: list[dict[str, Any]], first_image: Any, second_image: Any
) -> list[Anomaly]:
    """One ``nondeterministic`` anomaly when the two images differ, else none."""
    a, b = pixels(first_image), pixels(second_image)
    if a.shape == b.shape:
        difference = np.abs(a - b)
        max_difference = float(np.nanmax(difference)) if difference.size else 0.0
        if max_difference == 0.0 and np.array_equal(np.isnan(a), np.isnan(b)):
            return []
    else:
        max_difference = float("inf")
    step = first_differing_step(first_rows, second_rows)
    return [
        make_anomaly(
            kind="nondeterministic",
            severity="warning",
            step=step,
            details={"first_step": step, "max_pixel_difference": max_difference, "shapes": [a.shape, b.shape]},
        )
    ]


def global_rng_drawn(generator: Any) -> list[Anomaly]:
    """One ``nondeterministic`` anomaly for a call that moved torch's global CPU generator while it was
    given ``generator`` (one or a list): none when it was given none, or the global generator itself
    (``generator=torch.manual_seed(0)``, reproducible after the same seed)."""
    given = generator if isinstance(generator, (list, tuple)) else [generator]
    if not given or not all(isinstance(g, torch.Generator) for g in given):
        return []
    if any(g is torch.default_generator for g in given):
        return []
    return [make_anomaly(kind="nondeterministic", component="pipeline", details={"reason": "global_rng"})]
