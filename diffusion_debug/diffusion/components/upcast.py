"""Whether a pipeline reads ``vae.config.force_upcast``: the flag upcasts a float16 VAE (and the latents) for the
decode only in the pipelines whose call reads it (SDXL's family, Kolors, AuraFlow, SD upscale; a Modular SDXL
pipeline's decode step); Stable Diffusion 1.5's ``StableDiffusionPipeline`` and its kin (img2img, inpaint,
ControlNet) never do, so naming the flag there is advice that changes nothing (``record/advice.py`` says the float32
decode that works instead).

>>> from diffusion_debug.testing import tiny_pipeline
>>> reads_force_upcast(tiny_pipeline("sd")), reads_force_upcast(tiny_pipeline("sdxl"))
(False, True)

Decided once per class (cached), from the source of the ``__call__`` it runs: a subclass that keeps its parent's is
its parent's. Limits: a read outside ``__call__`` (AnimateDiff video2video's, in ``prepare_latents``: the encode
alone), an override that defers to ``super().__call__``, a class whose source cannot be read (made in a REPL, a
``.pyc`` alone) and a Modular pipeline whose blocks are not under ``sub_blocks`` (an older diffusers') count as not
reading it: the advice then says the fix that works without the flag.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import nn


def reads_force_upcast(pipe: Any) -> bool:
    """Whether ``pipe``'s call reads ``vae.config.force_upcast``; a ``ModularPipeline``'s where any of its blocks'
    does (SDXL's decode step)."""
    blocks = getattr(pipe, "blocks", None)  # (a DiffusionPipeline has none: its config says so)
    if blocks is not None and not isinstance(blocks, nn.Module):
        return any(map(_call_reads_force_upcast, _block_classes(blocks)))
    return _call_reads_force_upcast(type(pipe))


def _block_classes(block: Any) -> set[type]:
    """The classes of a Modular Diffusers ``block`` and of every block under it (``sub_blocks``)."""
    subs = getattr(block, "sub_blocks", None) or {}
    return {type(block)}.union(*(_block_classes(sub) for sub in subs.values()))


@functools.lru_cache(maxsize=128)
def _call_reads_force_upcast(cls: type) -> bool:
    try:
        return "config.force_upcast" in inspect.getsource(cls.__call__)
    except (OSError, TypeError, AttributeError):  # no source: a built-in, a class made in a REPL, a .pyc alone
        return False
