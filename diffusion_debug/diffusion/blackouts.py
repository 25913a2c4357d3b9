"""Black images that are not NaN: the safety checker's blackout.

A Stable Diffusion pipeline's ``run_safety_checker(image, device, dtype)`` returns
``(image, has_nsfw_concept)`` and replaces each flagged image by a black one; the latents and the
VAE's output were finite and varied, so no other check sees it. (An image that is one flat colour
after decoding is ``constant_image``, found with the VAE-decode check in ``checks``.)

Limits: only pipelines with a ``run_safety_checker`` method are seen (the Stable Diffusion
family); a safety checker run by hand outside the pipeline call is not.
"""

from __future__ import annotations

from typing import Any

from ..record import Anomaly, make_anomaly
from ..stats import read_now


def flagged_images(has_nsfw_concept: Any) -> list[int]:
    """The indices of the images the safety checker flagged (``has_nsfw_concept`` is a list of
    booleans, a bool tensor, or None when the pipeline has no safety checker)."""
    if has_nsfw_concept is None:
        return []
    if hasattr(has_nsfw_concept, "tolist"):
        has_nsfw_concept = read_now(has_nsfw_concept)
    if isinstance(has_nsfw_concept, bool):
        has_nsfw_concept = [has_nsfw_concept]
    try:
        return [i for i, flag in enumerate(has_nsfw_concept) if bool(flag)]
    except TypeError:  # not a sequence: nothing we can read
        return []


def safety_blackout(has_nsfw_concept: Any) -> list[Anomaly]:
    """One ``safety_blackout`` anomaly naming the images the safety checker blacked out."""
    flagged = flagged_images(has_nsfw_concept)
    if not flagged:
        return []
    return [
        make_anomaly(
            kind="safety_blackout",
            severity="warning",
            component="safety_checker",
            details={"flagged_images": flagged},
        )
    ]
