"""QwenImage, tiny: the components of a ``QwenImagePipeline`` (sizes as diffusers' own fast test of it)
and the keyword arguments of a call. Its VAE, ``AutoencoderKLQwenImage``, is the Wan 2.1 VAE's
design (as krea2's and nucleusmoe_image's): a video VAE whose decoder is called once per latent
frame with a causal-conv cache (``feat_cache``) that it fills during the call; an image is one frame.

>>> from diffusion_debug.testing import tiny_pipeline
>>> pipe = tiny_pipeline("qwenimage")
>>> type(pipe).__name__, type(pipe.vae).__name__
('QwenImagePipeline', 'AutoencoderKLQwenImage')

Limits: random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`); the text encoder is a
two-layer ``Qwen2_5_VLForConditionalGeneration`` with the real vocabulary size (152,064, as
diffusers' test config has it: its vision token ids lie above 151,000), and its tokenizer
(:func:`~diffusion_debug.testing.text_encoders.qwen_tokenizer`) knows the 256 byte characters and
the chat template's special tokens only, so a prompt is one token per byte.
"""

from __future__ import annotations

from typing import Any, Callable

from .text_encoders import qwen_tokenizer

__all__ = ["BUILDERS", "QWENIMAGE_CALL", "qwen25vl_config", "qwenimage_vae"]

#: ``(call kwargs without generator and num_inference_steps, denoiser attribute)``.
QWENIMAGE_CALL: tuple[Callable[[], dict[str, Any]], str] = (
    lambda: {
        "prompt": "a cat",
        "height": 32,
        "width": 32,
        "true_cfg_scale": 1.0,  # no negative prompt: no true CFG (diffusers warns at its default, 4.0)
        "max_sequence_length": 16,
        "output_type": "pt",
    },
    "transformer",
)


def qwen25vl_config(vocab_size: int = 152064):
    """The tiny ``Qwen2_5_VLConfig`` (hidden size 16, two layers) of diffusers' fast tests, for
    :func:`~diffusion_debug.testing.text_encoders.qwen_tokenizer`'s ids (QwenImage, Kandinsky 5). Its
    vision token ids lie above 151,000: a smaller ``vocab_size`` is for text alone (Kandinsky 5)."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            "rope_theta": 1000000.0,
        },
        vision_config={"depth": 2, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16},
        hidden_size=16,
        vocab_size=vocab_size,
        vision_end_token_id=151653,
        vision_start_token_id=151652,
        vision_token_id=151654,
    )


def qwenimage_vae(z_dim: int = 4):
    """QwenImage's tiny video VAE (diffusers' fast test; NucleusMoE-Image's in the sweeps)."""
    from diffusers import AutoencoderKLQwenImage

    return AutoencoderKLQwenImage(
        base_dim=z_dim * 6,
        z_dim=z_dim,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * z_dim,
        latents_std=[1.0] * z_dim,
    )


def build_qwenimage(make) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    text = qwen25vl_config()
    z_dim = 4
    return dict(
        transformer=make(
            "transformer",
            lambda: QwenImageTransformer2DModel(
                patch_size=2,
                in_channels=16,
                out_channels=4,
                num_layers=2,
                attention_head_dim=16,
                num_attention_heads=3,
                joint_attention_dim=16,
                guidance_embeds=False,
                axes_dims_rope=(8, 4, 4),
            ),
        ),
        vae=make("vae", lambda: qwenimage_vae(z_dim)),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=make("text_encoder", lambda: Qwen2_5_VLForConditionalGeneration(text)),
        tokenizer=qwen_tokenizer(),
    )


#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[..., dict[str, Any]]]] = {"qwenimage": ("QwenImagePipeline", build_qwenimage)}
