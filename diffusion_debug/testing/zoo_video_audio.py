"""Tiny, offline Stable Video Diffusion, Wan 2.2 and Dance Diffusion (audio) pipelines: layouts
the SD family does not have -- SVD denoises 5-D video latents (batch, frames, channels, h, w),
Dance Diffusion 3-D audio (batch, channels, samples), and Wan 2.2 (``wan22``) has two denoising
experts, ``transformer`` and ``transformer_2`` (its call: :func:`WAN22_CALL`). (Flux, whose
latents are packed tokens, is an image pipeline: :mod:`~diffusion_debug.testing.flux`.)

Built through :func:`~diffusion_debug.testing.tiny_pipeline`:

>>> from diffusion_debug.testing import tiny_pipeline
>>> type(tiny_pipeline("dance_diffusion")).__name__
'DanceDiffusionPipeline'

:data:`CALLS` gives, per kind, the keyword arguments of a call (without ``generator`` and
``num_inference_steps``) and the name of the denoiser. Each call takes well under a second on a
CPU with 2 steps.

Limits: random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`); the sizes in
:data:`CALLS` are the ones the tiny configs fit (SVD: 32x32, 2 frames; Dance Diffusion: 256 samples
at 16 kHz). ``DanceDiffusionPipeline`` is deprecated in diffusers (it logs a warning when built;
the warning is silenced here) and has no ``output_type`` or step callback: its output is a numpy
array.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["BUILDERS", "CALLS", "KINDS", "WAN22_CALL"]


#: The kinds of this module that :func:`~diffusion_debug.testing.tiny_pipeline` builds.
KINDS = ("svd", "dance_diffusion", "wan22")

#: Per kind: ``(call kwargs without generator and num_inference_steps, denoiser attribute)``.
CALLS: dict[str, tuple[Callable[[], dict[str, Any]], str]] = {
    "svd": (
        lambda: {
            "image": torch.linspace(0.0, 1.0, 3 * 32 * 32).reshape(1, 3, 32, 32),
            "num_frames": 2,
            "height": 32,
            "width": 32,
            "min_guidance_scale": 1.0,
            "max_guidance_scale": 2.5,
            "output_type": "pt",
        },
        "unet",
    ),
    "dance_diffusion": (lambda: {"audio_length_in_s": 256 / 16_000}, "unet"),
}


def WAN22_CALL() -> dict[str, Any]:  # noqa: N802 (a constant's name, as CALLS)
    """The keyword arguments of a tiny Wan 2.2 call (with guidance: two expert calls a step)."""
    return {"prompt": "a cat", "height": 16, "width": 16, "num_frames": 5, "output_type": "pt"}


def build_svd(make) -> dict[str, Any]:
    from diffusers import AutoencoderKLTemporalDecoder, EulerDiscreteScheduler, UNetSpatioTemporalConditionModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    unet = make(
        "unet",
        lambda: UNetSpatioTemporalConditionModel(
            block_out_channels=(32, 64),
            layers_per_block=1,
            sample_size=32,
            in_channels=8,  # the noisy latents and the image latents, concatenated
            out_channels=4,
            down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
            up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
            cross_attention_dim=32,
            num_attention_heads=8,
            projection_class_embeddings_input_dim=96,  # 3 added time ids x addition_time_embed_dim
            addition_time_embed_dim=32,
        ),
    )
    vae = make(
        "vae",
        lambda: AutoencoderKLTemporalDecoder(
            block_out_channels=[32, 64],
            in_channels=3,
            out_channels=3,
            down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
            latent_channels=4,
        ),
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        projection_dim=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        image_size=32,
        intermediate_size=37,
        patch_size=8,
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        interpolation_type="linear",
        num_train_timesteps=1000,
        prediction_type="v_prediction",
        sigma_max=700.0,
        sigma_min=0.002,
        steps_offset=1,
        timestep_spacing="leading",
        timestep_type="continuous",
        use_karras_sigmas=True,
    )
    return dict(
        unet=unet,
        image_encoder=make("image_encoder", lambda: CLIPVisionModelWithProjection(vision)),
        scheduler=scheduler,
        vae=vae,
        feature_extractor=CLIPImageProcessor(crop_size=32, size=32),
    )


def build_dance_diffusion(make) -> dict[str, Any]:
    from diffusers import IPNDMScheduler, UNet1DModel

    unet = make(
        "unet",
        lambda: UNet1DModel(
            block_out_channels=(32, 32, 64),
            extra_in_channels=16,  # the Fourier time embedding, concatenated to the audio
            time_embedding_dim=16,
            sample_size=256,
            sample_rate=16_000,
            in_channels=2,
            out_channels=2,
            flip_sin_to_cos=True,
            use_timestep_embedding=False,
            time_embedding_type="fourier",
            mid_block_type="UNetMidBlock1D",
            down_block_types=("DownBlock1DNoSkip", "DownBlock1D", "AttnDownBlock1D"),
            up_block_types=("AttnUpBlock1D", "UpBlock1D", "UpBlock1DNoSkip"),
        ),
    )
    return dict(unet=unet, scheduler=IPNDMScheduler())


def build_wan22(make) -> dict[str, Any]:
    """Wan 2.2 text-to-video with two experts: ``transformer`` for the high-noise steps (t >= 875
    of 1000), ``transformer_2`` for the rest; with 2 steps each runs one (sizes as diffusers' tests)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import T5EncoderModel

    from .text_encoders import WORDS, t5_encoder_config, t5_tokenizer

    tokenizer = t5_tokenizer(WORDS)

    def expert():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=256,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )

    vae = make(
        "vae",
        lambda: AutoencoderKLWan(
            base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
        ),
    )
    return dict(
        transformer=make("transformer", expert),
        transformer_2=make("transformer_2", expert),
        vae=vae,
        text_encoder=make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        boundary_ratio=0.875,
    )


#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[..., dict[str, Any]]]] = {
    "svd": ("StableVideoDiffusionPipeline", build_svd),
    "dance_diffusion": ("DanceDiffusionPipeline", build_dance_diffusion),
    "wan22": ("WanPipeline", build_wan22),
}
