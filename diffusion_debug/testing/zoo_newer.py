"""Tiny, offline pipelines of the newer families people run, conditioned on an image or a video:
Flux Kontext (the reference image's tokens appended to the latents' sequence), Flux Fill (masked
image and mask concatenated to the latents' channels), Flux Control (a control image's latents
concatenated to the latents' channels: Canny / depth), Chroma (Flux without CLIP, true CFG: two
transformer calls a step), HunyuanVideo (Llama and CLIP text encoders, guidance as an input), Mochi (T5, its own
causal video VAE), Wan
2.1 image-to-video (a CLIP image encoder, the conditioning video concatenated to the latents) and
the SDXL refiner (img2img with ``text_encoder_2`` alone and the aesthetic score in its time ids).

>>> from diffusion_debug.testing import tiny_pipeline
>>> type(tiny_pipeline("sdxl_refiner")).__name__
'StableDiffusionXLImg2ImgPipeline'

:data:`ZOO_CALLS` gives, per kind, the keyword arguments of a call (without ``generator``,
``num_inference_steps`` and ``output_type``) and the pipeline inputs a test can make non-finite, as
:data:`~diffusion_debug.testing.zoo.ZOO_CALLS` does. Sizes follow diffusers' own fast tests of each
pipeline (``tests/pipelines/<name>``); each 2-step call takes under a second on a CPU.

Limits: random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`); the tokenizers are the
offline ones of :mod:`~diffusion_debug.testing.text_encoders` (HunyuanVideo's Llama reads the T5
unigram tokenizer's ids, its prompt template is ``"{}"``). Wan image-to-video is called with prompt
embeddings: diffusers' ``WanImageToVideoPipeline`` cleans a prompt with ``ftfy`` without asking
whether it is installed, so its text encoder is not called here. Flux Kontext is called with
``max_area`` 256 and ``_auto_resize`` off (else it resizes to 1024x1024).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .flux import build_flux, one_block_vae
from .stable_diffusion import Make, build_sdxl
from .text_encoders import WORDS, clip_text_config, clip_tokenizer, t5_encoder_config, t5_tokenizer
from .zoo_video_audio import WAN_TRANSFORMER, wan_vae

__all__ = ["BUILDERS", "ZOO_CALLS", "ZOO_KINDS"]

#: The kinds this module builds (``tiny_pipeline(kind)`` accepts them too).
ZOO_KINDS = (
    "flux_kontext",
    "flux_fill",
    "flux_control",
    "chroma",
    "hunyuan_video",
    "mochi",
    "wan_i2v",
    "sdxl_refiner",
)


def _image(size: int) -> torch.Tensor:
    return torch.linspace(0.0, 1.0, 3 * size * size).reshape(1, 3, size, size)


def _embeds(sign: float) -> torch.Tensor:
    """Prompt embeddings of 16 tokens for the T5 width (32) of the tiny Wan transformer."""
    return torch.linspace(-sign, sign, 16 * 32).reshape(1, 16, 32)


_FLUX = {"prompt": "a cat", "height": 16, "width": 16, "max_sequence_length": 16}

#: Per kind: ``(call kwargs without generator and num_inference_steps, names of tensor inputs a test may poison)``.
ZOO_CALLS: dict[str, tuple[Callable[[], dict[str, Any]], tuple[str, ...]]] = {
    "flux_kontext": (
        lambda: {**_FLUX, "image": _image(16), "guidance_scale": 3.5, "max_area": 16 * 16, "_auto_resize": False},
        ("image", "latents"),
    ),
    "flux_fill": (lambda: {**_FLUX, "image": _image(16), "mask_image": torch.ones(1, 1, 16, 16)}, ("image",)),
    "flux_control": (lambda: {**_FLUX, "control_image": _image(16), "guidance_scale": 3.5}, ("control_image",)),
    "chroma": (lambda: {**_FLUX, "negative_prompt": "bad", "guidance_scale": 5.0}, ("latents",)),
    "hunyuan_video": (
        lambda: {
            "prompt": "a cat",
            "prompt_template": {"template": "{}", "crop_start": 0},
            "guidance_scale": 4.5,
            "height": 16,
            "width": 16,
            "num_frames": 5,
            "max_sequence_length": 16,
        },
        ("latents",),
    ),
    "mochi": (
        lambda: {
            "prompt": "a cat",
            "negative_prompt": "",
            "guidance_scale": 4.5,
            "height": 16,
            "width": 16,
            "num_frames": 7,
            "max_sequence_length": 16,
        },
        ("latents",),
    ),
    "wan_i2v": (
        lambda: {
            "image": _image(32),
            "prompt_embeds": _embeds(1.0),
            "negative_prompt_embeds": _embeds(-1.0),
            "guidance_scale": 6.0,
            "height": 16,
            "width": 16,
            "num_frames": 5,
        },
        ("latents", "prompt_embeds"),
    ),
    "sdxl_refiner": (lambda: {"prompt": "a cat", "image": _image(32), "strength": 1.0}, ("image",)),
}


def _flux_transformer(make: Make, in_channels: int):
    from diffusers import FluxTransformer2DModel

    return make(
        "transformer",
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=in_channels,
            out_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,
            axes_dims_rope=[4, 4, 8],
        ),
    )


def _flux_concat(make: Make, in_channels: int) -> dict[str, Any]:
    """Flux with a transformer taking ``in_channels`` (conditioning concatenated to the latents)."""
    found = build_flux(make)
    for name in ("image_encoder", "feature_extractor"):  # neither pipeline takes an IP-Adapter
        del found[name]
    return {**found, "transformer": _flux_transformer(make, in_channels=in_channels)}


def build_flux_fill(make: Make) -> dict[str, Any]:
    # packed 2x2: the latents (1 channel), the masked image's latents (1) and the mask (1 at scale 1)
    return _flux_concat(make, 4 + 4 + 4)


def build_flux_control(make: Make) -> dict[str, Any]:
    return _flux_concat(make, 4 + 4)  # packed 2x2: the latents and the control image's latents


def build_chroma(make: Make) -> dict[str, Any]:
    from diffusers import ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5EncoderModel

    tokenizer = t5_tokenizer(WORDS)
    transformer = make(
        "transformer",
        lambda: ChromaTransformer2DModel(
            patch_size=1,
            in_channels=4,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=[4, 4, 8],
            approximator_hidden_dim=32,
            approximator_layers=1,
            approximator_num_channels=16,
        ),
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        tokenizer=tokenizer,
        transformer=transformer,
        vae=make("vae", one_block_vae),
        image_encoder=None,
        feature_extractor=None,
    )


def build_hunyuan_video(make: Make) -> dict[str, Any]:
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoTransformer3DModel
    from transformers import CLIPTextModel, LlamaConfig, LlamaModel

    tokenizer = t5_tokenizer(WORDS)
    llama = LlamaConfig(
        hidden_size=16,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=2,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        hidden_act="gelu",
    )
    transformer = make(
        "transformer",
        lambda: HunyuanVideoTransformer3DModel(
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=10,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            patch_size=1,
            patch_size_t=1,
            guidance_embeds=True,
            text_embed_dim=16,  # the Llama's width
            pooled_projection_dim=32,  # the CLIP's
            rope_axes_dim=(2, 4, 4),
        ),
    )
    video_vae = make(
        "vae",
        lambda: AutoencoderKLHunyuanVideo(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            act_fn="silu",
            norm_num_groups=4,
            scaling_factor=0.476986,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
            mid_block_add_attention=True,
        ),
    )
    return dict(
        transformer=transformer,
        vae=video_vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=make("text_encoder", lambda: LlamaModel(llama)),
        tokenizer=tokenizer,
        text_encoder_2=make("text_encoder_2", lambda: CLIPTextModel(clip_text_config(hidden_act="gelu"))),
        tokenizer_2=clip_tokenizer(),
    )


def build_mochi(make: Make) -> dict[str, Any]:
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiTransformer3DModel
    from transformers import T5EncoderModel

    tokenizer = t5_tokenizer(WORDS)
    transformer = make(
        "transformer",
        lambda: MochiTransformer3DModel(
            patch_size=2,
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=2,
            pooled_projection_dim=16,
            in_channels=12,
            out_channels=None,
            qk_norm="rms_norm",
            text_embed_dim=32,  # the T5's width
            time_embed_dim=4,
            activation_fn="swiglu",
            max_sequence_length=16,
        ),
    )
    video_vae = make(
        "vae",
        lambda: AutoencoderKLMochi(
            latent_channels=12,
            out_channels=3,
            encoder_block_out_channels=(32, 32, 32, 32),
            decoder_block_out_channels=(32, 32, 32, 32),
            layers_per_block=(1, 1, 1, 1, 1),
        ),
    )
    return dict(
        transformer=transformer,
        vae=video_vae,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        tokenizer=tokenizer,
    )


def build_wan_i2v(make: Make) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection, T5EncoderModel

    tokenizer = t5_tokenizer(WORDS)
    vision = CLIPVisionConfig(
        hidden_size=4,
        projection_dim=4,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=32,
        intermediate_size=16,
        patch_size=1,
    )
    transformer = make(
        "transformer",
        # in_channels: the noisy latents (16), the conditioning video's latents (16), its mask (4);
        # image_dim: the image encoder's width
        lambda: WanTransformer3DModel(**{**WAN_TRANSFORMER, "in_channels": 36, "image_dim": 4}),
    )
    video_vae = make("vae", wan_vae)
    return dict(
        transformer=transformer,
        vae=video_vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder=make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        tokenizer=tokenizer,
        image_encoder=make("image_encoder", lambda: CLIPVisionModelWithProjection(vision)),
        image_processor=CLIPImageProcessor(crop_size=32, size=32),
    )


def build_sdxl_refiner(make: Make) -> dict[str, Any]:
    from diffusers import UNet2DConditionModel

    hidden, time_dim = 32, 8
    unet = make(
        "unet",
        lambda: UNet2DConditionModel(
            sample_size=8,
            in_channels=4,
            out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            block_out_channels=(32, 64),
            layers_per_block=1,
            cross_attention_dim=hidden,  # text_encoder_2's hidden states alone
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            norm_num_groups=32,
            addition_embed_type="text_time",
            addition_time_embed_dim=time_dim,
            # pooled text_encoder_2 output + 5 values: original size, crop, aesthetic score
            projection_class_embeddings_input_dim=hidden + 5 * time_dim,
        ),
    )
    found = build_sdxl(make)
    found.update(unet=unet, text_encoder=None, tokenizer=None, force_zeros_for_empty_prompt=False)
    return {**found, "requires_aesthetics_score": True}


#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[[Make], dict[str, Any]]]] = {
    "flux_kontext": ("FluxKontextPipeline", build_flux),
    "flux_fill": ("FluxFillPipeline", build_flux_fill),
    "flux_control": ("FluxControlPipeline", build_flux_control),
    "chroma": ("ChromaPipeline", build_chroma),
    "hunyuan_video": ("HunyuanVideoPipeline", build_hunyuan_video),
    "mochi": ("MochiPipeline", build_mochi),
    "wan_i2v": ("WanImageToVideoPipeline", build_wan_i2v),
    "sdxl_refiner": ("StableDiffusionXLImg2ImgPipeline", build_sdxl_refiner),
}
