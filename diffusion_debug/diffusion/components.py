"""What a pipeline is made of: its denoiser, VAE and text encoders, and a static description.

>>> from diffusion_debug.testing import tiny_pipeline
>>> [c.name for c in find_components(tiny_pipeline("sd"))]
['unet', 'vae', 'text_encoder']

Limits: only the attributes named in :data:`DENOISER_NAMES`, ``vae`` and
:data:`TEXT_ENCODER_NAMES` are components; other modules a pipeline holds (ControlNets, image
encoders, safety checkers) are not watched.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import DiffusionDebugError
from ..stats import dtype_name

DENOISER_NAMES = ("unet", "transformer")
TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3")
TOKENIZER_FOR_ENCODER = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"}
# Scheduler settings worth showing (and checking) when present.
SCHEDULER_KEYS = (
    "num_train_timesteps",
    "prediction_type",
    "timestep_spacing",
    "steps_offset",
    "beta_schedule",
    "rescale_betas_zero_snr",
    "use_karras_sigmas",
    "shift",
    "use_dynamic_shifting",
    "clip_sample",
    "set_alpha_to_one",
    "final_sigmas_type",
)


@dataclass(frozen=True)
class Component:
    """One watched model of a pipeline."""

    name: str
    """Pipeline attribute name: ``unet``, ``transformer``, ``vae``, ``text_encoder``..."""
    role: str
    """``denoiser``, ``vae`` or ``text_encoder``."""
    module: nn.Module


@dataclass(frozen=True)
class CallSite:
    """A module whose forward is one call of a component: the component itself, or the VAE's
    ``encoder`` / ``decoder`` (pipelines call ``vae.decode``, a method, not ``vae.forward``)."""

    component: str
    prefix: str
    """Qualified name of ``module`` inside the component (``""`` for the component itself)."""
    module: nn.Module
    role: str = ""
    """The component's role (see :class:`Component`)."""


def validate_pipeline(pipe: Any) -> None:
    """Raise one clear DiffusionDebugError unless ``pipe`` is a diffusers pipeline with a denoiser."""
    from diffusers import DiffusionPipeline

    if not isinstance(pipe, DiffusionPipeline):
        if isinstance(pipe, nn.Module):
            raise DiffusionDebugError(
                f"DiffusionModelDebugger needs a diffusers DiffusionPipeline, not the nn.Module "
                f"{type(pipe).__name__}; wrap the pipeline that holds it "
                "(or use diffusion_debug.probes.Probe on the module)."
            )
        raise DiffusionDebugError(
            "DiffusionModelDebugger needs a diffusers DiffusionPipeline, "
            f"not {type(pipe).__name__} {_short_repr(pipe)}."
        )
    if find_denoiser(pipe) is None:
        raise DiffusionDebugError(
            f"{type(pipe).__name__} has no denoiser: DiffusionModelDebugger looks for an nn.Module "
            f"in {' or '.join(map(repr, DENOISER_NAMES))} and found none."
        )


def _short_repr(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) <= 40 else text[:37] + "..."


def find_denoiser(pipe: Any) -> Component | None:
    for name in DENOISER_NAMES:
        module = getattr(pipe, name, None)
        if isinstance(module, nn.Module):
            return Component(name, "denoiser", module)
    return None


def find_components(pipe: Any) -> list[Component]:
    """Denoiser, VAE and text encoders present on ``pipe`` (``None`` ones skipped), in that order."""
    found = []
    denoiser = find_denoiser(pipe)
    if denoiser is not None:
        found.append(denoiser)
    vae = getattr(pipe, "vae", None)
    if isinstance(vae, nn.Module):
        found.append(Component("vae", "vae", vae))
    for name in TEXT_ENCODER_NAMES:
        module = getattr(pipe, name, None)
        if isinstance(module, nn.Module):
            found.append(Component(name, "text_encoder", module))
    return found


def call_sites(component: Component) -> list[CallSite]:
    """Where one call of ``component`` begins and ends (see :class:`CallSite`)."""
    if component.role == "vae":
        sites = [
            CallSite(component.name, name, child, component.role)
            for name in ("encoder", "decoder")
            if isinstance(child := getattr(component.module, name, None), nn.Module)
        ]
        if sites:
            return sites
    return [CallSite(component.name, "", component.module, component.role)]


def describe_module(module: nn.Module) -> dict[str, Any]:
    """Class, parameter counts, dtypes, devices and bytes of one model."""
    total = trainable = nbytes = 0
    dtypes: Counter[str] = Counter()
    devices: Counter[str] = Counter()
    for tensor, is_param in [(p, True) for p in module.parameters()] + [(b, False) for b in module.buffers()]:
        n = tensor.numel()
        nbytes += n * tensor.element_size()
        if is_param:
            total += n
            trainable += n if tensor.requires_grad else 0
            dtypes[dtype_name(tensor.dtype)] += n
            devices[str(tensor.device)] += n
    config = getattr(module, "config", None)
    return {
        "class": type(module).__name__,
        "parameters": total,
        "trainable_parameters": trainable,
        "dtype": dtypes.most_common(1)[0][0] if dtypes else None,
        "dtypes": dict(dtypes),
        "device": devices.most_common(1)[0][0] if devices else None,
        "devices": dict(devices),
        "bytes": nbytes,
        "training": module.training,
        "offload_hooks": hasattr(module, "_hf_hook"),
        "config_class": type(config).__name__ if config is not None else None,
    }


def module_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype most of ``module``'s floating parameters have."""
    counts: Counter[torch.dtype] = Counter()
    for p in module.parameters():
        if p.is_floating_point():
            counts[p.dtype] += p.numel()
    return counts.most_common(1)[0][0] if counts else None


def component_dtypes(components: list[Component]) -> dict[str, str | None]:
    """The dtype name most of each component's parameters have."""
    return {c.name: (dtype_name(d) if (d := module_dtype(c.module)) else None) for c in components}


def scheduler_config(scheduler: Any) -> dict[str, Any]:
    config = getattr(scheduler, "config", {}) or {}
    return {key: config[key] for key in SCHEDULER_KEYS if key in config}


def analyze_pipeline(pipe: Any) -> dict[str, Any]:
    """``{"total_parameters": int, "pipeline": class name, <component>: {...}, "scheduler": {...}}``."""
    out: dict[str, Any] = {"pipeline": type(pipe).__name__}
    total = 0
    for component in find_components(pipe):
        entry = describe_module(component.module)
        entry["role"] = component.role
        total += entry["parameters"]
        out[component.name] = entry
    out["total_parameters"] = total
    scheduler = getattr(pipe, "scheduler", None)
    if scheduler is not None:
        out["scheduler"] = {
            "class": type(scheduler).__name__,
            "order": getattr(scheduler, "order", 1),
            "has_sigmas": hasattr(scheduler, "sigmas"),
            "config": scheduler_config(scheduler),
        }
    return out


def component_report(
    components: list[Component], analysis: dict[str, Any], runtime: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Per component: its static description (:func:`analyze_pipeline`) with its measured calls,
    total and mean time and peak memory; and the scheduler's entry."""
    out: dict[str, Any] = {}
    for component in components:
        entry = dict(analysis.get(component.name, {}))
        measured = dict(runtime.get(component.name, {"calls": 0, "total_time_s": 0.0, "peak_memory_mb": None}))
        measured["mean_time_s"] = measured["total_time_s"] / measured["calls"] if measured["calls"] else None
        entry.update(measured)
        out[component.name] = entry
    if "scheduler" in analysis:
        out["scheduler"] = analysis["scheduler"]
    return out
