"""The models benchmarks run on: a mid-size UNet pipeline (about 18M UNet parameters, 32x32
latents) built offline like the tiny pipelines, and an SD1.5-size UNet for GPU runs."""

from __future__ import annotations

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
