"""Tiny, offline pipelines beyond :mod:`~diffusion_debug.testing.zoo_latest` (which is full):
Kandinsky 3 (a T5 text encoder, the ``Kandinsky3UNet`` denoiser with its own residual blocks and
cross-attention, the MoVQ decoder of Kandinsky 2.2).

>>> from diffusion_debug.testing import tiny_pipeline
>>> type(tiny_pipeline("kandinsky3")).__name__
'Kandinsky3Pipeline'

:data:`ZOO_CALLS` gives, per kind, the keyword arguments of a call (without ``generator``,
``num_inference_steps`` and ``output_type``) and the pipeline inputs a test can make non-finite, as
:data:`~diffusion_debug.testing.zoo_latest.ZOO_CALLS` does. Sizes follow diffusers' fast tests
(``tests/pipelines/kandinsky3``).

Limits: random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`); the T5 tokenizer is the
offline unigram one of :mod:`~diffusion_debug.testing.text_encoders`. Not here: HunyuanVideo 1.5
(``HunyuanVideo15Pipeline`` is in diffusers 0.42.1; its Qwen2.5-VL and ByT5 text encoders were not
built in the time this module was written).
"""

from __future__ import annotations

from typing import Any, Callable

from .stable_diffusion import Make
from .text_encoders import WORDS, t5_encoder_config, t5_tokenizer

__all__ = ["BUILDERS", "ZOO_CALLS", "ZOO_KINDS"]

#: The kinds this module builds (``tiny_pipeline(kind)`` accepts them too).
ZOO_KINDS = ("kandinsky3",)

#: Per kind: ``(call kwargs without generator and num_inference_steps, names of tensor inputs a test may poison)``.
ZOO_CALLS: dict[str, tuple[Callable[[], dict[str, Any]], tuple[str, ...]]] = {
    "kandinsky3": (lambda: {"prompt": "a cat", "guidance_scale": 6.0, "height": 16, "width": 16}, ("latents",)),
}


def build_kandinsky3(make: Make) -> dict[str, Any]:
    """diffusers' fast-test Kandinsky 3: a ``Kandinsky3UNet`` of widths 32 and 64, the tiny MoVQ
    (16x16 images, 4x4 latents) and a one-layer T5 of width 32."""
    from diffusers import DDPMScheduler, Kandinsky3UNet, VQModel
    from transformers import T5EncoderModel

    tokenizer = t5_tokenizer(WORDS)
    unet = make(
        "unet",
        lambda: Kandinsky3UNet(
            in_channels=4,
            time_embedding_dim=4,
            groups=2,
            attention_head_dim=4,
            layers_per_block=3,
            block_out_channels=(32, 64),
            cross_attention_dim=4,
            encoder_hid_dim=32,
        ),
    )
    movq = make(
        "movq",
        lambda: VQModel(
            block_out_channels=(32, 64),
            down_block_types=("DownEncoderBlock2D", "AttnDownEncoderBlock2D"),
            in_channels=3,
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=8,
            norm_type="spatial",
            num_vq_embeddings=12,
            out_channels=3,
            up_block_types=("AttnUpDecoderBlock2D", "UpDecoderBlock2D"),
            vq_embed_dim=4,
        ),
    )
    scheduler = DDPMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        steps_offset=1,
        beta_schedule="squaredcos_cap_v2",
        clip_sample=True,
        thresholding=False,
    )
    return {
        "unet": unet,
        "scheduler": scheduler,
        "movq": movq,
        "text_encoder": make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        "tokenizer": tokenizer,
    }


#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[[Make], dict[str, Any]]]] = {
    "kandinsky3": ("Kandinsky3Pipeline", build_kandinsky3),
}
