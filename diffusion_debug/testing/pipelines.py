"""Tiny, randomly initialised, fully offline diffusers pipelines for tests and examples.

:func:`tiny_pipeline` builds a *real* diffusers pipeline (``StableDiffusionPipeline``,
``StableDiffusionXLPipeline`` or ``StableDiffusion3Pipeline``, and the kinds of the zoo) whose
components are the real diffusers / transformers classes, constructed from very small configs with
random weights. Nothing is downloaded: the tokenizers are built offline
(:mod:`~diffusion_debug.testing.text_encoders`).

Use it to exercise code that hooks, wraps, saves, loads or runs a pipeline -- the code path is the
same as for a real checkpoint -- in a second or two on a CPU.

Where each kind's components are made, one module per family:
:mod:`~diffusion_debug.testing.stable_diffusion` (sd, sdxl, sd3),
:mod:`~diffusion_debug.testing.zoo` (img2img, inpaint, ControlNet, AnimateDiff, Kandinsky 2.2,
PixArt-α, DiT), :mod:`~diffusion_debug.testing.zoo_more` (InstructPix2Pix, the x4 upscaler,
T2I-Adapter, Depth2Img, LCM, DeepFloyd IF, PixArt-Σ, Sana, Lumina 2, AuraFlow,
CogVideoX), :mod:`~diffusion_debug.testing.zoo_newer` (Flux Kontext, Fill and Control,
Chroma, HunyuanVideo, Mochi, Wan image-to-video, the SDXL refiner), :mod:`~diffusion_debug.testing.zoo_latest`
(Stable Cascade prior and decoder, SkyReels-V2 diffusion forcing, Kandinsky 5, CogView4, Sana-Sprint,
Z-Image, Allegro), :mod:`~diffusion_debug.testing.zoo_extra` (Kandinsky 3, HunyuanVideo 1.5, Latte, a
consistency model, VisualCloze),
:mod:`~diffusion_debug.testing.zoo_recent` (SDXL PAG and ControlNet-Union, FLUX.2 [klein], Bria, Marigold,
Z-Image img2img, HiDream-I1, Lumina-Next, HunyuanImage 2.1),
:mod:`~diffusion_debug.testing.zoo_recent_video` (LTX-Video, Wan VACE, ChronoEdit, SANA-Video, Stable Audio),
:mod:`~diffusion_debug.testing.flux`,
:mod:`~diffusion_debug.testing.zoo_video_audio` (Stable Video Diffusion, Dance Diffusion, Wan 2.2,
LTX-2), :mod:`~diffusion_debug.testing.qwenimage` (QwenImage) and
:mod:`~diffusion_debug.testing.text_diffusion` (LLaDA2, which denoises token ids).

Limits:

* The weights are random, so the images are noise and the text conditioning means nothing. Only
  properties that do not depend on trained weights (shapes, dtypes, finiteness, determinism, call
  order, timing structure) are meaningful.
* The configs are tiny, so numerical behaviour such as fp16 overflow in a real model does not carry
  over (see :mod:`~diffusion_debug.testing.stable_diffusion` for the sizes and the SD3 without T5).
* The tokenizers know only a few whole words; every other word is split into pieces. The CLIP
  ``model_max_length`` is 77 as in the real one, so long prompts are truncated as they are with a
  real checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging as _std_logging
from typing import Iterator

import torch

from . import (
    flux,
    qwenimage,
    stable_diffusion,
    text_diffusion,
    zoo,
    zoo_extra,
    zoo_latest,
    zoo_more,
    zoo_newer,
    zoo_recent,
    zoo_recent_video,
    zoo_video_audio,
)

__all__ = ["TINY_KINDS", "tiny_pipeline"]

#: The pipeline kinds :func:`tiny_pipeline` can build.
TINY_KINDS = ("sd", "sdxl", "sd3")

# kind -> (diffusers pipeline class name, builder of its components), every family's kinds
_BUILDERS = {
    **stable_diffusion.BUILDERS,
    **zoo.BUILDERS,
    **zoo_more.BUILDERS,
    **zoo_newer.BUILDERS,
    **zoo_latest.BUILDERS,
    **zoo_extra.BUILDERS,
    **zoo_recent.BUILDERS,
    **zoo_recent_video.BUILDERS,
    **flux.BUILDERS,
    **zoo_video_audio.BUILDERS,
    **qwenimage.BUILDERS,
    **text_diffusion.BUILDERS,
}


#: The key under which a builder's components may carry ``{attribute: value}`` set on the built pipeline.
PIPELINE_ATTRIBUTES = "__pipeline_attributes__"


def _component_seed(seed: int, kind: str, name: str) -> int:
    """A seed for one component, derived from (seed, kind, name) so that components of one pipeline
    (e.g. the two CLIP encoders) do not share weights and different seeds give different weights."""
    digest = hashlib.sha256(f"{int(seed)}:{kind}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def _quiet_construction() -> Iterator[None]:
    """Lower diffusers / transformers logging to errors while components are constructed."""
    import diffusers
    import transformers

    old = (diffusers.logging.get_verbosity(), transformers.logging.get_verbosity())
    diffusers.logging.set_verbosity(_std_logging.ERROR)
    transformers.logging.set_verbosity(_std_logging.ERROR)
    try:
        yield
    finally:
        diffusers.logging.set_verbosity(old[0])
        transformers.logging.set_verbosity(old[1])


def tiny_pipeline(
    kind: str = "sd",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """Build a tiny randomly initialised diffusers pipeline, fully offline.

    Args:
        kind: ``"sd"`` (``StableDiffusionPipeline``), ``"sdxl"`` (``StableDiffusionXLPipeline``)
            or ``"sd3"`` (``StableDiffusion3Pipeline``, without T5); see :data:`TINY_KINDS`. Also
            one of :data:`~diffusion_debug.testing.zoo.ZOO_KINDS` (img2img, inpaint, controlnet,
            animatediff, kandinsky_prior, kandinsky_decoder, pixart, dit; their call arguments
            in :data:`~diffusion_debug.testing.zoo.ZOO_CALLS`), one of
            :data:`~diffusion_debug.testing.zoo_more.CALLS` (instruct_pix2pix, sd_upscale,
            t2i_adapter, depth2img, lcm, deepfloyd_if, pixart_sigma, sana, lumina2, auraflow,
            cogvideox), one of :data:`~diffusion_debug.testing.zoo_newer.ZOO_CALLS` (flux_kontext,
            flux_fill, flux_control, chroma, hunyuan_video, mochi, wan_i2v, sdxl_refiner), one of
            :data:`~diffusion_debug.testing.zoo_latest.ZOO_CALLS` (stable_cascade_prior, stable_cascade,
            skyreels_v2_df, kandinsky5, cogview4, sana_sprint, z_image, allegro), one of
            :data:`~diffusion_debug.testing.zoo_extra.ZOO_CALLS` (kandinsky3, hunyuan_video15, latte,
            consistency, visualcloze), flux
            (:data:`~diffusion_debug.testing.flux.FLUX_CALL`), or svd, dance_diffusion
            (:data:`~diffusion_debug.testing.zoo_video_audio.CALLS`), or wan22 (two experts,
            :func:`~diffusion_debug.testing.zoo_video_audio.WAN22_CALL`), ltx2 (video and audio,
            :func:`~diffusion_debug.testing.zoo_video_audio.LTX2_CALL`), qwenimage
            (:data:`~diffusion_debug.testing.qwenimage.QWENIMAGE_CALL`), or llada2 (text diffusion,
            :func:`~diffusion_debug.testing.text_diffusion.LLADA2_CALL`).
        seed: weights are a function of ``seed`` (and ``kind``) alone: the same seed gives bitwise
            identical weights, a different seed different ones. The global torch RNG state is left
            as it was.
        dtype: dtype of every model component (e.g. ``torch.float16``; it runs on CPU).
        device: device the components are moved to.

    Returns:
        The pipeline, with a progress bar disabled. Its default image size is 32x32 pixels
        (``sample_size`` 8 latent pixels times ``vae_scale_factor`` 4); ``height``/``width`` must be
        multiples of 8 (sd, sdxl: the UNet halves the latents once; sd3: patch size 2).

    Raises:
        ValueError: ``kind`` is not one of :data:`TINY_KINDS`, ``ZOO_KINDS``, flux or the video/audio kinds.
    """
    if kind not in _BUILDERS:
        raise ValueError(f"Unknown tiny pipeline kind {kind!r}; valid kinds are: {', '.join(map(repr, _BUILDERS))}.")
    class_name, build = _BUILDERS[kind]

    def make(name: str, factory):
        torch.manual_seed(_component_seed(seed, kind, name))
        module = factory()
        return module.to(device=device, dtype=dtype).eval()

    with torch.random.fork_rng(devices=[]), _quiet_construction():
        # Looked up here, quietly: importing the pipelines makes transformers warn about optional
        # image-processor backends (torchvision) that these pipelines never use.
        import diffusers

        components = build(make)
        # attributes a pipeline's __init__ sets that a tiny one needs changed (HiDream's image area)
        attributes = components.pop(PIPELINE_ATTRIBUTES, {})
        pipe = getattr(diffusers, class_name)(**components)
        for name, value in attributes.items():
            setattr(pipe, name, value)
    pipe.set_progress_bar_config(disable=True)
    return pipe
