"""Flux, tiny: the components of a ``FluxPipeline`` (FLUX.1-dev style, guidance as an input of the
transformer) with a CLIP and a T5 text encoder, and the keyword arguments of a call.

Flux packs its latents into tokens, (batch, sequence, channels), where the SD family keeps
(batch, channels, height, width). Built through :func:`~diffusion_debug.testing.tiny_pipeline`:

>>> from diffusion_debug.testing import tiny_pipeline
>>> pipe = tiny_pipeline("flux")
>>> type(pipe).__name__, pipe.transformer.config.in_channels  # 1 latent channel, packed 2x2
('FluxPipeline', 4)

Limits: random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`); its CLIP tokenizer is
the tiny byte-level BPE one and its T5 tokenizer the in-memory unigram one of
:mod:`~diffusion_debug.testing.text_encoders`; images are multiples of 2 pixels (the VAE does not
downscale), 16x16 in :data:`FLUX_CALL`.
"""

from __future__ import annotations

from typing import Any, Callable

from .text_encoders import WORDS, clip_text_config, clip_tokenizer, t5_encoder_config, t5_tokenizer

__all__ = ["BUILDERS", "FLUX_CALL", "deeper", "one_block_vae"]

#: ``(call kwargs without generator and num_inference_steps, denoiser attribute)``.
FLUX_CALL: tuple[Callable[[], dict[str, Any]], str] = (
    lambda: {
        "prompt": "a cat",
        "height": 16,
        "width": 16,
        "guidance_scale": 3.5,
        "max_sequence_length": 16,
        "output_type": "pt",
    },
    "transformer",
)


def deeper(pipe: Any, seed: int = 0, **layers: int) -> Any:
    """``pipe`` with its ``transformer`` made again from its config with ``layers`` changed (a Flux's
    ``num_layers=3, num_single_layers=3``, a PixArt's ``num_layers=3``): a transformer denoiser whose
    block lists hold more than one block, in the old one's dtype and device, weights from ``seed``.
    The global torch RNG state is left as it was."""
    import torch

    old = pipe.transformer
    parameter = next(old.parameters())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        new = type(old).from_config({**old.config, **layers})
    pipe.transformer = new.to(device=parameter.device, dtype=parameter.dtype).eval()
    return pipe


def one_block_vae(latent_channels: int = 1, shift_factor: float = 0.0609, scaling_factor: float = 1.5035):
    """The tiny Flux ``AutoencoderKL``: one block (no downsampling), no quant convs, Flux's shift and
    scale by default; Lumina 2 has it with 4 latent channels, PRX with 4 and no shift or scale."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4,),
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=shift_factor,
        scaling_factor=scaling_factor,
    )


def build_flux(make) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    t5_tok = t5_tokenizer(WORDS)
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
    vae = make("vae", one_block_vae)
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=make("text_encoder", lambda: CLIPTextModel(clip_text_config(hidden_act="gelu"))),
        text_encoder_2=make("text_encoder_2", lambda: T5EncoderModel(t5)),
        tokenizer=clip_tokenizer(),
        tokenizer_2=t5_tok,
        transformer=transformer,
        vae=vae,
        image_encoder=None,
        feature_extractor=None,
    )


#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[..., dict[str, Any]]]] = {"flux": ("FluxPipeline", build_flux)}
