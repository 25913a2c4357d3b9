"""What the advice of a VAE anomaly needs to know, read once: whether the pipeline reads
``vae.config.force_upcast`` (:func:`upcast_details`, per pipe) and what the VAE computed in (:func:`vae_details`,
:func:`autocast_details`: the details every kind's VAE advice shares; ``record/advice.py`` writes the text).

The flag upcasts a float16 VAE (and the latents) for the decode only in the pipelines whose call reads it (SDXL's
family, Kolors, AuraFlow, SD upscale; a Modular SDXL pipeline's decode step); Stable Diffusion 1.5's
``StableDiffusionPipeline`` and its kin (img2img, inpaint, ControlNet, AnimateDiff) never do.

>>> from diffusion_debug.testing import tiny_pipeline
>>> reads_force_upcast(tiny_pipeline("sd")), reads_force_upcast(tiny_pipeline("sdxl"))
(False, True)

Decided once per class (kept weakly), from the source of the ``__call__`` it runs: a subclass that keeps its parent's
is its parent's. Not known (None), and advised both ways: a ``ComponentsManager`` (whichever pipeline calls its
components), an override of ``__call__`` over a base whose ``__call__`` reads it (it may defer to
``super().__call__``), a class whose source cannot be read, any error reading it. A read outside ``__call__`` is no
read for the decode, rightly where it is AnimateDiff video2video's (``prepare_latents`` upcasts the VAE for the encode
of the input video and casts it back: the decode runs in float16 whatever the flag). Limit: a Modular pipeline whose
blocks are not under ``sub_blocks`` (an older diffusers') counts as not reading it.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

from torch import nn

from .autocast import autocast_on
from .inventory import watchable_kind
from .roles import has_check

#: The scaling factor of SDXL's VAE, the one VAE the fp16-fixed SDXL VAE (madebyollin/sdxl-vae-fp16-fix) replaces:
#: SD 1.5's (0.18215) and SD x4 upscale's (0.08333) are other latent spaces.
SDXL_SCALING = 0.13025


def sdxl_scaling(scaling_factor: Any) -> bool:
    """Whether ``scaling_factor`` (a VAE config's) is SDXL's VAE's :data:`SDXL_SCALING`."""
    return isinstance(scaling_factor, (int, float)) and abs(scaling_factor - SDXL_SCALING) < 1e-6


def upcast_details(pipe: Any) -> dict[str, Any]:
    """``reads_force_upcast`` (True, False or None: not known), ``sdxl_vae`` where its ``vae`` is SDXL's (the
    fp16-fixed VAE is advice for it alone) and, where the flag is not read and the pipeline decodes its (video)
    latents with its own ``decode_latents`` (AnimateDiff, PIA, I2VGen-XL...), ``decode_latents``."""
    reads = reads_force_upcast(pipe)
    try:
        video = reads is False and hasattr(pipe, "video_processor") and callable(getattr(pipe, "decode_latents", 0))
        sdxl = sdxl_scaling(getattr(getattr(getattr(pipe, "vae", None), "config", None), "scaling_factor", None))
    except Exception:  # (a property that raises)
        video = sdxl = False
    return {
        "reads_force_upcast": reads,
        **({"sdxl_vae": True} if sdxl else {}),
        **({"decode_latents": True} if video else {}),
    }


def reads_force_upcast(pipe: Any) -> bool | None:
    """Whether ``pipe``'s call reads ``vae.config.force_upcast`` (None: not known); a ``ModularPipeline``'s where
    any of its blocks' does (SDXL's decode step)."""
    try:
        if watchable_kind(pipe) == "manager":
            return None
        blocks = getattr(pipe, "blocks", None)  # (a DiffusionPipeline has none: its config says so)
        if blocks is None or isinstance(blocks, nn.Module):
            return _call_reads_force_upcast(type(pipe))
        found = {_call_reads_force_upcast(cls) for cls in _block_classes(blocks)}
        return True if True in found else None if None in found else False
    except Exception:  # (a debugger error never escapes into the user's construction)
        return None


def _block_classes(block: Any) -> set[type]:
    """The classes of a Modular Diffusers ``block`` and of every block under it (``sub_blocks``)."""
    subs = getattr(block, "sub_blocks", None) or {}
    subs = subs.values() if isinstance(subs, dict) else subs
    return {type(block)}.union(*(_block_classes(sub) for sub in subs))


_READS: weakref.WeakKeyDictionary[type, bool | None] = weakref.WeakKeyDictionary()


def _call_reads_force_upcast(cls: type) -> bool | None:
    if cls not in _READS:
        _READS[cls] = _source_reads(cls)
    return _READS[cls]


def _source_reads(cls: type) -> bool | None:
    owner = next((base for base in cls.__mro__ if "__call__" in vars(base)), None)
    try:
        if "config.force_upcast" in inspect.getsource(owner.__call__):
            return True
    except Exception:  # no source: none (a ComponentsManager's), a class made in a REPL, a .pyc alone
        return None
    above = next((base for base in owner.__mro__[1:] if "__call__" in vars(base)), None)
    return False if above is None or _call_reads_force_upcast(above) is False else None


def vae_details(
    role: str, sd_vae: bool, dtype: str | None, autocast: str | None, upcast: dict[str, Any] | None
) -> dict[str, Any]:
    """What the advice of a VAE-role component's anomaly needs: whether it is one, whether it is Stable Diffusion's
    (with ``upcast``: :func:`upcast_details`, said for one), the dtype its weights are in (``vae_dtype``, when
    known) and the ``autocast`` dtype it ran under (``vae_autocast``)."""
    if not has_check(role, "vae"):
        return {"vae_role": False}
    ran = {"vae_autocast": autocast} if autocast else {}
    ran |= (upcast or {}) if sd_vae else {}
    return {"vae_role": True, "sd_vae": sd_vae, **({"vae_dtype": dtype} if dtype else {}), **ran}


def autocast_details(weights_dtype: str | None, dtype: str | None) -> dict[str, str]:
    """``weights_dtype`` where the module's weights are not of the ``dtype`` its output came in while an autocast
    region is open (:func:`~..checks.overflow_risk`); the message then advises about autocast, not the weights'."""
    return {"weights_dtype": weights_dtype} if weights_dtype not in (None, dtype) and autocast_on(dtype) else {}
