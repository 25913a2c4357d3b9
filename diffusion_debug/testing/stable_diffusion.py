"""The Stable Diffusion family, tiny: the components of SD (``StableDiffusionPipeline``), SDXL
(``StableDiffusionXLPipeline``) and SD3 (``StableDiffusion3Pipeline``, without T5), and the SD VAE
that other tiny pipelines (PixArt-α, DiT) decode with too.

Built through :func:`~diffusion_debug.testing.tiny_pipeline` (kinds in
:data:`~diffusion_debug.testing.pipelines.TINY_KINDS`):

>>> from diffusion_debug.testing import tiny_pipeline
>>> pipe = tiny_pipeline("sdxl")
>>> type(pipe).__name__, pipe.vae_scale_factor, pipe.tokenizer_2.pad_token
('StableDiffusionXLPipeline', 4, '!')

Limits:

* The configs are tiny (hidden sizes of 32-64, one or two layers per block, a VAE that scales by 4
  rather than 8), so numerical behaviour such as fp16 overflow in a real model does not carry over:
  the fp16 runs of these pipelines are clean and can serve as a baseline for planted faults.
* ``sd3`` has no T5 encoder (``text_encoder_3=None``, ``tokenizer_3=None``); the pipeline uses
  zeros in its place, as the real pipeline does when loaded without T5. ``save_pretrained`` works
  for every kind, but diffusers only reloads a saved ``sd3`` pipeline when the missing T5 parts are
  passed back: ``from_pretrained(path, text_encoder_3=None, tokenizer_3=None)``.
* Images are 32x32 pixels by default; other sizes must be multiples of 8 (sd, sdxl: the UNet halves
  the latents once; sd3: patch size 2).
"""

from __future__ import annotations

from typing import Any, Callable

from .text_encoders import clip_text_config, clip_tokenizer

__all__ = ["BUILDERS", "sd_unet", "vae"]

Make = Callable[[str, Callable[[], Any]], Any]

# Pixel size of the default image: sample_size (in latent pixels) * vae_scale_factor (4).
_SAMPLE_SIZE = 8
_VAE_BLOCKS = (32, 32, 64)  # three blocks -> vae_scale_factor 4


def vae(**overrides: Any):
    """The tiny SD ``AutoencoderKL`` (4 latent channels, scale factor 4); ``overrides`` change its
    config (SDXL's scaling factor, SD3's 16 latent channels and shift)."""
    from diffusers import AutoencoderKL

    kwargs: dict[str, Any] = dict(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * len(_VAE_BLOCKS),
        up_block_types=("UpDecoderBlock2D",) * len(_VAE_BLOCKS),
        block_out_channels=_VAE_BLOCKS,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=_SAMPLE_SIZE * 2 ** (len(_VAE_BLOCKS) - 1),
        scaling_factor=0.18215,
    )
    kwargs.update(overrides)
    return AutoencoderKL(**kwargs)


def sd_unet(**overrides: Any):
    """The tiny SD ``UNet2DConditionModel`` (two cross-attention blocks, 4 latent channels in and
    out); ``overrides`` change its config (InstructPix2Pix's 8 input channels, LCM's
    ``time_cond_proj_dim``)."""
    from diffusers import UNet2DConditionModel

    kwargs: dict[str, Any] = dict(
        sample_size=_SAMPLE_SIZE,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
    )
    kwargs.update(overrides)
    return UNet2DConditionModel(**kwargs)


def build_sd(make: Make) -> dict[str, Any]:
    from diffusers import DDIMScheduler
    from transformers import CLIPTextModel

    unet = make("unet", sd_unet)
    scheduler = DDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type="epsilon",
        timestep_spacing="leading",
    )
    return dict(
        unet=unet,
        vae=make("vae", vae),
        text_encoder=make("text_encoder", lambda: CLIPTextModel(clip_text_config())),
        tokenizer=clip_tokenizer(),
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def build_sdxl(make: Make) -> dict[str, Any]:
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    hidden, projection, time_dim = 32, 32, 8
    unet = make(
        "unet",
        lambda: UNet2DConditionModel(
            sample_size=_SAMPLE_SIZE,
            in_channels=4,
            out_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            block_out_channels=(32, 64),
            layers_per_block=1,
            # The UNet sees the penultimate hidden states of both encoders, concatenated.
            cross_attention_dim=2 * hidden,
            attention_head_dim=(2, 4),
            use_linear_projection=True,
            norm_num_groups=32,
            addition_embed_type="text_time",
            addition_time_embed_dim=time_dim,
            # Pooled text_encoder_2 output + 6 micro-conditioning values (sizes, crop, target).
            projection_class_embeddings_input_dim=projection + 6 * time_dim,
        ),
    )
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        prediction_type="epsilon",
        timestep_spacing="leading",
        interpolation_type="linear",
    )
    return dict(
        unet=unet,
        vae=make("vae", lambda: vae(scaling_factor=0.13025, force_upcast=True)),
        text_encoder=make("text_encoder", lambda: CLIPTextModel(clip_text_config())),
        text_encoder_2=make(
            "text_encoder_2",
            lambda: CLIPTextModelWithProjection(clip_text_config(projection_dim=projection, hidden_act="gelu")),
        ),
        tokenizer=clip_tokenizer(),
        tokenizer_2=clip_tokenizer(pad_token="!"),  # the real SDXL tokenizer_2 pads with "!"
        scheduler=scheduler,
        force_zeros_for_empty_prompt=True,
    )


def build_sd3(make: Make) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    hidden, projection = 32, 32
    transformer = make(
        "transformer",
        lambda: SD3Transformer2DModel(
            sample_size=_SAMPLE_SIZE,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=2,
            attention_head_dim=8,
            num_attention_heads=4,
            # CLIP hidden states of both encoders are concatenated (and padded to this width).
            joint_attention_dim=2 * hidden,
            caption_projection_dim=32,
            pooled_projection_dim=2 * projection,
            pos_embed_max_size=32,  # latents up to 64x64 (256 px)
        ),
    )
    sd3_vae = make(
        "vae",
        lambda: vae(
            latent_channels=16,
            scaling_factor=1.5305,
            shift_factor=0.0609,
            use_quant_conv=False,
            use_post_quant_conv=False,
        ),
    )
    return dict(
        transformer=transformer,
        vae=sd3_vae,
        text_encoder=make(
            "text_encoder", lambda: CLIPTextModelWithProjection(clip_text_config(projection_dim=projection))
        ),
        tokenizer=clip_tokenizer(),
        text_encoder_2=make(
            "text_encoder_2",
            lambda: CLIPTextModelWithProjection(clip_text_config(projection_dim=projection, hidden_act="gelu")),
        ),
        tokenizer_2=clip_tokenizer(pad_token="!"),
        text_encoder_3=None,
        tokenizer_3=None,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
    )


#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[[Make], dict[str, Any]]]] = {
    "sd": ("StableDiffusionPipeline", build_sd),
    "sdxl": ("StableDiffusionXLPipeline", build_sdxl),
    "sd3": ("StableDiffusion3Pipeline", build_sd3),
}
