"""The diffusion checks: what measured values show (a step's readings: :func:`step_plan`; which replays
they call for, and what a replay names: :mod:`.replay.decide`), and the anomalies they make: lists of
:class:`~diffusion_debug.record.Anomaly` (possibly empty), whose sentence the kind's builder writes from its
details (``record/inference_messages.py``). They measure nothing and touch no live tensor: the debugger
fetches the numbers (and replays), these decide (the details a VAE's advice shares: :mod:`.components.vae_details`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..probes import ModuleReading, find_producer
from ..record import Anomaly, make_anomaly
from ..stats import TensorStats, dtype_name
from .components.vae_details import autocast_details, vae_details

HALF_DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class Suspects:
    """What one call's readings show, read once: the first non-finite output, the first module
    that made NaN/Inf from finite inputs, the first that made near-overflow values."""

    first_nonfinite: ModuleReading | None
    producer: ModuleReading | None
    overflow: ModuleReading | None


_SMALLEST_HALF_MAX = float(torch.finfo(torch.float16).max)  # of the HALF_DTYPES overflow is checked in
NONE = Suspects(None, None, None)
"""What a clean call's readings show (:func:`suspects` returns this very object)."""


@dataclass(frozen=True)
class StepPlan:
    """What one denoising step's readings call for, decided once (:func:`step_plan`): the components
    to check, in the order they ran, and the kept call a localising replay takes."""

    checked: dict[str, Suspects]
    """Each component that shows something, and what, in execution order (empty: non-finite latents alone)."""
    denoiser: str
    """The denoiser whose readings and output the step's checks read: the one whose call made the
    step's first NaN/Inf (Wan 2.2's two experts), else the one that ran the step."""
    output_finite: bool
    """Whether every denoiser output of the step is finite (the other components count as finite)."""
    maker: str | None
    """Whose kept calls a replay takes (None: as kept, the step's own: its expert was not told)."""
    back: int
    """How many of ``maker``'s calls before its last one the replayed call is (0: the last)."""


def step_plan(
    readings: dict[str, list[ModuleReading]],
    *,
    output_finite: bool,
    latents_finite: bool,
    first_nonfinite_output: int | None,
    makers: list[str | None],
    expert: str | None,
    denoiser: str,
    fraction: float,
) -> StepPlan | None:
    """What one step's readings (by component) call for; None for a clean step (nothing to check,
    localise or replay: its latents' warnings at most). ``expert``: the denoiser component that ran
    the step's last call (None where not told: ``denoiser``, the pipeline's first); a NaN/Inf an
    earlier call made (``first_nonfinite_output`` outputs before the last) is checked on the component
    whose call it was (``makers``: each output's, :func:`made_by`), with its readings.

    >>> step_plan({}, output_finite=True, latents_finite=True, first_nonfinite_output=None,
    ...           makers=["unet"], expert=None, denoiser="unet", fraction=0.5) is None
    True
    >>> plan = step_plan({}, output_finite=False, latents_finite=False, first_nonfinite_output=1,
    ...                  makers=["transformer", "transformer_2"], expert="transformer_2", denoiser="transformer",
    ...                  fraction=0.5)
    >>> list(plan.checked), plan.denoiser, plan.maker, plan.back
    (['transformer'], 'transformer', 'transformer', 0)
    """
    maker, back = expert, first_nonfinite_output or 0
    if back:  # an earlier call of the step made the NaN/Inf: of this expert or of another one (Wan 2.2's two)
        maker, back = made_by(makers, back, expert)
    stepping, seen = maker or denoiser, {}
    if readings or not output_finite:  # ControlNets and adapters run before the denoiser they feed
        for name, found in readings.items():
            if name != stepping and found:
                shown = suspects(found, fraction)
                if shown is not NONE:
                    seen[name] = shown
        if stepping or not output_finite:  # the denoiser counts also unprobed (compiled, probes off) when its
            found = readings.get(stepping)  # output is not finite
            shown = suspects(found, fraction) if found else NONE
            if shown is not NONE or not output_finite:
                seen[stepping] = shown
    if not seen and latents_finite:
        return None
    return StepPlan(seen, stepping, output_finite, maker, back)


def made_by(makers: list[str | None], back: int, last: str | None) -> tuple[str | None, int]:
    """The component whose call made the output ``back`` outputs before the step's last (``makers``:
    each of the step's denoiser outputs' maker, oldest first; ``last``: the expert of the step's last
    call, where not known), and how many of that component's own calls came after it (the call its
    kept calls hold ``back``).

    >>> made_by(["transformer", "transformer_2", "transformer_2"], 2, "transformer_2")
    ('transformer', 0)
    >>> made_by(["unet", "unet", "unet"], 2, "unet")
    ('unet', 2)
    """
    index = len(makers) - 1 - back
    if not 0 <= index < len(makers) or makers[index] is None:
        return last, back
    component = makers[index]
    return component, makers[index + 1 :].count(component)


def suspects(readings: list[ModuleReading], fraction: float) -> Suspects:
    """The :class:`Suspects` of ``readings`` (``fraction``: of the dtype's max, for overflow).
    Readings whose values are all finite and below ``fraction`` of fp16's largest value (a clean
    call's, nearly always) show none (:data:`NONE`), found in one pass over plain floats."""
    quiet, inf = fraction * _SMALLEST_HALF_MAX, math.inf  # NaN compares False: not quiet
    for r in readings:  # a loop, not all() over a generator: no Python call per reading
        output, inputs = r.output_value, r.input_value
        if not ((output is None or -quiet < output < quiet) and (inputs is None or -inf < inputs < inf)):
            return Suspects(first_nonfinite(readings), find_producer(readings), overflow_producer(readings, fraction))
    return NONE


# -- NaN / Inf ----------------------------------------------------------------------------


def first_nonfinite(readings: Iterable[ModuleReading]) -> ModuleReading | None:
    """The first reading whose output is non-finite, whatever its inputs."""
    return next((r for r in readings if not r.output_finite), None)


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
    sd_vae: bool = False,
    upcast: dict[str, Any] | None = None,
    dtype: str | None = None,
    near_max: tuple[ModuleReading, ModuleReading] | None = None,
    read_as: str | None = None,
    autocast: str | None = None,
) -> list[Anomaly]:
    """The anomaly for a NaN/Inf seen in ``component`` (produced by ``module`` when known);
    ``origin``: where the run's first NaN/Inf was (a consequence points at it); ``role``: the
    component's role (its checks' advice comes from it, not from the attribute name); ``sd_vae``:
    it is Stable Diffusion's VAE (``upcast``: its pipeline's :func:`~.components.vae_details.upcast_details`);
    ``dtype``: the dtype the component computes in, when known (a float32 VAE is not told to keep to float32);
    ``near_max``: ``(the module that made the near-max values module overflowed on, module's reading)``
    (:func:`~.replay.near_max.near_max_maker`): two anomalies, :func:`near_max_nonfinite`'s; ``read_as``: the dtype
    the module's output was read in, where known and its weights finite (float16 from float32 weights: it ran under
    float16 autocast, whose advice differs, :func:`autocast_details`; bfloat16, a NaN weight's: not autocast's);
    ``autocast``: the dtype an open autocast computed the component in (a float32 VAE's advice says it)."""
    if near_max is not None and not consequence:
        kw = dict(step=step, timestep=timestep, localized_by=localized_by, role=role, sd_vae=sd_vae, upcast=upcast)
        return list(
            near_max_nonfinite(component, *near_max, details=details or {}, dtype=dtype, autocast=autocast, **kw)
        )
    if consequence:
        details = {**(details or {}), "passed_on": True, **({"origin": origin} if origin else {})}
    else:
        found = autocast_details(dtype, read_as) if read_as == "float16" else {}  # (bfloat16's: no autocast advice)
        autocast_dtype, autocast = autocast, {**found, "dtype": "float16"} if found else {}
        details = {**(details or {}), **vae_details(role, sd_vae, dtype, autocast_dtype, upcast), **autocast}
    return [
        make_anomaly(
            kind="nonfinite",
            severity="warning" if consequence else "error",
            component=component,
            module=module,
            step=step,
            timestep=timestep,
            details={"localized_by": localized_by, **details},
        )
    ]


def near_max_nonfinite(
    component: str,
    maker: ModuleReading,
    overflowed: ModuleReading,
    *,
    step: int | None,
    timestep: float | None,
    localized_by: str,
    details: dict[str, Any],
    role: str = "",
    sd_vae: bool = False,
    upcast: dict[str, Any] | None = None,
    dtype: str | None = None,
    autocast: str | None = None,
) -> tuple[Anomaly, Anomaly]:
    """A NaN/Inf that ``overflowed`` (a module of ``component``) made from finite values near its dtype's
    max, which ``maker`` made (:func:`~.replay.near_max.near_max_maker`): ``(the error at maker, the run's origin; the
    warning at overflowed, which follows it)``. A ``nonfinite`` at the cause, as a NaN/Inf made from the
    near-max values a pipeline input held is (``origins.near_max_input``); ``details``: what the caller
    found (the phase, the replay's reading count; where inside ``overflowed`` its own code made it, ``after``
    and ``before``: :func:`~.replay.decide.between_modules`, are the warning's); ``autocast``: :func:`nonfinite`'s."""
    between = {key: details[key] for key in ("after", "before") if key in details}
    details = {key: value for key, value in details.items() if key not in between}
    place = dict(kind="nonfinite", component=component, step=step, timestep=timestep)
    origin = make_anomaly(
        severity="error",
        module=maker.module,
        **place,
        details={
            "localized_by": localized_by,
            **details,
            "near_max": maker.dtype_max_fraction,
            "absmax": maker.output_absmax,
            "dtype": maker.dtype,
            "overflowed_in": overflowed.module,
            **vae_details(role, sd_vae, dtype, autocast, upcast),
            **autocast_details(dtype, maker.dtype),
        },
    )
    follows = {"kind": "nonfinite", "rank": origin.rank, "module": maker.module}
    consequence = make_anomaly(
        severity="warning",
        module=overflowed.module,
        **place,
        details={
            "localized_by": localized_by,
            "phase": details.get("phase"),
            "near_max_from": maker.module,
            "input_near_max": overflowed.input_dtype_max_fraction,
            "dtype": overflowed.dtype,
            "follows": follows,
            **between,
        },
    )
    return origin, consequence


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
        share = r.input_dtype_max_fraction
        if share is None or not math.isfinite(share) or share < fraction:
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
    sd_vae: bool = False,
    upcast: dict[str, Any] | None = None,
    between: dict[str, str] | None = None,
    compiled: bool | str = False,
    weights_dtype: str | None = None,
    autocast: str | None = None,
) -> list[Anomaly]:
    """``between``: the modules the component's own forward built the values between
    (:func:`~.replay.decide.overflow_between`), ``reading`` being the component's; ``compiled``: the
    reading is a compiled component's output, nothing inside it read (its message says so), ``"replayed"``
    where an uncompiled replay of the call was made and named no module (``eager_replay``: its message says that);
    ``weights_dtype``: the dtype of the module's weights, kept where it is not the output's while an
    autocast region to that dtype is open (:func:`~.components.autocast.autocast_on`: a float32 module's float16
    output ran under ``torch.autocast``, whose advice differs; without one it is a module diffusers keeps in
    float32 in a float16 model, ``_keep_in_fp32_modules``, which casts its output back: the float16 advice holds);
    ``autocast``: :func:`nonfinite`'s (a float16 VAE's under float16 autocast: upcasting it alone changes nothing)."""
    share = reading.dtype_max_fraction or 0.0
    return [
        make_anomaly(
            kind="overflow_risk",
            severity="warning",
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
                **vae_details(role, sd_vae, weights_dtype, autocast, upcast),
                **(between or {}),
                **({"compiled": True} if compiled else {}),
                **({"eager_replay": True} if compiled == "replayed" else {}),
                **autocast_details(weights_dtype, reading.dtype),
            },
        )
    ]


def input_overflow_risk(
    near_max: dict[str, float], seen_in: str, *, step: int | None, timestep: float | None, fraction: float
) -> Anomaly:
    """``overflow_risk`` at the pipeline inputs the user passed at ``fraction`` of their dtype's max or
    beyond (``near_max``: name -> share), which ``seen_in`` was given: theirs, not a module's."""
    names = list(near_max)
    return make_anomaly(
        kind="overflow_risk",
        severity="warning",
        component="input",
        module=names[0],
        step=step,
        timestep=timestep,
        details={
            "dtype_max_fraction": near_max[names[0]],
            "threshold": fraction,
            "localized_by": "pipeline inputs",
            "inputs": names,
            "seen_in": seen_in,
        },
    )


# -- latents ----------------------------------------------------------------------------------


def expected_latent_std(sigma: float | None, init_noise_sigma: float) -> float:
    """The std a latent should roughly have at noise level ``sigma``: sqrt(1 + sigma^2) for
    variance-exploding schedulers (init_noise_sigma > 1), about 1 otherwise (variance-preserving
    and flow-matching latents)."""
    if sigma is not None and init_noise_sigma > 1.0 and math.isfinite(sigma):
        return math.sqrt(1.0 + sigma * sigma)
    return 1.0


def is_gaussian(latents: TensorStats) -> bool:
    """Whether ``latents`` are values a noise level describes (floating point), not token ids.

    >>> from diffusion_debug.stats import tensor_stats
    >>> is_gaussian(tensor_stats(torch.randn(2, 4))), is_gaussian(tensor_stats(torch.arange(8)))
    (True, False)
    """
    dtype = getattr(torch, latents.dtype, None)
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


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
    """NaN latents, latent std far above what the noise level implies, or an exploding norm; none
    for integer latents (text diffusion's token ids: no noise level, and an id is always finite)."""
    if not is_gaussian(latents):
        return []
    if latents.nan or latents.posinf or latents.neginf:  # (not latents.is_finite, inline: at every step)
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


def latent_findings(
    latents: TensorStats,
    scalars: dict[str, float | None],
    *,
    step: int,
    output_finite: bool,
    init_noise_sigma: float,
    tolerance: float,
    previous_l2: float | None,
) -> list[tuple[Anomaly, tuple]]:
    """``latent_divergence`` (with its fold key) for a step's latents against the std expected at
    the step's noise level (``scalars``: its ``timestep``, ``sigma`` and ``sigma_next``, the next
    sigma read where the scheduler has one); ``output_finite``: every denoiser output of the step was."""
    sigma = scalars["sigma_next"] if scalars["sigma_next"] is not None else scalars["sigma"]
    found = latent_divergence(
        latents,
        expected_std=expected_latent_std(sigma, init_noise_sigma),
        tolerance=tolerance,
        step=step,
        timestep=scalars["timestep"],
        model_output_finite=output_finite,
        previous_l2=previous_l2,
    )
    if not found:  # a clean step's: no comprehension's call
        return []
    return [(a, ("latent_divergence", a.severity, tuple(sorted(a.details)))) for a in found]


# -- VAE output --------------------------------------------------------------------------------


def vae_saturation(
    outside_fraction: float,
    image_ranges: list[float],
    *,
    threshold: float,
    step: int | None,
    component: str = "vae",
    sd_vae: bool = False,
    upcast: dict[str, Any] | None = None,
    dtype: torch.dtype | None = None,
    ran: Callable[[], tuple[str | None, str | None]] | None = None,
) -> list[Anomaly]:
    """Decoded pixels outside [-1, 1] (``vae_saturation``), or flat images although finite (``constant_image``: a
    black image that is no NaN) that the VAE-role ``component`` (``sd_vae``: SD's) decoded in ``dtype``
    (``decoded_dtype``); ``ran``, asked on a flat image: its weights' dtype and the autocast it ran under."""
    out = []
    flat = [i for i, r in enumerate(image_ranges) if r == r and r < 1e-6]
    if flat:
        weights, under = ran() if ran is not None else (None, None)  # (unknown weights: the decoded dtype alone)
        out.append(
            make_anomaly(
                kind="constant_image",
                severity="warning",
                component=component,
                step=step,
                details={
                    "flat_images": flat,
                    "image_ranges": image_ranges,
                    **vae_details("vae", sd_vae, weights, under, upcast),
                    **({"decoded_dtype": dtype_name(dtype)} if dtype is not None else {}),
                },
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
