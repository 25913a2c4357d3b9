"""Tiny, offline video and audio pipelines of the families users run that the older zoo modules
lack (the image ones are :mod:`~diffusion_debug.testing.zoo_recent`'s): LTX-Video 0.9 text-, image- and
condition-to-video (its causal video VAE, a T5), Wan VACE (its control transformer), ChronoEdit (an
image edited as a short video), SANA-Video and Stable Audio Open.

>>> from diffusion_debug.testing import tiny_pipeline
>>> type(tiny_pipeline("ltx")).__name__
'LTXPipeline'

:data:`ZOO_CALLS` gives, per kind, the keyword arguments of a call (without ``generator``,
``num_inference_steps`` and ``output_type``) and the pipeline inputs a test can make non-finite, as
:data:`~diffusion_debug.testing.zoo_latest.ZOO_CALLS` does. Sizes follow diffusers' fast tests
(``tests/pipelines/ltx``, ``wan``, ``chronoedit``, ``sana_video``, ``stable_audio``).

Limits: random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`); the T5 tokenizer is the
offline unigram one of :mod:`~diffusion_debug.testing.text_encoders`. Wan VACE and ChronoEdit are given
prompt embeddings (diffusers cleans a prompt with ``ftfy`` without asking whether it is installed); Stable
Audio steps the EDM DPM-Solver, not its own ``CosineDPMSolverMultistepScheduler`` (which needs ``torchsde``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .stable_diffusion import Make
from .text_encoders import WORDS, qwen_tokenizer, t5_encoder_config, t5_tokenizer
from .zoo_newer import ZOO_CALLS as ZOO_CALLS_NEWER
from .zoo_newer import build_wan_i2v
from .zoo_recent import frames, image
from .zoo_video_audio import WAN_TRANSFORMER, wan_vae

__all__ = ["BUILDERS", "ZOO_CALLS", "ZOO_KINDS"]

#: The kinds this module builds (``tiny_pipeline(kind)`` accepts them too).
ZOO_KINDS = ("ltx", "ltx_i2v", "ltx_condition", "wan_vace", "chronoedit", "sana_video", "stable_audio")

_LTX = {"prompt": "a cat", "height": 32, "width": 32, "num_frames": 9, "max_sequence_length": 16}

#: Per kind: ``(call kwargs without generator and num_inference_steps, names of tensor inputs a test may poison)``.
ZOO_CALLS: dict[str, tuple[Callable[[], dict[str, Any]], tuple[str, ...]]] = {
    "ltx": (lambda: dict(_LTX), ("latents",)),
    "wan_vace": (
        lambda: {
            # diffusers cleans a prompt with ftfy without asking whether it is installed: embeddings
            "prompt_embeds": torch.linspace(-1.0, 1.0, 16 * 32).reshape(1, 16, 32),
            "negative_prompt_embeds": torch.linspace(1.0, -1.0, 16 * 32).reshape(1, 16, 32),
            "video": frames(5, 16),
            "height": 16,
            "width": 16,
            "num_frames": 5,
            "max_sequence_length": 16,
        },
        ("latents",),
    ),
    "stable_audio": (lambda: {"prompt": "a cat", "guidance_scale": 6.0}, ("latents",)),
    # LTX-Video's image-to-video and its conditioned video (here one image at frame 0): the tiny LTX's components
    "ltx_i2v": (lambda: {**_LTX, "image": image()}, ("image", "latents")),
    "ltx_condition": (lambda: {**_LTX, "image": image()}, ("image",)),
    # Wan image-to-video's call: ChronoEdit edits an image by denoising a short video that starts from it
    "chronoedit": (lambda: {**ZOO_CALLS_NEWER["wan_i2v"][0](), "image": frames(1, 16)[0]}, ("prompt_embeds",)),
    "sana_video": (
        lambda: {
            "prompt": "a cat",
            "negative_prompt": "bad",
            "guidance_scale": 6.0,
            "height": 32,
            "width": 32,
            "frames": 5,
            "max_sequence_length": 16,
            "complex_human_instruction": [],
            "use_resolution_binning": False,
        },
        ("latents",),
    ),
}


def build_ltx(make: Make) -> dict[str, Any]:
    """LTX-Video 0.9 (diffusers' fast test): one transformer block, the causal video VAE of width 8
    (8x spatial, 4x temporal compression... here 4x and 4x), a one-layer T5 of width 32."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel
    from transformers import T5EncoderModel

    tokenizer = t5_tokenizer(WORDS)
    transformer = make(
        "transformer",
        lambda: LTXVideoTransformer3DModel(
            in_channels=8,
            out_channels=8,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=4,
            attention_head_dim=8,
            cross_attention_dim=32,
            num_layers=1,
            caption_channels=32,
        ),
    )

    def vae():
        made = AutoencoderKLLTXVideo(
            in_channels=3,
            out_channels=3,
            latent_channels=8,
            block_out_channels=(8, 8, 8, 8),
            decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1),
            decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, False, False),
            decoder_spatio_temporal_scaling=(True, True, False, False),
            decoder_inject_noise=(False, False, False, False, False),
            upsample_residual=(False, False, False, False),
            upsample_factor=(1, 1, 1, 1),
            timestep_conditioning=False,
            patch_size=1,
            patch_size_t=1,
            encoder_causal=True,
            decoder_causal=False,
        )
        made.use_framewise_encoding = made.use_framewise_decoding = False
        return made

    return {
        "transformer": transformer,
        "vae": make("vae", vae),
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "text_encoder": make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        "tokenizer": tokenizer,
    }


def build_wan_vace(make: Make) -> dict[str, Any]:
    """Wan VACE (diffusers' fast test): a ``WanVACETransformer3DModel`` of 3 blocks with VACE blocks at
    0 and 2, the tiny Wan VAE, a one-layer T5; one expert (no ``transformer_2``)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanVACETransformer3DModel
    from transformers import T5EncoderModel

    tokenizer = t5_tokenizer(WORDS)
    transformer = make(
        "transformer",
        lambda: WanVACETransformer3DModel(
            **{**WAN_TRANSFORMER, "num_layers": 3}, vace_layers=[0, 2], vace_in_channels=96
        ),
    )
    return {
        "transformer": transformer,
        "transformer_2": None,
        "vae": make("vae", wan_vae),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
        "text_encoder": make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        "tokenizer": tokenizer,
    }


def build_stable_audio(make: Make) -> dict[str, Any]:
    """Stable Audio Open (diffusers' fast test): a ``StableAudioDiTModel`` of 2 blocks, the Oobleck
    audio VAE, a one-layer T5 of width 32 and its projection model (text and seconds)."""
    from diffusers import (
        AutoencoderOobleck,
        EDMDPMSolverMultistepScheduler,
        StableAudioDiTModel,
        StableAudioProjectionModel,
    )
    from transformers import T5EncoderModel

    tokenizer = t5_tokenizer(WORDS, model_max_length=25)
    transformer = make(
        "transformer",
        lambda: StableAudioDiTModel(
            sample_size=4,
            in_channels=3,
            num_layers=2,
            attention_head_dim=4,
            num_key_value_attention_heads=2,
            out_channels=3,
            cross_attention_dim=4,
            time_proj_dim=8,
            global_states_input_dim=8,
            cross_attention_input_dim=4,
        ),
    )
    vae = make(
        "vae",
        lambda: AutoencoderOobleck(
            encoder_hidden_size=6,
            downsampling_ratios=[1, 2],
            decoder_channels=3,
            decoder_input_channels=3,
            audio_channels=2,
            channel_multiples=[2, 4],
            sampling_rate=4,
        ),
    )
    return {
        "transformer": transformer,
        # its own CosineDPMSolverMultistepScheduler needs torchsde (not installed here): the EDM DPM-Solver
        "scheduler": EDMDPMSolverMultistepScheduler(solver_order=2, prediction_type="v_prediction", sigma_data=1.0),
        "vae": vae,
        "text_encoder": make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        "tokenizer": tokenizer,
        "projection_model": make(
            "projection_model",
            lambda: StableAudioProjectionModel(text_encoder_dim=32, conditioning_dim=4, min_value=0, max_value=32),
        ),
    }


def build_chronoedit(make: Make) -> dict[str, Any]:
    """ChronoEdit (diffusers' fast test): Wan image-to-video's tiny components, its transformer a
    ``ChronoEditTransformer3DModel`` of the same sizes."""
    from diffusers import ChronoEditTransformer3DModel

    components = build_wan_i2v(make)
    sizes = {**WAN_TRANSFORMER, "in_channels": 36, "image_dim": 4}
    components["transformer"] = make("transformer", lambda: ChronoEditTransformer3DModel(**sizes))
    return components


def build_sana_video(make: Make) -> dict[str, Any]:
    """SANA-Video (diffusers' fast test): a ``SanaVideoTransformer3DModel`` of 2 blocks, the tiny Wan VAE,
    a one-layer Gemma 2 of width 8 over the byte tokenizer, a DPM-Solver++ on flow sigmas."""
    from diffusers import DPMSolverMultistepScheduler, SanaVideoTransformer3DModel
    from transformers import Gemma2Model

    from .text_encoders import gemma2_config

    tokenizer = qwen_tokenizer()  # byte-level BPE, as Gemma's
    text = gemma2_config(tokenizer, head_dim=16, intermediate_size=64, num_hidden_layers=1)
    transformer = make(
        "transformer",
        lambda: SanaVideoTransformer3DModel(
            in_channels=16,
            out_channels=16,
            num_attention_heads=2,
            attention_head_dim=12,
            num_layers=2,
            num_cross_attention_heads=2,
            cross_attention_head_dim=12,
            cross_attention_dim=24,
            caption_channels=8,
            mlp_ratio=2.5,
            dropout=0.0,
            attention_bias=False,
            sample_size=8,
            patch_size=(1, 2, 2),
            norm_elementwise_affine=False,
            norm_eps=1e-6,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        ),
    )
    return {
        "transformer": transformer,
        "vae": make("vae", wan_vae),
        # as the released checkpoints' (diffusers' fast test keeps the epsilon default: its latents diverge)
        "scheduler": DPMSolverMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=8.0
        ),
        "text_encoder": make("text_encoder", lambda: Gemma2Model(text)),
        "tokenizer": tokenizer,
    }


#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[[Make], dict[str, Any]]]] = {
    "ltx": ("LTXPipeline", build_ltx),
    "ltx_i2v": ("LTXImageToVideoPipeline", build_ltx),
    "ltx_condition": ("LTXConditionPipeline", build_ltx),
    "wan_vace": ("WanVACEPipeline", build_wan_vace),
    "chronoedit": ("ChronoEditPipeline", build_chronoedit),
    "sana_video": ("SanaVideoPipeline", build_sana_video),
    "stable_audio": ("StableAudioPipeline", build_stable_audio),
}
