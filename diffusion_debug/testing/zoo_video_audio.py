"""Tiny, offline Stable Video Diffusion, Wan 2.2, LTX-2 and Dance Diffusion (audio) pipelines:
layouts the SD family does not have -- SVD denoises 5-D video latents (batch, frames, channels, h,
w), Dance Diffusion 3-D audio (batch, channels, samples), Wan 2.2 (``wan22``) has two denoising
experts, ``transformer`` and ``transformer_2`` (its call: :func:`WAN22_CALL`), and LTX-2 (``ltx2``)
denoises video and audio latents together in one transformer, the audio with a deep copy of
``pipe.scheduler`` (its call: :func:`LTX2_CALL`). (Flux, whose latents are packed tokens, is an
image pipeline: :mod:`~diffusion_debug.testing.flux`.)

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
array. LTX-2's text encoder is a tiny Gemma 3 built from its config, with the offline T5 tokenizer
of :mod:`~diffusion_debug.testing.text_encoders` (Gemma's own needs a download).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["BUILDERS", "CALLS", "KINDS", "LTX2_CALL", "WAN22_CALL"]


#: The kinds of this module that :func:`~diffusion_debug.testing.tiny_pipeline` builds.
KINDS = ("svd", "dance_diffusion", "wan22", "ltx2")

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


def LTX2_CALL() -> dict[str, Any]:  # noqa: N802 (a constant's name, as CALLS)
    """The keyword arguments of a tiny LTX-2 call: 5 frames of 32x32 and their audio, every
    guidance off (one transformer call a step; the sampling knobs as diffusers' own tests pin them)."""
    return {
        "prompt": "a cat",
        "negative_prompt": "",
        "height": 32,
        "width": 32,
        "num_frames": 5,
        "frame_rate": 25.0,
        "max_sequence_length": 16,
        "guidance_scale": 1.0,
        "stg_scale": 0.0,
        "modality_scale": 1.0,
        "guidance_rescale": 0.0,
        "audio_guidance_scale": 1.0,
        "audio_stg_scale": 0.0,
        "audio_modality_scale": 1.0,
        "audio_guidance_rescale": 0.0,
        "spatio_temporal_guidance_blocks": None,
        "use_cross_timestep": False,
        "output_type": "pt",
    }


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
    import inspect

    from diffusers import IPNDMScheduler, UNet1DModel

    # diffusers < 0.33 has no `time_embedding_dim`: its Fourier embedding is 16 wide, as asked here
    sized = {"time_embedding_dim": 16} if "time_embedding_dim" in inspect.signature(UNet1DModel).parameters else {}
    unet = make(
        "unet",
        lambda: UNet1DModel(
            block_out_channels=(32, 32, 64),
            extra_in_channels=16,  # the Fourier time embedding, concatenated to the audio
            **sized,
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


WAN_TRANSFORMER: dict[str, Any] = dict(
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
"""A tiny Wan-family transformer (sizes as diffusers' tests): Wan 2.2's experts, Wan image-to-video's (with
its own ``in_channels`` and ``image_dim``), SkyReels-V2's."""


def wan_vae():
    """A tiny Wan video VAE (sizes as diffusers' tests), for the Wan-family pipelines."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )


def build_wan22(make) -> dict[str, Any]:
    """Wan 2.2 text-to-video with two experts: ``transformer`` for the high-noise steps (t >= 875
    of 1000), ``transformer_2`` for the rest; with 2 steps each runs one (sizes as diffusers' tests)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from transformers import T5EncoderModel

    from .text_encoders import WORDS, t5_encoder_config, t5_tokenizer

    tokenizer = t5_tokenizer(WORDS)

    def expert():
        return WanTransformer3DModel(**WAN_TRANSFORMER)

    vae = make("vae", wan_vae)
    return dict(
        transformer=make("transformer", expert),
        transformer_2=make("transformer_2", expert),
        vae=vae,
        text_encoder=make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        boundary_ratio=0.875,
    )


def build_ltx2(make) -> dict[str, Any]:
    """LTX-2 text-to-video with audio, sizes as diffusers' tests (``tests/pipelines/ltx2``), its
    Gemma 3 text encoder (hidden size 32, 2 layers, a one-layer vision tower it never calls) made
    from a config."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    from .text_encoders import WORDS, t5_tokenizer

    tokenizer = t5_tokenizer(WORDS)
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=64,
        sliding_window=16,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
    )
    encoder = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    transformer = make(
        "transformer",
        lambda: LTX2VideoTransformer3DModel(
            in_channels=4,
            out_channels=4,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=2,
            attention_head_dim=8,
            cross_attention_dim=16,
            audio_in_channels=4,
            audio_out_channels=4,
            audio_num_attention_heads=2,
            audio_attention_head_dim=4,
            audio_cross_attention_dim=8,
            num_layers=2,
            qk_norm="rms_norm_across_heads",
            caption_channels=text.hidden_size,
            rope_double_precision=False,
            rope_type="split",
        ),
    )
    connector = {"num_attention_heads": 4, "attention_head_dim": 8, "num_layers": 1, "num_learnable_registers": None}
    connectors = make(
        "connectors",
        lambda: LTX2TextConnectors(
            caption_channels=text.hidden_size,
            text_proj_in_factor=text.num_hidden_layers + 1,  # every hidden state of the encoder, stacked
            **{
                f"{stream}_connector_{key}": value for stream in ("video", "audio") for key, value in connector.items()
            },
            connector_rope_base_seq_len=32,
            rope_theta=10000.0,
            rope_double_precision=False,
            causal_temporal_positioning=False,
            rope_type="split",
        ),
    )

    def video_vae():
        vae = AutoencoderKLLTX2Video(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            block_out_channels=(8,),
            decoder_block_out_channels=(8,),
            layers_per_block=(1,),
            decoder_layers_per_block=(1, 1),
            spatio_temporal_scaling=(True,),
            decoder_spatio_temporal_scaling=(True,),
            decoder_inject_noise=(False, False),
            downsample_type=("spatial",),
            upsample_residual=(False,),
            upsample_factor=(1,),
            timestep_conditioning=False,
            patch_size=1,
            patch_size_t=1,
            encoder_causal=True,
            decoder_causal=False,
        )
        vae.use_framewise_encoding = vae.use_framewise_decoding = False
        return vae

    audio_vae = make(
        "audio_vae",
        lambda: AutoencoderKLLTX2Audio(
            base_channels=4,
            output_channels=2,
            ch_mult=(1,),
            num_res_blocks=1,
            attn_resolutions=None,
            in_channels=2,
            resolution=32,
            latent_channels=2,
            norm_type="pixel",
            causality_axis="height",
            dropout=0.0,
            mid_block_add_attention=False,
            sample_rate=16000,
            mel_hop_length=160,
            is_causal=True,
            mel_bins=8,
        ),
    )
    vocoder = make(
        "vocoder",
        lambda: LTX2Vocoder(
            in_channels=2 * 8,  # the audio VAE's output channels x mel bins
            hidden_channels=32,
            out_channels=2,
            upsample_kernel_sizes=[4, 4],
            upsample_factors=[2, 2],
            resnet_kernel_sizes=[3],
            resnet_dilations=[[1, 3, 5]],
            leaky_relu_negative_slope=0.1,
            output_sampling_rate=16000,
        ),
    )
    return dict(
        transformer=transformer,
        vae=make("vae", video_vae),
        audio_vae=audio_vae,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=make("text_encoder", lambda: Gemma3ForConditionalGeneration(encoder)),
        tokenizer=tokenizer,
        connectors=connectors,
        vocoder=vocoder,
    )


#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[..., dict[str, Any]]]] = {
    "svd": ("StableVideoDiffusionPipeline", build_svd),
    "dance_diffusion": ("DanceDiffusionPipeline", build_dance_diffusion),
    "wan22": ("WanPipeline", build_wan22),
    "ltx2": ("LTX2Pipeline", build_ltx2),
}
