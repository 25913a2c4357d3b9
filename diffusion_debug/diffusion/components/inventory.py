"""What a pipeline is made of: every ``nn.Module`` component with its role, and a static description.

>>> from diffusion_debug.testing import tiny_pipeline
>>> [(c.name, c.role) for c in find_components(tiny_pipeline("sd"))]
[('unet', 'denoiser'), ('vae', 'vae'), ('text_encoder', 'text_encoder')]

The role of a component is found from the component itself (its class and base classes, the
library it comes from), not from a fixed list of attribute names, so ``movq`` (Kandinsky's VAE),
``prior``, ``controlnet``, ``image_encoder`` and adapters are watched like ``unet`` and ``vae``.

Limits: roles come from class names and bases (``*ControlNet*`` is control, ``*Adapter*`` an
adapter, a diffusers ``UNet*`` / ``*Transformer*`` / ``PriorTransformer`` a denoiser, an
autoencoder or ``VQModel`` the VAE, a transformers ``*Vision*`` / ``*Image*`` model an image
encoder, a transformers model registered as ``model`` the denoiser (text diffusion: LLaDA2), any
other transformers model a text encoder); a custom class named otherwise is
``other`` (watched, checked per call, no per-step row). When a pipeline holds two denoisers
(Wan 2.2's experts ``transformer`` and ``transformer_2``) both are watched alike: each step is
checked on (and its row names, as ``denoiser``) the expert that ran it; the first in
:data:`DENOISER_PREFERENCE` order stands for the denoiser elsewhere (guidance, messages). A
component the pipeline calls through its methods alone, never its ``forward``, is watched at the
children they call where its class is in :data:`METHOD_PARTS` (UniDiffuser's text decoder); any
other such component goes unwatched (a NaN it makes is the pipeline's code's).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch
from torch import nn

from ...errors import DiffusionDebugError
from ...stats import dtype_name
from ...stats.quantized import PLAIN_TYPES, compute_dtype, is_quantized, parameter_owners, stored_bytes, weight_numel
from .roles import has_check, role, roles
from .roles import role as _role

DENOISER_PREFERENCE = ("unet", "transformer", "prior", "decoder", "transformer_2", "unet_2", "model")
"""Attribute names tried first for the denoiser that drives the per-step row (any other
denoiser-like component follows). ``model`` is the language model of diffusers' text diffusion
pipelines (LLaDA2, DiffusionGemma): a transformers model, the denoiser by its name."""
TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3")
TOKENIZER_FOR_ENCODER = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2", "text_encoder_3": "tokenizer_3"}
ROLES = roles()
"""Built-in component roles, in the order :func:`find_components` lists them (see :mod:`.roles`)."""
CALL_PHASES = {r: role(r).call_phase for r in ROLES if role(r).call_phase}
"""The phase a call of a component of that role is (VAE calls are ``encode`` / ``decode``)."""
LOOP_ROLES = tuple(r for r in ROLES if role(r).in_loop)
"""Roles whose components run inside the denoising loop (every step): they keep the cheap
probes; the others run once per image and get full probes by default."""
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
    """One of :data:`ROLES`."""
    module: nn.Module
    guided: bool = False
    """A denoiser on whose layers a guider of the pipeline places hooks for some of its calls
    (:func:`places_hooks`): each call's hooks are kept for its replay."""


@dataclass(frozen=True)
class CallSite:
    """A module whose forward is one call of a component: the component itself, or the VAE's
    ``encoder`` / ``decoder`` (pipelines call ``vae.decode``, a method, not ``vae.forward``)."""

    component: str
    prefix: str
    """Qualified name of ``module`` inside the component (``""`` for the component itself)."""
    module: nn.Module
    role: str = ""
    """The component's role (see :data:`ROLES`)."""


def watchable_kind(pipe: Any) -> str | None:
    """``"pipeline"`` (a ``DiffusionPipeline``), ``"modular"`` (a Modular Diffusers ``ModularPipeline``),
    ``"manager"`` (a ``ComponentsManager``: its components, whichever pipeline calls them), else None."""
    from diffusers import DiffusionPipeline

    if isinstance(pipe, DiffusionPipeline):
        return "pipeline"
    try:
        from diffusers.modular_pipelines import ComponentsManager, ModularPipeline
    except ImportError:  # a diffusers without Modular Diffusers
        return None
    if isinstance(pipe, ModularPipeline):
        return "modular"
    return "manager" if isinstance(pipe, ComponentsManager) else None


def validate_pipeline(pipe: Any) -> None:
    """Raise one clear DiffusionDebugError unless ``pipe`` is a diffusers pipeline (or a Modular
    Diffusers ``ModularPipeline`` or ``ComponentsManager``) with at least one ``nn.Module``
    component. The sentence names the type, never the object's repr (a pipeline's is pages long)."""
    if watchable_kind(pipe) is None:
        if isinstance(pipe, nn.Module):
            raise DiffusionDebugError(
                f"DiffusionModelDebugger needs a diffusers DiffusionPipeline, not the nn.Module "
                f"{type(pipe).__name__}; wrap the pipeline that holds it "
                "(or use diffusion_debug.probes.Probe on the module)."
            )
        raise DiffusionDebugError(
            "DiffusionModelDebugger needs a diffusers DiffusionPipeline, a ModularPipeline or a ComponentsManager, "
            f"not {type(pipe).__module__.split('.')[0]}'s {type(pipe).__name__}."
        )
    if not find_components(pipe):
        raise DiffusionDebugError(
            f"{type(pipe).__name__} has no denoiser and no other nn.Module component "
            "(pipe.components holds none): there is nothing to watch."
        )


def _class_names(module: nn.Module) -> list[str]:
    """The class and its bases, mixins left out (``PeftAdapterMixin`` is no adapter)."""
    return [cls.__name__ for cls in type(module).__mro__ if not cls.__name__.endswith("Mixin")]


def role_of(name: str, module: nn.Module | None) -> str:
    """The role of one component (see :mod:`.roles`), from its class, bases and library; a
    registered role's own ``matches`` is asked first (``None``: a module not known, ``other``)."""
    if module is None:
        return "other"
    for added in roles():
        matches = role(added).matches
        if matches is not None and matches(name, module):
            return added
    names = _class_names(module)
    own = names[0]
    library = type(module).__module__.split(".")[0]
    if any("ControlNet" in n for n in names):
        return "control"
    if any("Adapter" in n for n in names):
        return "adapter"
    if any(n.startswith(("Autoencoder", "VQModel", "AsymmetricAutoencoder")) for n in names):
        return "vae"
    if library == "transformers":
        if name in DENOISER_PREFERENCE:  # text diffusion's ``model``: a language model that denoises tokens
            return "denoiser"
        if any(k in own for k in ("Vision", "Image", "Siglip", "Dino")) or "image" in name:
            return "image_encoder"
        if "SafetyChecker" in own or "safety" in name:
            return "other"
        return "text_encoder"
    if library == "diffusers" and any(
        n.startswith("UNet") or "Transformer" in n or n in ("PriorTransformer",) for n in names[:2]
    ):
        return "denoiser"
    if name in DENOISER_PREFERENCE:
        return "denoiser"
    if name.startswith("text_encoder"):
        return "text_encoder"
    if name.startswith("image_encoder"):
        return "image_encoder"
    if name in ("vae", "movq") or (hasattr(module, "decode") and hasattr(module, "encode")):
        return "vae"
    return "other"


def stable_diffusion_vae(module: nn.Module | None) -> bool:
    """Whether ``module`` is Stable Diffusion's (or SDXL's) ``AutoencoderKL``, 4 latent channels:
    the VAE that ``force_upcast`` and the fp16-fixed SDXL VAE are for. Flux's and SD3's
    16-channel ``AutoencoderKL`` and the video VAEs (``AutoencoderKLWan``, ``AutoencoderKLQwenImage``,
    ``AutoencoderKLLTXVideo``...) have neither. A ``torch.compile`` wrapper is its original's."""
    module = module._modules.get("_orig_mod", module) if isinstance(module, nn.Module) else module
    config = getattr(module, "config", None)
    return type(module).__name__ == "AutoencoderKL" and getattr(config, "latent_channels", None) == 4


def _modules(pipe: Any) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` for every nn.Module component, in ``pipe.components`` order (falls back
    to the old fixed names when the pipeline has no ``components``)."""
    try:
        items = list(getattr(pipe, "components", {}).items())
    except Exception:  # a pipeline whose components property fails: the usual names
        items = []
    if watchable_kind(pipe) == "manager":  # ids "unet_1403..." -> "unet" (the id where two share a name)
        names = Counter(type(pipe)._id_to_name(cid) for cid, _ in items)
        items = [(n if names[n := type(pipe)._id_to_name(cid)] == 1 else cid, m) for cid, m in items]
    if not items:
        names = DENOISER_PREFERENCE + ("vae",) + TEXT_ENCODER_NAMES
        items = [(n, getattr(pipe, n, None)) for n in names]
    seen: set[int] = set()
    out = []
    for name, module in items:
        if isinstance(module, nn.Module) and id(module) not in seen:
            seen.add(id(module))
            out.append((name, module))
    return out


def _guiders(pipe: Any) -> list[Any]:
    """The components of ``pipe`` that are not modules (a Modular pipeline's or a pipeline's ``guider``)."""
    try:
        items = getattr(pipe, "components", {}).values()
        return [item for item in items if item is not None and not isinstance(item, nn.Module)]
    except Exception:  # a pipeline whose components property fails (as in _modules)
        return []


def places_hooks(guider: Any) -> bool:
    """Whether ``guider`` is a diffusers guider that places hooks on the denoiser's layers for some
    of its batches (its own ``prepare_models``: PAG, SkipLayerGuidance, SmoothedEnergyGuidance,
    AutoGuidance), not one that only combines the predictions (CFG, APG)."""
    try:
        from diffusers.guiders.guider_utils import BaseGuidance
    except ImportError:  # diffusers before guiders
        return False
    return isinstance(guider, BaseGuidance) and type(guider).prepare_models is not BaseGuidance.prepare_models


def find_components(pipe: Any) -> list[Component]:
    """Every ``nn.Module`` component of ``pipe`` with its role: the denoiser first (see
    :data:`DENOISER_PREFERENCE`), then by role in :data:`ROLES` order, then as the pipeline lists
    them."""
    guided = any(map(places_hooks, _guiders(pipe)))
    found = []
    for name, module in _modules(pipe):
        role = role_of(name, module)
        found.append(Component(name, role, module, guided and role == "denoiser"))

    def order(c: Component) -> tuple[int, int]:
        first = DENOISER_PREFERENCE.index(c.name) if c.name in DENOISER_PREFERENCE else len(DENOISER_PREFERENCE)
        order = roles()
        return order.index(c.role) if c.role in order else len(order), first if c.role == "denoiser" else 0

    return sorted(found, key=order)  # stable: pipeline order within a role


def shared_collections(pipe: Any, components: list[Component]) -> dict[str, list[str]]:
    """Per component that a Modular Diffusers ``ComponentsManager`` (``pipe`` itself or the
    modular pipeline's) holds in several collections: those collections (the pipelines sharing it)."""
    manager = pipe if watchable_kind(pipe) == "manager" else getattr(pipe, "_components_manager", None)
    if manager is None:
        return {}
    ids = {id(module): cid for cid, module in getattr(manager, "components", {}).items()}
    found = {}
    for c in components:
        cid = ids.get(id(c.module))
        held_by = sorted(name for name, held in getattr(manager, "collections", {}).items() if cid in held)
        if len(held_by) > 1:
            found[c.name] = held_by
    return found


def manager_schedulers(manager: Any) -> list[Any]:
    """The schedulers a Modular Diffusers ``ComponentsManager`` holds (``add``, ``load_components``), in its order:
    each object with a ``step`` and a ``set_timesteps`` that is no module (one that raises on reading: none)."""
    try:
        held = list(getattr(manager, "components", {}).values())
    except Exception:
        return []
    found: dict[int, Any] = {}  # (one added twice, under two names: once)
    for value in held:
        stepped = not isinstance(value, nn.Module) and callable(getattr(value, "step", None))
        if stepped and callable(getattr(value, "set_timesteps", None)):
            found.setdefault(id(value), value)
    return list(found.values())


def no_denoiser_note(pipeline: str, scheduler: str | None = None) -> str:
    """The one line said for a pipeline without a denoiser; ``scheduler``: the class of the
    scheduler it holds, whose ``step`` still records a row per step (None: it holds none).

    >>> print(no_denoiser_note("MyPipeline", "DDIMScheduler"))
    MyPipeline has no component known as its denoiser (no UNet, transformer, prior or text diffusion model): \
DDIMScheduler.step records a row per step from what it is given, and each component is checked call by call, \
apart from the steps.
    """
    known = "no UNet, transformer, prior or text diffusion model"
    if scheduler is not None:
        return (
            f"{pipeline} has no component known as its denoiser ({known}): {scheduler}.step records a row per step "
            "from what it is given, and each component is checked call by call, apart from the steps."
        )
    return (
        f"{pipeline} has no denoiser ({known}) and no scheduler: its components are watched call by call, "
        "and there is no per-step row (latents, model output, guidance gap)."
    )


VAE_HALVES = {"encoder": "encode", "decoder": "decode"}
"""A VAE's halves, by child name: the module its ``encode`` / ``decode`` calls, and that phase."""
UNSPLIT_VAE_PHASES = {"in_block": "encode", "down_blocks": "encode", "up_blocks": "decode", "out_block": "decode"}
"""The phase of each child of a VAE whose ``encode`` / ``decode`` run several children of its own, no
half module (Stable Cascade's and Würstchen's ``PaellaVQModel``: encode runs ``in_block`` then
``down_blocks``, decode ``up_blocks`` then ``out_block``): each such child is a call site."""


METHOD_PARTS = {"UniDiffuserTextDecoder": ("encode_prefix", "decode_prefix", "transformer")}
"""By class, the children a component's methods call in place of its ``forward``, which a pipeline never
calls: each is a call site (UniDiffuser's text decoder: ``encode`` runs ``encode_prefix``,
``generate_captions`` runs ``decode_prefix``, then its GPT-2 ``transformer`` once a token)."""


def call_phase(role: str, prefix: str) -> str:
    """What one call of a component is: ``encode`` / ``decode`` (the VAE's halves),
    ``encode_prompt``, ``encode_image``, else the role."""
    found = VAE_HALVES.get(prefix) or UNSPLIT_VAE_PHASES.get(prefix)
    return found or (role in roles() and _role(role).call_phase) or role


def is_loop_role(role: str) -> bool:
    """Whether a component of this role runs every denoising step."""
    return _role(role).in_loop


def preview_decoder(components: list[Component]) -> Component | None:
    """The component whose ``decode`` makes the latents preview (the VAE role's, ``movq`` too)."""
    return next((c for c in components if _role(c.role).decodes_preview), None)


def call_sites(component: Component) -> list[CallSite]:
    """Where one call of ``component`` begins and ends (see :class:`CallSite`)."""
    if has_check(component.role, "vae"):
        # a pipeline calls ``vae.decode``, a method: its forward is never called, the halves' are
        for halves in (VAE_HALVES, UNSPLIT_VAE_PHASES):
            sites = [
                CallSite(component.name, name, child, component.role)
                for name in halves
                if isinstance(child := getattr(component.module, name, None), nn.Module)
            ]
            if sites:
                return sites
    parts = METHOD_PARTS.get(type(component.module).__name__, ())
    sites = [
        CallSite(component.name, name, child, component.role)
        for name in parts
        if isinstance(child := getattr(component.module, name, None), nn.Module)
    ]
    return sites or [CallSite(component.name, "", component.module, component.role)]


def describe_module(module: nn.Module) -> dict[str, Any]:
    """Class, parameter counts, dtypes, devices and bytes of one model. A quantized weight (torchao,
    GGUF, bitsandbytes, quanto) counts as the weights it holds, in the dtype its layer computes in
    (``quantized``: how many by storage class), and as the bytes it holds."""
    total = trainable = nbytes = 0
    dtypes: Counter[str] = Counter()
    devices: Counter[str] = Counter()
    quantized: Counter[str] = Counter()
    parameters = list(module.parameters())
    if all(map(PLAIN_TYPES.__contains__, map(type, parameters))):  # (no quantized weight: no call a parameter)
        for p in parameters:
            n = p.numel()
            nbytes += n * p.element_size()
            total += n
            trainable += n if p.requires_grad else 0
            dtypes[dtype_name(p.dtype)] += n
            devices[str(p.device)] += n
    else:
        owners = parameter_owners(module)
        for p in parameters:
            owner = owners.get(id(p))
            n = weight_numel(p)
            nbytes += stored_bytes(p, owner)
            total += n
            trainable += n if p.requires_grad else 0
            dtypes[dtype_name(compute_dtype(p, owner) or p.dtype)] += n
            devices[str(p.device)] += n
            if is_quantized(p):
                quantized[type(p).__name__] += n
    for b in module.buffers():
        nbytes += b.numel() * b.element_size()
    config = getattr(module, "config", None)
    return {
        "class": type(module).__name__,
        "parameters": total,
        "trainable_parameters": trainable,
        "dtype": dtypes.most_common(1)[0][0] if dtypes else None,
        "dtypes": dict(dtypes),
        "quantized": dict(quantized),
        "device": devices.most_common(1)[0][0] if devices else None,
        "devices": dict(devices),
        "bytes": nbytes,
        "training": module.training,
        "offload_hooks": hasattr(module, "_hf_hook"),
        "config_class": type(config).__name__ if config is not None else None,
    }


def module_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype most of ``module``'s floating parameters have, a quantized weight counted as its
    weights in the dtype its layer computes in (GGUF's and bitsandbytes' bytes are no floats)."""
    counts: Counter[torch.dtype] = Counter()
    parameters = list(module.parameters())
    if not any(is_quantized(p) for p in parameters):
        for p in parameters:
            if p.is_floating_point():
                counts[p.dtype] += p.numel()
        return counts.most_common(1)[0][0] if counts else None
    owners = parameter_owners(module)
    for p in parameters:
        dtype = compute_dtype(p, owners.get(id(p)))
        if dtype is not None and dtype.is_floating_point:
            counts[dtype] += weight_numel(p)
    return counts.most_common(1)[0][0] if counts else None


def component_dtypes(components: list[Component], memo: Any = None) -> dict[str, str | None]:
    """The dtype name most of each component's parameters have. ``memo`` (a
    :class:`~.structure.TreeMemo` that has seen the components): read from its largest parameters
    first (:meth:`~.structure.TreeMemo.dtype`)."""
    modules = map(_MODULE, components)
    found = map(module_dtype, modules) if memo is None else memo.dtypes(modules)
    names: dict[str, str | None] = {}
    for c, dtype in zip(components, found):  # (a loop, the name as dtype_name makes it: no call a component)
        names[c.name] = str(dtype).removeprefix("torch.") if dtype else None
    return names


_MODULE = attrgetter("module")


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
