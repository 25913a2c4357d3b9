"""Tiny, offline diffusers pipelines of the SD and DiT families that the zoo does not build:
InstructPix2Pix (three-way guidance), the x4 upscaler (noised low-res image, noise level as class
label), T2I-Adapter, Depth2Img (given a depth map: no depth estimator), Latent Consistency (LCM),
DeepFloyd IF stage I (pixel space, no VAE, learned variance), PixArt-Σ, Sana (Gemma 2 encoder, DC-AE
VAE), Lumina 2 (a denoiser call for each guidance half), AuraFlow and CogVideoX.

>>> from diffusion_debug.testing import tiny_pipeline
>>> type(tiny_pipeline("instruct_pix2pix")).__name__
'StableDiffusionInstructPix2PixPipeline'

:data:`CALLS` gives, per kind, the keyword arguments of a call (without ``generator`` and
``num_inference_steps``) and a denoiser and its module that a test can plant a fault in (one whose
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

from .flux import one_block_vae
from .stable_diffusion import Make, build_sd, sd_unet, vae
from .text_encoders import WORDS, gemma2_config, qwen_tokenizer, t5_encoder_config, t5_tokenizer
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


def build_deepfloyd_if(make: Make) -> dict[str, Any]:
    from diffusers import DDPMScheduler, UNet2DConditionModel
    from diffusers.models.attention_processor import AttnAddedKVProcessor
    from transformers import T5EncoderModel

    def unet():
        found = UNet2DConditionModel(
            sample_size=32,
            layers_per_block=1,
            block_out_channels=(32, 64),
            down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
            mid_block_type="UNetMidBlock2DSimpleCrossAttn",
            up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
            in_channels=3,
            out_channels=6,  # the noise and the variance, learned
            cross_attention_dim=32,
            encoder_hid_dim=32,
            attention_head_dim=8,
            addition_embed_type="text",
            addition_embed_type_num_heads=2,
            cross_attention_norm="group_norm",
            resnet_time_scale_shift="scale_shift",
            act_fn="gelu",
        )
        found.set_attn_processor(AttnAddedKVProcessor())
        return found

    tokenizer = t5_tokenizer(WORDS)
    scheduler = DDPMScheduler(  # IF-I's own: no steps_offset, so leading spacing ends at t=0
        beta_schedule="squaredcos_cap_v2",
        thresholding=True,
        dynamic_thresholding_ratio=0.95,
        sample_max_value=1.0,
        variance_type="learned_range",
    )
    return dict(
        tokenizer=tokenizer,
        text_encoder=make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        unet=make("unet", unet),
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        watermarker=None,
        requires_safety_checker=False,
    )


def build_sana(make: Make) -> dict[str, Any]:
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaTransformer2DModel
    from transformers import Gemma2Model

    tokenizer = qwen_tokenizer()  # a byte-level BPE tokenizer, as Gemma's is
    transformer = make(
        "transformer",
        lambda: SanaTransformer2DModel(
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            num_attention_heads=2,
            attention_head_dim=4,
            num_cross_attention_heads=2,
            cross_attention_head_dim=4,
            cross_attention_dim=8,
            caption_channels=8,
            sample_size=32,
        ),
    )
    dc_ae = make(
        "vae",
        lambda: AutoencoderDC(
            in_channels=3,
            latent_channels=4,
            attention_head_dim=2,
            encoder_block_types=("ResBlock", "EfficientViTBlock"),
            decoder_block_types=("ResBlock", "EfficientViTBlock"),
            encoder_block_out_channels=(8, 8),
            decoder_block_out_channels=(8, 8),
            encoder_qkv_multiscales=((), (5,)),
            decoder_qkv_multiscales=((), (5,)),
            encoder_layers_per_block=(1, 1),
            decoder_layers_per_block=(1, 1),
            downsample_block_type="conv",
            upsample_block_type="interpolate",
            decoder_norm_types="rms_norm",
            decoder_act_fns="silu",
            scaling_factor=0.41407,
        ),
    )
    gemma = gemma2_config(tokenizer, head_dim=16, intermediate_size=64, num_hidden_layers=1)
    return dict(
        tokenizer=tokenizer,
        text_encoder=make("text_encoder", lambda: Gemma2Model(gemma)),
        vae=dc_ae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
    )


def build_lumina2(make: Make) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Transformer2DModel
    from transformers import Gemma2Model

    tokenizer = qwen_tokenizer()
    transformer = make(
        "transformer",
        lambda: Lumina2Transformer2DModel(
            sample_size=4,
            patch_size=2,
            in_channels=4,
            hidden_size=8,
            num_layers=2,
            num_attention_heads=1,
            num_kv_heads=1,
            multiple_of=16,
            ffn_dim_multiplier=None,
            norm_eps=1e-5,
            scaling_factor=1.0,
            axes_dim_rope=(4, 2, 2),
            cap_feat_dim=8,
        ),
    )
    gemma = gemma2_config(tokenizer, head_dim=4, intermediate_size=8, num_hidden_layers=2, sliding_window=2)
    return dict(
        transformer=transformer,
        vae=make("vae", lambda: one_block_vae(latent_channels=4)),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=make("text_encoder", lambda: Gemma2Model(gemma)),
        tokenizer=tokenizer,
    )


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

#: Per kind: ``(call kwargs without generator and num_inference_steps, denoiser, its module to plant in)``.
CALLS: dict[str, tuple[Callable[[], dict[str, Any]], str, str]] = {
    "instruct_pix2pix": (lambda: {"prompt": "a cat", "image": _image()}, "unet", _UNET_CONV),
    "sd_upscale": (lambda: {"prompt": "a cat", "image": _image(8)}, "unet", _UNET_CONV),  # 8 px in, 32 px out
    "t2i_adapter": (lambda: {"prompt": "a cat", "image": _image(), "height": 32, "width": 32}, "unet", _UNET_CONV),
    "depth2img": (
        lambda: {
            "prompt": "a cat",
            "image": _image(),
            "depth_map": torch.linspace(0.0, 1.0, 32 * 32).reshape(1, 32, 32),
            "strength": 0.8,
        },
        "unet",
        _UNET_CONV,
    ),
    "lcm": (lambda: {"prompt": "a cat"}, "unet", _UNET_CONV),
    "deepfloyd_if": (
        lambda: {"prompt": "a cat", "height": 32, "width": 32, "clean_caption": False},
        "unet",
        "conv_out",
    ),
    "pixart_sigma": (
        lambda: {
            "prompt": "a cat",
            "height": 32,
            "width": 32,
            "use_resolution_binning": False,
            "clean_caption": False,
        },
        "transformer",
        "transformer_blocks.0.ff.net.2",
    ),
    "sana": (
        lambda: {
            "prompt": "a cat",
            "height": 32,
            "width": 32,
            "max_sequence_length": 16,
            "complex_human_instruction": None,
            "use_resolution_binning": False,
        },
        "transformer",
        "proj_out",
    ),
    # two calls at step 0 (the conditional, then the unconditional), one from there (cfg_trunc_ratio);
    # x_embedder, the image tokens' embedding: norm_out's first token is a caption token, dropped
    "lumina2": (
        lambda: {"prompt": "a cat", "height": 32, "width": 32, "max_sequence_length": 64, "cfg_trunc_ratio": 0.5},
        "transformer",
        "x_embedder",
    ),
    "auraflow": (
        lambda: {"prompt": "a cat", "height": 32, "width": 32, "max_sequence_length": 16},
        "transformer",
        "proj_out",
    ),
    # proj_out, not a block's feed-forward: CogVideoX drops the text tokens' part of the last block
    "cogvideox": (
        lambda: {"prompt": "a cat", "height": 16, "width": 16, "num_frames": 9, "max_sequence_length": 16},
        "transformer",
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
    "deepfloyd_if": ("IFPipeline", build_deepfloyd_if),
    "pixart_sigma": ("PixArtSigmaPipeline", build_pixart),
    "sana": ("SanaPipeline", build_sana),
    "lumina2": ("Lumina2Pipeline", build_lumina2),
    "auraflow": ("AuraFlowPipeline", build_auraflow),
    "cogvideox": ("CogVideoXPipeline", build_cogvideox),
}
