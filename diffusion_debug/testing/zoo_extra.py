"""Tiny, offline pipelines beyond :mod:`~diffusion_debug.testing.zoo_latest` (which is full):
Kandinsky 3 (a T5 text encoder, the ``Kandinsky3UNet`` denoiser with its own residual blocks and
cross-attention, the MoVQ decoder of Kandinsky 2.2), HunyuanVideo 1.5 text-to-video (a Qwen2.5-VL
text model and a ByT5 encoder for quoted glyph text, a ``HunyuanVideo15Transformer3DModel``, guided
through a diffusers guider, not the pipeline's own arithmetic), Latte text-to-video (PixArt-α's T5 and
VAE, a ``LatteTransformer3DModel`` alternating spatial and temporal blocks), a consistency model (a
``UNet2DModel`` in pixel space, the ``CMStochasticIterativeScheduler``: no VAE, no text) and VisualCloze
(Flux's encoders, a Flux transformer given the in-context grid's masked latents: the images are PIL).

>>> from diffusion_debug.testing import tiny_pipeline
>>> type(tiny_pipeline("kandinsky3")).__name__
'Kandinsky3Pipeline'

:data:`ZOO_CALLS` gives, per kind, the keyword arguments of a call (without ``generator``,
``num_inference_steps`` and ``output_type``) and the pipeline inputs a test can make non-finite, as
:data:`~diffusion_debug.testing.zoo_latest.ZOO_CALLS` does. Sizes follow diffusers' fast tests
(``tests/pipelines/kandinsky3``, ``tests/pipelines/hunyuan_video1_5``, ``tests/pipelines/latte``,
``tests/pipelines/consistency_models``, ``tests/pipelines/visualcloze``).

Limits: random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`); the T5 tokenizer is the
offline unigram one of :mod:`~diffusion_debug.testing.text_encoders`. HunyuanVideo 1.5's Qwen
tokenizer is :func:`~.text_encoders.qwen_tokenizer` with a plain chat template (the real one's
system prompt crop of 108 tokens is kept by the pipeline: the prompt's tokens are cut, the padding
read); its ByT5 encoder runs only for text in quotes in the prompt (none in :data:`ZOO_CALLS`: it is
not called); its guidance scale is the guider's, 1.0 here (one transformer call a step).
"""

from __future__ import annotations

from typing import Any, Callable

from .flux import one_block_vae
from .stable_diffusion import Make, vae
from .text_encoders import WORDS, clip_text_config, clip_tokenizer, qwen_tokenizer, t5_encoder_config, t5_tokenizer
from .zoo import tiny_movq

__all__ = ["BUILDERS", "ZOO_CALLS", "ZOO_KINDS"]

#: The kinds this module builds (``tiny_pipeline(kind)`` accepts them too).
ZOO_KINDS = ("kandinsky3", "hunyuan_video15", "latte", "consistency", "visualcloze")

#: Per kind: ``(call kwargs without generator and num_inference_steps, names of tensor inputs a test may poison)``.
ZOO_CALLS: dict[str, tuple[Callable[[], dict[str, Any]], tuple[str, ...]]] = {
    "kandinsky3": (lambda: {"prompt": "a cat", "guidance_scale": 6.0, "height": 16, "width": 16}, ("latents",)),
    "hunyuan_video15": (lambda: {"prompt": "a cat", "height": 16, "width": 16, "num_frames": 9}, ("latents",)),
    "latte": (
        lambda: {"prompt": "a cat", "video_length": 2, "height": 32, "width": 32, "clean_caption": False},
        ("latents",),
    ),
    "consistency": (lambda: {"batch_size": 1}, ("latents",)),
    "visualcloze": (
        lambda: {
            "task_prompt": "a task",
            "content_prompt": "a cat",
            "image": visualcloze_grid(),
            "max_sequence_length": 16,
        },
        (),  # its images are PIL; its `latents` argument is not read (the grid's own latents are noised)
    ),
}


def visualcloze_grid() -> list[list[Any]]:
    """VisualCloze's in-context grid: one example row of two 16x16 images, and the query row whose
    second image (None) is the one generated; seeded random pixels, PIL images as the pipeline takes."""
    import torch
    from PIL import Image

    generator = torch.Generator().manual_seed(1)

    def image():
        return Image.fromarray((torch.rand(16, 16, 3, generator=generator) * 255).to(torch.uint8).numpy())

    return [[image(), image()], [image(), None]]


def build_kandinsky3(make: Make) -> dict[str, Any]:
    """diffusers' fast-test Kandinsky 3: a ``Kandinsky3UNet`` of widths 32 and 64, the tiny MoVQ
    (16x16 images, 4x4 latents) and a one-layer T5 of width 32."""
    from diffusers import DDPMScheduler, Kandinsky3UNet
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
    movq = make("movq", tiny_movq)
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


def build_hunyuan_video15(make: Make) -> dict[str, Any]:
    """diffusers' fast-test HunyuanVideo 1.5: one transformer block and one refiner block, the video
    VAE of widths 16 (4x spatial, 2x temporal compression), a 2-layer Qwen2.5-VL text model of width 16
    and a one-layer ByT5 encoder of width 32."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5EncoderModel

    tokenizer, tokenizer_2 = qwen_tokenizer(), ByT5Tokenizer()
    tokenizer.chat_template = (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    qwen = Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
        rope_theta=1000000.0,
    )
    transformer = make(
        "transformer",
        lambda: HunyuanVideo15Transformer3DModel(
            in_channels=9,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=1,
            num_refiner_layers=1,
            mlp_ratio=2.0,
            patch_size=1,
            patch_size_t=1,
            text_embed_dim=16,
            text_embed_2_dim=32,
            image_embed_dim=12,
            rope_axes_dim=(2, 2, 4),
            target_size=16,
            task_type="t2v",
        ),
    )
    vae = make(
        "vae",
        lambda: AutoencoderKLHunyuanVideo15(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            block_out_channels=(16, 16),
            layers_per_block=1,
            spatial_compression_ratio=4,
            temporal_compression_ratio=2,
            downsample_match_channel=False,
            upsample_match_channel=False,
        ),
    )
    return {
        "transformer": transformer,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=7.0),
        "text_encoder": make("text_encoder", lambda: Qwen2_5_VLTextModel(qwen)),
        "text_encoder_2": make("text_encoder_2", lambda: T5EncoderModel(t5_encoder_config(tokenizer_2))),
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        "guider": ClassifierFreeGuidance(guidance_scale=1.0),
    }


def build_latte(make: Make) -> dict[str, Any]:
    """diffusers' fast-test Latte: one spatial and one temporal block of width 24 for 2 frames, the tiny
    SD VAE (32x32 frames, 8x8 latents) and a one-layer T5 of width 32."""
    from diffusers import DDIMScheduler, LatteTransformer3DModel
    from transformers import T5EncoderModel

    tokenizer = t5_tokenizer(WORDS)
    transformer = make(
        "transformer",
        lambda: LatteTransformer3DModel(
            sample_size=8,
            num_layers=1,
            patch_size=2,
            attention_head_dim=8,
            num_attention_heads=3,
            caption_channels=32,
            in_channels=4,
            cross_attention_dim=24,
            out_channels=8,  # learned sigma, split off by the pipeline
            attention_bias=True,
            activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
            video_length=2,
        ),
    )
    return {
        "transformer": transformer,
        "vae": make("vae", vae),
        "text_encoder": make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        "tokenizer": tokenizer,
        "scheduler": DDIMScheduler(),
    }


def build_consistency(make: Make) -> dict[str, Any]:
    """An unconditional consistency model on 8x8 RGB images: a ``UNet2DModel`` of widths 8 and 16 with
    one attention block each way, ``CMStochasticIterativeScheduler`` with diffusers' test sigmas."""
    from diffusers import CMStochasticIterativeScheduler, UNet2DModel

    unet = make(
        "unet",
        lambda: UNet2DModel(
            sample_size=8,
            in_channels=3,
            out_channels=3,
            layers_per_block=1,
            block_out_channels=(8, 16),
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"),
            norm_num_groups=4,
            attention_head_dim=4,
        ),
    )
    return {"unet": unet, "scheduler": CMStochasticIterativeScheduler(num_train_timesteps=40, sigma_max=80.0)}


def build_visualcloze(make: Make) -> dict[str, Any]:
    """VisualCloze generation at a 16-pixel grid cell: the tiny Flux's encoders and one-block VAE
    (1 latent channel, packed 2x2), its transformer given the latents, the masked grid's latents and
    the mask (12 channels in, 4 out)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    tokenizer_2 = t5_tokenizer(WORDS)
    transformer = make(
        "transformer",
        lambda: FluxTransformer2DModel(
            patch_size=1,
            in_channels=12,
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
    return {
        "scheduler": FlowMatchEulerDiscreteScheduler(),
        "vae": make("vae", one_block_vae),
        "text_encoder": make("text_encoder", lambda: CLIPTextModel(clip_text_config(hidden_act="gelu"))),
        "tokenizer": clip_tokenizer(),
        "text_encoder_2": make("text_encoder_2", lambda: T5EncoderModel(t5_encoder_config(tokenizer_2))),
        "tokenizer_2": tokenizer_2,
        "transformer": transformer,
        "resolution": 16,
    }


#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[[Make], dict[str, Any]]]] = {
    "kandinsky3": ("Kandinsky3Pipeline", build_kandinsky3),
    "hunyuan_video15": ("HunyuanVideo15Pipeline", build_hunyuan_video15),
    "latte": ("LattePipeline", build_latte),
    "consistency": ("ConsistencyModelPipeline", build_consistency),
    "visualcloze": ("VisualClozeGenerationPipeline", build_visualcloze),
}
