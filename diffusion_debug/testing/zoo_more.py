"""Tiny, offline diffusers pipelines of the SD and DiT families that the zoo does not build:
InstructPix2Pix (three-way guidance), the x4 upscaler (noised low-res image, noise level as class
label), T2I-Adapter, Depth2Img (given a depth map: no depth estimator), Latent Consistency (LCM),
PixArt-Σ, AuraFlow and CogVideoX.

>>> from diffusion_debug.testing import tiny_pipeline
>>> type(tiny_pipeline("instruct_pix2pix")).__name__
'StableDiffusionInstructPix2PixPipeline'

:data:`CALLS` gives, per kind, the keyword arguments of a call (without ``generator`` and
``num_inference_steps``) and a module of the denoiser that a test can plant a fault in (one whose
output reaches the denoiser's output at every step). The SD kinds reuse
:mod:`~diffusion_debug.testing.stable_diffusion`'s components with the UNet's input channels
changed; PixArt-Σ reuses PixArt-α's (:mod:`~diffusion_debug.testing.zoo`).

Limits: random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`): the multistep
schedulers' latents run far from the noise level the schedule implies (``latent_divergence``), as
do PixArt-Σ's and CogVideoX's; the sizes in :data:`CALLS` are the ones the tiny configs fit.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .stable_diffusion import Make, build_sd, sd_unet, vae
from .text_encoders import WORDS, t5_encoder_config, t5_tokenizer
from .zoo import build_pixart

__all__ = ["BUILDERS", "CALLS"]


def _image(size: int = 32) -> torch.Tensor:
    return torch.linspace(0.0, 1.0, 3 * size * size).reshape(1, 3, size, size)


def _sd_with(make: Make, **unet: Any) -> dict[str, Any]:
    return {**build_sd(make), "unet": make("unet", lambda: sd_unet(**unet))}


def build_instruct_pix2pix(make: Make) -> dict[str, Any]:
    return _sd_with(make, in_channels=8)  # the noisy latents and the image's latents


def build_upscale(make: Make) -> dict[str, Any]:
    from diffusers import DDPMScheduler

    found = _sd_with(make, in_channels=7, num_class_embeds=1000)  # latents + low-res RGB; noise level
    del found["requires_safety_checker"]
    return {**found, "low_res_scheduler": DDPMScheduler(), "max_noise_level": 350}


def build_t2i_adapter(make: Make) -> dict[str, Any]:
    from diffusers import T2IAdapter

    adapter = make(
        "adapter",
        lambda: T2IAdapter(
            in_channels=3, channels=[32, 64], num_res_blocks=1, downscale_factor=4, adapter_type="full_adapter"
        ),
    )
    return {**build_sd(make), "adapter": adapter}


def build_depth2img(make: Make) -> dict[str, Any]:
    found = _sd_with(make, in_channels=5)  # latents + depth
    for name in ("safety_checker", "requires_safety_checker"):
        del found[name]
    return {**found, "depth_estimator": None, "feature_extractor": None}


def build_lcm(make: Make) -> dict[str, Any]:
    from diffusers import LCMScheduler

    found = _sd_with(make, time_cond_proj_dim=32)  # the guidance scale is an input (w embedding)
    return {**found, "scheduler": LCMScheduler.from_config(found["scheduler"].config)}


def build_auraflow(make: Make) -> dict[str, Any]:
    from diffusers import AuraFlowTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = t5_tokenizer(WORDS)
    transformer = make(
        "transformer",
        lambda: AuraFlowTransformer2DModel(
            sample_size=32,
            patch_size=2,
            in_channels=4,
            num_mmdit_layers=1,
            num_single_dit_layers=1,
            attention_head_dim=8,
            num_attention_heads=4,
            caption_projection_dim=32,
            joint_attention_dim=32,
            out_channels=4,
            pos_embed_max_size=256,
        ),
    )
    umt5 = UMT5Config(**t5_encoder_config(tokenizer).to_dict())
    return dict(
        tokenizer=tokenizer,
        text_encoder=make("text_encoder", lambda: UMT5EncoderModel(umt5)),
        vae=make("vae", vae),
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )


def build_cogvideox(make: Make) -> dict[str, Any]:
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXTransformer3DModel
    from transformers import T5EncoderModel

    tokenizer = t5_tokenizer(WORDS)
    transformer = make(
        "transformer",
        lambda: CogVideoXTransformer3DModel(
            num_attention_heads=4,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            time_embed_dim=2,
            text_embed_dim=32,
            num_layers=1,
            sample_width=2,
            sample_height=2,
            sample_frames=9,
            patch_size=2,
            temporal_compression_ratio=4,
            max_text_seq_length=16,
        ),
    )
    video_vae = make(
        "vae",
        lambda: AutoencoderKLCogVideoX(
            in_channels=3,
            out_channels=3,
            down_block_types=("CogVideoXDownBlock3D",) * 4,
            up_block_types=("CogVideoXUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=2,
            temporal_compression_ratio=4,
        ),
    )
    return dict(
        tokenizer=tokenizer,
        text_encoder=make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        vae=video_vae,
        transformer=transformer,
        scheduler=CogVideoXDDIMScheduler(),
    )


_UNET_CONV = "up_blocks.1.resnets.0.conv2"

#: Per kind: ``(call kwargs without generator and num_inference_steps, denoiser module to plant in)``.
CALLS: dict[str, tuple[Callable[[], dict[str, Any]], str]] = {
    "instruct_pix2pix": (lambda: {"prompt": "a cat", "image": _image()}, _UNET_CONV),
    "sd_upscale": (lambda: {"prompt": "a cat", "image": _image(8)}, _UNET_CONV),  # 8 px in, 32 px out
    "t2i_adapter": (lambda: {"prompt": "a cat", "image": _image(), "height": 32, "width": 32}, _UNET_CONV),
    "depth2img": (
        lambda: {
            "prompt": "a cat",
            "image": _image(),
            "depth_map": torch.linspace(0.0, 1.0, 32 * 32).reshape(1, 32, 32),
            "strength": 0.8,
        },
        _UNET_CONV,
    ),
    "lcm": (lambda: {"prompt": "a cat"}, _UNET_CONV),
    "pixart_sigma": (
        lambda: {
            "prompt": "a cat",
            "height": 32,
            "width": 32,
            "use_resolution_binning": False,
            "clean_caption": False,
        },
        "transformer_blocks.0.ff.net.2",
    ),
    "auraflow": (lambda: {"prompt": "a cat", "height": 32, "width": 32, "max_sequence_length": 16}, "proj_out"),
    # proj_out, not a block's feed-forward: CogVideoX drops the text tokens' part of the last block
    "cogvideox": (
        lambda: {"prompt": "a cat", "height": 16, "width": 16, "num_frames": 9, "max_sequence_length": 16},
        "proj_out",
    ),
}

#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[[Make], dict[str, Any]]]] = {
    "instruct_pix2pix": ("StableDiffusionInstructPix2PixPipeline", build_instruct_pix2pix),
    "sd_upscale": ("StableDiffusionUpscalePipeline", build_upscale),
    "t2i_adapter": ("StableDiffusionAdapterPipeline", build_t2i_adapter),
    "depth2img": ("StableDiffusionDepth2ImgPipeline", build_depth2img),
    "lcm": ("LatentConsistencyModelPipeline", build_lcm),
    "pixart_sigma": ("PixArtSigmaPipeline", build_pixart),
    "auraflow": ("AuraFlowPipeline", build_auraflow),
    "cogvideox": ("CogVideoXPipeline", build_cogvideox),
}
