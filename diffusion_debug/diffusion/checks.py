"""The diffusion checks: each turns measured values into anomalies (or none).

They measure nothing and touch no live tensor: the debugger fetches the numbers, these decide.
Each returns a list of :class:`~diffusion_debug.record.Anomaly` (possibly empty).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from ..probes import ModuleReading
from ..record import Anomaly, make_anomaly
from ..stats import TensorStats, dtype_max
from .components import find_components
from .roles import has_check

FP16_FIX_VAE = "madebyollin/sdxl-vae-fp16-fix"
HALF_DTYPES = ("float16", "bfloat16")


def vae_advice() -> str:
    return (
        f"keep the VAE in float32 (pipe.vae.to(torch.float32) or vae.config.force_upcast=True) "
        f"or use an fp16-fixed VAE such as {FP16_FIX_VAE}"
    )


# -- NaN / Inf ----------------------------------------------------------------------------


def nonfinite(
    component: str,
    module: str,
    *,
    step: int | None,
    timestep: float | None,
    localized_by: str,
    consequence: bool = False,
    details: dict[str, Any] | None = None,
    origin: str | None = None,
    role: str = "",
) -> list[Anomaly]:
    """The anomaly for a NaN/Inf seen in ``component`` (produced by ``module`` when known);
    ``origin``: where the run's first NaN/Inf was (a consequence points at it); ``role``: the
    component's role (its checks' advice comes from it, not from the attribute name)."""
    where = f"{component}.{module}" if module else component
    if consequence:
        earlier = f"the first NaN/Inf at {origin}" if origin else "the earlier anomaly (the first NaN/Inf producer)"
        message = f"{component} received non-finite input and passed it on; fix {earlier} rather than {component}."
        details = {**(details or {}), **({"origin": origin} if origin else {})}
        severity = "warning"
    else:
        advice = (
            f" ({vae_advice()})"
            if has_check(role, "vae")
            else " (check its dtype, inputs and weights; try float32 or bfloat16)"
        )
        message = f"{where} produced NaN/Inf from finite inputs{advice}."
        severity = "error"
    return [
        make_anomaly(
            kind="nonfinite",
            severity=severity,
            message=message,
            component=component,
            module=module,
            step=step,
            timestep=timestep,
            details={"localized_by": localized_by, **(details or {})},
        )
    ]


# -- fp16 / bf16 overflow -------------------------------------------------------------------


def overflow_candidates(readings: Iterable[ModuleReading], fraction: float) -> list[ModuleReading]:
    """Half-precision readings whose output abs-max reached ``fraction`` of the dtype's max."""
    return [
        r
        for r in readings
        if r.dtype in HALF_DTYPES and r.dtype_max_fraction is not None and r.dtype_max_fraction >= fraction
    ]


def overflow_producer(readings: Iterable[ModuleReading], fraction: float) -> ModuleReading | None:
    """The first risky reading whose inputs were still below the threshold: where the large
    values were made (not the modules that merely pass them on)."""
    for r in overflow_candidates(readings, fraction):
        limit = dtype_max(getattr(torch, r.dtype))
        if r.input_absmax is None or not math.isfinite(r.input_absmax) or r.input_absmax / limit < fraction:
            return r
    return None


def overflow_risk(
    component: str,
    reading: ModuleReading,
    *,
    step: int | None,
    timestep: float | None,
    fraction: float,
    localized_by: str,
    role: str = "",
) -> list[Anomaly]:
    share = reading.dtype_max_fraction or 0.0
    if has_check(role, "vae"):
        advice = vae_advice()
    else:
        advice = "run this component in bfloat16 or float32, or upcast this module"
    return [
        make_anomaly(
            kind="overflow_risk",
            severity="warning",
            message=(
                f"{component}.{reading.module} output reached {share:.0%} of the {reading.dtype} maximum "
                f"(|x|={reading.output_absmax:.4g}); {advice}."
            ),
            component=component,
            module=reading.module,
            step=step,
            timestep=timestep,
            details={
                "absmax": reading.output_absmax,
                "dtype_max_fraction": share,
                "dtype": reading.dtype,
                "threshold": fraction,
                "localized_by": localized_by,
            },
        )
    ]


# -- latents ----------------------------------------------------------------------------------


def expected_latent_std(sigma: float | None, init_noise_sigma: float) -> float:
    """The std a latent should roughly have at noise level ``sigma``: sqrt(1 + sigma^2) for
    variance-exploding schedulers (init_noise_sigma > 1), about 1 otherwise (variance-preserving
    and flow-matching latents)."""
    if sigma is not None and init_noise_sigma > 1.0 and math.isfinite(sigma):
        return math.sqrt(1.0 + sigma * sigma)
    return 1.0


def latent_divergence(
    latents: TensorStats,
    *,
    expected_std: float,
    tolerance: float,
    step: int | None,
    timestep: float | None,
    model_output_finite: bool = True,
    previous_l2: float | None = None,
) -> list[Anomaly]:
    """NaN latents, latent std far above what the noise level implies, or an exploding norm."""
    if not latents.is_finite:
        return [
            make_anomaly(
                kind="latent_divergence",
                severity="error" if model_output_finite else "warning",
                step=step,
                timestep=timestep,
                details={"nan": latents.nan, "posinf": latents.posinf, "neginf": latents.neginf},
            )
        ]
    out = []
    std = latents.std or 0.0
    if std > tolerance * expected_std:
        out.append(
            make_anomaly(
                kind="latent_divergence",
                severity="warning",
                step=step,
                timestep=timestep,
                details={"std": std, "expected_std": expected_std, "tolerance": tolerance},
            )
        )
    elif previous_l2 and latents.l2 and latents.l2 > tolerance * 2 * previous_l2:
        out.append(
            make_anomaly(
                kind="latent_divergence",
                severity="warning",
                step=step,
                timestep=timestep,
                details={"l2": latents.l2, "previous_l2": previous_l2},
            )
        )
    return out


# -- VAE output --------------------------------------------------------------------------------


def vae_saturation(
    outside_fraction: float,
    image_ranges: list[float],
    *,
    threshold: float,
    step: int | None,
    component: str = "vae",
) -> list[Anomaly]:
    """Decoded pixels outside [-1, 1] (``vae_saturation``), or images that are one flat colour
    although finite (``constant_image``: a black image that is not a NaN); ``component``: the
    VAE-role component that decoded them."""
    out = []
    flat = [i for i, r in enumerate(image_ranges) if r == r and r < 1e-6]
    if flat:
        out.append(
            make_anomaly(
                kind="constant_image",
                severity="warning",
                component=component,
                step=step,
                message=(
                    f"{len(flat)} decoded image(s) are a single flat colour (often a black image from "
                    f"an fp16 VAE: {vae_advice()})."
                ),
                details={"flat_images": flat, "image_ranges": image_ranges},
            )
        )
    if outside_fraction == outside_fraction and outside_fraction > threshold:
        out.append(
            make_anomaly(
                kind="vae_saturation",
                severity="warning",
                component=component,
                step=step,
                details={"outside_fraction": outside_fraction, "threshold": threshold},
            )
        )
    return out


# -- prompts ----------------------------------------------------------------------------------


def count_dropped_tokens(tokenizer: Any, text: str, max_length: int) -> tuple[int, str]:
    """Tokens of ``text`` beyond ``max_length`` (special tokens included, as the pipeline pads
    and truncates them) and the text they spell."""
    ids = tokenizer(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    if len(ids) <= max_length:
        return 0, ""
    eos = getattr(tokenizer, "eos_token_id", None)
    tail = 1 if eos is not None and ids and ids[-1] == eos else 0
    dropped = ids[max_length - tail : len(ids) - tail]
    return len(dropped), tokenizer.decode(dropped, skip_special_tokens=True).strip()


def prompt_truncated(
    component: str,
    tokenizer_name: str,
    role: str,
    index: int,
    dropped: int,
    dropped_text: str,
    max_length: int,
) -> list[Anomaly]:
    if dropped <= 0:
        return []
    return [
        make_anomaly(
            kind="prompt_truncated",
            severity="warning",
            component=component,
            details={
                "tokenizer": tokenizer_name,
                "prompt_role": role,
                "prompt_index": index,
                "dropped_tokens": dropped,
                "dropped_text": dropped_text,
                "max_length": max_length,
            },
        )
    ]


# -- configuration ------------------------------------------------------------------------------


def truncated_prompts(texts: Iterable[Any]) -> list[tuple[Anomaly, tuple]]:
    """``prompt_truncated`` (with its fold key) for each prompt text (a ``PromptText``: encoder,
    tokenizer_name, tokenizer, role, index, text, max_length) longer than its tokenizer keeps."""
    found = []
    for p in texts:
        dropped, dropped_text = count_dropped_tokens(p.tokenizer, p.text, p.max_length)
        for anomaly in prompt_truncated(
            p.encoder, p.tokenizer_name, p.role, p.index, dropped, dropped_text, p.max_length
        ):
            found.append((anomaly, ("prompt_truncated", p.tokenizer_name, p.role, p.index)))
    return found


SIGMA_SCHEDULE_KEYS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")
CONTINUOUS_CLASSES = ("EDM", "FlowMatch", "CMStochastic", "ScoreSdeVe", "CogVideoX")


def continuous_schedule(scheduler: Any) -> bool:
    """Whether the scheduler's steps come from a sigma schedule or continuous time (Karras,
    exponential or beta sigmas, ``timestep_type="continuous"``, EDM, flow matching), where
    ``timestep_spacing`` and ``steps_offset`` do not pick the timesteps."""
    config = getattr(scheduler, "config", {}) or {}
    if any(config.get(key) for key in SIGMA_SCHEDULE_KEYS) or config.get("timestep_type") == "continuous":
        return True
    return any(part in type(scheduler).__name__ for part in CONTINUOUS_CLASSES) or "sigma_schedule" in config


def scheduler_config(
    scheduler: Any, *, num_inference_steps: int | None = None, first_timestep: float | None = None
) -> list[Anomaly]:
    """A few settings known to spoil images, with the setting to change. The spacing rules hold
    for discrete schedules only (see :func:`continuous_schedule`): a Karras-sigma or
    continuous-time scheduler starts at its largest sigma whatever ``timestep_spacing`` says."""
    config = getattr(scheduler, "config", {}) or {}
    discrete = not continuous_schedule(scheduler)
    name = type(scheduler).__name__
    out = []

    def add(message: str, rule: str, **details: Any) -> None:
        out.append(
            make_anomaly(
                kind="scheduler_config",
                severity="warning",
                message=message,
                details={"rule": rule, "scheduler": name, **details},
            )
        )

    zero_snr = bool(config.get("rescale_betas_zero_snr", False))
    prediction = config.get("prediction_type")
    spacing = config.get("timestep_spacing")
    if zero_snr and prediction == "epsilon":
        add(
            f"{name} has rescale_betas_zero_snr=True with prediction_type='epsilon', which cannot predict "
            "noise at zero SNR; use a v-prediction model with prediction_type='v_prediction' or turn the rescale "
            "off.",
            "zero_snr_epsilon",
            prediction_type=prediction,
        )
    if zero_snr and spacing not in (None, "trailing"):
        add(
            f"{name} has rescale_betas_zero_snr=True with timestep_spacing={spacing!r}, so sampling never starts "
            f"from pure noise; set timestep_spacing='trailing'.",
            "zero_snr_spacing",
            timestep_spacing=spacing,
        )
    if discrete and spacing == "leading" and config.get("steps_offset", 1) == 0 and "steps_offset" in config:
        add(
            f"{name} has timestep_spacing='leading' with steps_offset=0, so the last step lands on t=0 instead of "
            f"t=1 as Stable Diffusion was trained; set steps_offset=1.",
            "steps_offset",
            steps_offset=0,
        )
    train = config.get("num_train_timesteps")
    if (
        discrete
        and num_inference_steps
        and first_timestep is not None
        and train
        and spacing == "leading"
        and first_timestep < 0.9 * (train - 1)
    ):
        add(
            f"With {num_inference_steps} steps and timestep_spacing='leading' the first step is t={first_timestep:g} "
            f"of {train}, so sampling starts from a partly denoised level and images look washed out; "
            f"set timestep_spacing='trailing' or use more steps.",
            "leading_spacing_few_steps",
            num_inference_steps=num_inference_steps,
            first_timestep=first_timestep,
        )
    return out


def static_checks(pipe: Any, dtypes: dict[str, str | None]) -> list[tuple[Anomaly, tuple | None]]:
    """``(anomaly, fold key)`` for the scheduler and dtype settings (once per attach); ``None``: the kind's."""
    scheduler = getattr(pipe, "scheduler", None)
    found = [(a, ("scheduler_config", a.details.get("rule"))) for a in scheduler_config(scheduler)]
    denoiser = next(iter(dtypes), "")  # the denoiser comes first
    return found + [(a, None) for a in dtype_mismatch(pipe, dtypes, denoiser)]


def dtype_mismatch(pipe: Any, dtypes: dict[str, str | None], denoiser: str) -> list[Anomaly]:
    """Component dtypes that are known to bite."""
    out = []
    # the VAE-role component, whatever the pipeline calls it (Kandinsky's is ``movq``)
    vae_name, vae = next(((c.name, c.module) for c in find_components(pipe) if has_check(c.role, "vae")), ("", None))
    vae_config = getattr(vae, "config", {}) or {}
    is_sdxl_vae = (
        vae_config.get("scaling_factor") == 0.13025 or hasattr(pipe, "upcast_vae") and "XL" in type(pipe).__name__
    )
    if dtypes.get(vae_name) == "float16" and is_sdxl_vae and not vae_config.get("force_upcast", False):
        out.append(
            make_anomaly(
                kind="dtype_mismatch",
                severity="warning",
                component=vae_name,
                message=(
                    f"The SDXL VAE is float16 with force_upcast=False, and the stock SDXL VAE overflows in float16 "
                    f"(black or NaN images); {vae_advice()}."
                ),
                details={"vae_dtype": "float16", "force_upcast": False},
            )
        )
    halves = {name: d for name, d in dtypes.items() if d in HALF_DTYPES}
    if len(set(halves.values())) > 1:
        out.append(
            make_anomaly(
                kind="dtype_mismatch",
                severity="warning",
                component=denoiser,
                message=(
                    f"Components mix float16 and bfloat16 ({', '.join(f'{k}={v}' for k, v in halves.items())}); "
                    f"values cast from bfloat16 to float16 can overflow, so load every component in one dtype."
                ),
                details={"dtypes": dtypes},
            )
        )
    return out
