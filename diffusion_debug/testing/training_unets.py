"""The tiny diffusers UNets the multi-process training scripts of the tests train (they run as
``accelerate launch`` / ``torchrun`` processes, so they import these rather than a fixture). Seed
the generator first, as a script would: the builders draw from torch's default one."""

from __future__ import annotations

from typing import Any


def launch_unet() -> Any:
    """The smallest UNet with cross-attention that trains in a launch: widths 8 and 16, one
    cross-attention block a level (``up_blocks.1.resnets.0.conv2`` is where the scripts plant)."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16,
        norm_num_groups=4,
        attention_head_dim=4,
    )


def sharded_unet() -> Any:
    """A UNet wide enough to shard by block (widths 32 and 64: FSDP2 and ZeRO-3 split each block's
    parameters between two ranks)."""
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
    )


def tiny_sd_unet(seed: int = 0) -> Any:
    """``tiny_pipeline("sd", seed=seed).unet``, bitwise (the same config and seed), in eval mode, without
    building the rest of the pipeline: a launched rank that trains the UNet alone then imports neither
    the diffusers pipelines nor transformers (seconds of CPU each) and builds no VAE or text encoder.
    The global torch RNG state is left as it was."""
    import torch

    from .pipelines import _component_seed
    from .stable_diffusion import sd_unet

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_component_seed(seed, "sd", "unet"))
        return sd_unet().eval()
