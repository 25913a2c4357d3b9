"""Tiny, offline Flux, Stable Video Diffusion and Dance Diffusion (audio) pipelines: three latent
layouts the SD family does not have -- Flux packs its latents into tokens (batch, seq, channels),
SVD denoises 5-D video latents (batch, frames, channels, h, w), Dance Diffusion 3-D audio
(batch, channels, samples).

Built through :func:`~diffusion_debug.testing.tiny_pipeline`:

>>> from diffusion_debug.testing import tiny_pipeline
>>> type(tiny_pipeline("dance_diffusion")).__name__
'DanceDiffusionPipeline'

:data:`CALLS` gives, per kind, the keyword arguments of a call (without ``generator`` and
``num_inference_steps``) and the name of the denoiser. Each call takes well under a second on a
CPU with 2 steps.

Limits: random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`); Flux's CLIP tokenizer
is the tiny byte-level BPE one and its T5 tokenizer the in-memory unigram one of
:mod:`~diffusion_debug.testing.zoo`; the sizes in :data:`CALLS` are the ones the tiny configs fit
(Flux: multiples of 2 pixels, the VAE does not downscale; SVD: 32x32, 2 frames; Dance Diffusion:
256 samples at 16 kHz). ``DanceDiffusionPipeline`` is deprecated in diffusers (it logs a warning
when built; the warning is silenced here) and has no ``output_type`` or step callback: its output
is a numpy array.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .zoo import t5_encoder_config, t5_tokenizer

__all__ = ["CALLS", "KINDS"]


#: The kinds of this module that :func:`~diffusion_debug.testing.tiny_pipeline` builds.
KINDS = ("flux", "svd", "dance_diffusion")

#: Per kind: ``(call kwargs without generator and num_inference_steps, denoiser attribute)``.
CALLS: dict[str, tuple[Callable[[], dict[str, Any]], str]] = {
    "flux": (
        lambda: {
            "prompt": "a cat",
            "height": 16,
            "width": 16,
            "guidance_scale": 3.5,
            "max_sequence_length": 16,
            "output_type": "pt",
        },
        "transformer",
    ),
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


def build_flux(make, words, clip_config, tokenizer) -> dict[str, Any]:
    """Flux's components; the CLIP text config and tokenizer come from the caller (see ``zoo``)."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    t5_tok = t5_tokenizer(words)
    t5 = t5_encoder_config(t5_tok)
    transformer = make(
        "transformer",
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=4,  # 1 latent channel, packed 2x2
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            pooled_projection_dim=32,
            guidance_embeds=True,  # FLUX.1-dev: guidance_scale is an input of the transformer
            axes_dims_rope=[4, 4, 8],
        ),
    )
    vae = make(
        "vae",
        lambda: AutoencoderKL(
            sample_size=32,
            in_channels=3,
            out_channels=3,
            block_out_channels=(4,),
            layers_per_block=1,
            latent_channels=1,
            norm_num_groups=1,
            use_quant_conv=False,
            use_post_quant_conv=False,
            shift_factor=0.0609,
            scaling_factor=1.5035,
        ),
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=make("text_encoder", lambda: CLIPTextModel(clip_config)),
        text_encoder_2=make("text_encoder_2", lambda: T5EncoderModel(t5)),
        tokenizer=tokenizer,
        tokenizer_2=t5_tok,
        transformer=transformer,
        vae=vae,
        image_encoder=None,
        feature_extractor=None,
    )


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


_CLASSES = {"flux": "FluxPipeline", "svd": "StableVideoDiffusionPipeline", "dance_diffusion": "DanceDiffusionPipeline"}


def pipeline_class(kind: str):
    import diffusers

    return getattr(diffusers, _CLASSES[kind])
