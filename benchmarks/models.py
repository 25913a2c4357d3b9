"""The models benchmarks run on: a mid-size UNet pipeline (about 18M UNet parameters, 32x32
latents) built offline like the tiny pipelines, an SD1.5-size UNet for GPU runs, and SD1.5's
topology at tiny widths (:func:`sd15_shaped_pipeline`), whose counts stand for a GPU's at real size."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel

from diffusion_debug.testing import tiny_pipeline


def mid_unet(cross_attention_dim: int = 32, seed: int = 0) -> UNet2DConditionModel:
    """An SD-style UNet of about 18M parameters (channels 64/128/256, 2 layers a block)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return UNet2DConditionModel(
            sample_size=32,
            in_channels=4,
            out_channels=4,
            layers_per_block=2,
            block_out_channels=(64, 128, 256),
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=cross_attention_dim,
            attention_head_dim=8,
            norm_num_groups=32,
        ).eval()


def sd15_unet(seed: int = 0) -> UNet2DConditionModel:
    """The SD1.5 UNet config (860M parameters) with random weights."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return UNet2DConditionModel(
            sample_size=64,
            cross_attention_dim=768,
            attention_head_dim=8,
            block_out_channels=(320, 640, 1280, 1280),
            layers_per_block=2,
        ).eval()


def mid_pipeline(seed: int = 0, dtype: torch.dtype = torch.float32) -> StableDiffusionPipeline:
    """The tiny SD pipeline with its UNet swapped for :func:`mid_unet` (128x128 px images)."""
    tiny = tiny_pipeline("sd", seed=seed)
    unet = mid_unet(tiny.text_encoder.config.hidden_size, seed)
    pipe = StableDiffusionPipeline(**{**tiny.components, "unet": unet}, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(dtype=dtype)


def sd15_shaped_pipeline(dtype: torch.dtype = torch.float16, seed: int = 0) -> StableDiffusionPipeline:
    """SD1.5's module topology at tiny widths, the GPU-shaped CPU proxy: the SD1.5 UNet's 4 levels
    with 2 layers each (3 cross-attention down blocks, a plain one, and their mirror), the SD VAE's
    4-level decoder with 2 layers a level, and a 12-layer CLIP text encoder; channels 8/16/16/16,
    hidden size 16, 8x8 latents (64x64 px). Every op is about as cheap as a kernel launch, so the
    hooks and ops a debugger adds weigh what they weigh on a GPU at real size.

    Its scheduler predicts ``v`` (SD2's ``prediction_type``; SD2's UNet has this topology too), so
    that a watched call is as quiet as a trained model's: random weights output about 0.3 whatever
    the noise, and a ``v`` of about 0 is the denoiser of unit-variance latents (x0 = sqrt(alpha_bar)
    x_t), which keeps the latents' std at 0.9-1.0 through every step. Under SD1.5's
    ``"epsilon"`` the same output, uncorrelated with the noise, reads as "no noise left": DDIM
    divides the latents by sqrt(alpha_bar) until their std reaches 10, and ``latent_divergence``
    rightly fires at step 6 of 20 on every call, so the clean runs timed a warning's cost too."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTextModel

    from diffusion_debug.testing.text_encoders import clip_text_config

    tiny = tiny_pipeline("sd", seed=seed)
    text_config = clip_text_config()
    text_config.update(dict(hidden_size=16, intermediate_size=32, num_hidden_layers=12, num_attention_heads=2))
    widths = (8, 16, 16, 16)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        unet = UNet2DConditionModel(
            sample_size=8,
            block_out_channels=widths,
            layers_per_block=2,
            cross_attention_dim=text_config.hidden_size,
            attention_head_dim=8,
            norm_num_groups=8,
        )
        vae = AutoencoderKL(
            block_out_channels=widths,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            latent_channels=4,
            layers_per_block=2,
            norm_num_groups=8,
            sample_size=64,
        )
        text_encoder = CLIPTextModel(text_config)
    scheduler = type(tiny.scheduler).from_config(tiny.scheduler.config, prediction_type="v_prediction")
    parts = {**tiny.components, "unet": unet, "vae": vae, "text_encoder": text_encoder, "scheduler": scheduler}
    pipe = StableDiffusionPipeline(**parts, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(dtype=dtype)


PIXART_1024_PROJECTION_BYTES = 2 * (1024 // 16) ** 2 * 1152 * 2
"""The bytes of one float16 output of a PixArt-alpha 1024px block's projection (``attn1.to_out.0``, ``attn2.to_out.0``,
``ff.net.2``) under float16 autocast with CFG: 2 images x 4096 tokens (128x128 latents, patch 2) x 1152 channels."""


def pixart_shaped_pipeline(seed: int = 0) -> Any:
    """PixArt-alpha's depth (28 blocks of two attentions and a FeedForward) at tiny widths (the tiny PixArt's
    24 channels, 4 tokens: 32x32 px with :data:`~diffusion_debug.testing.zoo.ZOO_CALLS`' ``"pixart"``), float32,
    as a user runs it under float16 autocast: the hooks and reads its sentinel adds a step are those of the real
    model; the bytes it holds are emulated by :func:`~benchmarks.op_counts.held_bytes` (the real model's flushes)."""
    from diffusion_debug.testing.flux import deeper

    return deeper(tiny_pipeline("pixart", seed=seed), seed=seed, num_layers=28)
