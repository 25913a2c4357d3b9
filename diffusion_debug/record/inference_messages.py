"""The one sentence of inference anomalies whose text depends only on their own details: one
builder a kind, given to ``register_kind`` as its ``message`` in ``record/kinds.py``. Pure.
(Kinds whose advice depends on the component's role pass their message.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .anomaly import Anomaly


def latent_divergence(anomaly: Anomaly) -> str:
    d = anomaly.details
    if "nan" in d:
        cause = (
            "the model output was finite, so scheduler.step made them (check its config and dtype)"
            if anomaly.severity == "error"
            else "the denoiser output was already non-finite (see the nonfinite anomaly)"
        )
        return f"Latents became non-finite ({d['nan'] + d['posinf'] + d['neginf']} values); {cause}."
    if "std" in d:
        return (
            f"Latent std {d['std']:.3g} is {d['std'] / d['expected_std']:.1f}x what the noise level implies "
            f"({d['expected_std']:.3g}); check prediction_type, the scheduler and guidance_scale."
        )
    return (
        f"Latent norm grew {d['l2'] / d['previous_l2']:.1f}x in one step; check guidance_scale "
        "and the scheduler's prediction_type."
    )


def vae_saturation(anomaly: Anomaly) -> str:
    return (
        f"{anomaly.details['outside_fraction']:.1%} of decoded pixels lie outside [-1, 1] and will be clipped; check "
        "the latent scaling (vae.config.scaling_factor / shift_factor) and the VAE dtype."
    )


def prompt_truncated(anomaly: Anomaly) -> str:
    d = anomaly.details
    text = d["dropped_text"]
    shown = text if len(text) <= 80 else text[:77] + "..."
    return (
        f"{d['tokenizer']} keeps {d['max_length']} tokens, so {d['dropped_tokens']} token(s) of the "
        f'{d["prompt_role"]} were dropped ("{shown}"); shorten it, or use prompt embeddings built from chunks.'
    )
