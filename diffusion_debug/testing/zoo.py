"""More tiny, offline diffusers pipelines: ControlNet, img2img, inpaint, AnimateDiff, Kandinsky 2.2
prior and decoder, PixArt-α (with a T5 encoder and a T5 tokenizer built offline) and DiT.

>>> from diffusion_debug.testing import tiny_pipeline
>>> type(tiny_pipeline("kandinsky_prior")).__name__
'KandinskyV22PriorPipeline'

:data:`ZOO_CALLS` gives, per kind, the keyword arguments of a 2-step call and the names of the
pipeline inputs a test can make non-finite (``"latents"`` and the like). The SD variants reuse the
components of :mod:`~diffusion_debug.testing.stable_diffusion`; Flux has a module of its own
(:mod:`~diffusion_debug.testing.flux`), Stable Video Diffusion and Dance Diffusion share one
(:mod:`~diffusion_debug.testing.zoo_video_audio`); ``tiny_pipeline`` builds them all.

Limits: random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`); the T5 tokenizer is a
unigram model over a few whole words and single characters (no sentencepiece file, see
:mod:`~diffusion_debug.testing.text_encoders`); image sizes are fixed by :data:`ZOO_CALLS` (other
sizes may not fit the tiny configs).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .stable_diffusion import Make, build_sd, vae
from .text_encoders import WORDS, clip_text_config, clip_tokenizer, t5_encoder_config, t5_tokenizer

__all__ = ["BUILDERS", "ZOO_CALLS", "ZOO_KINDS"]

#: The kinds this module builds (``tiny_pipeline(kind)`` accepts them too).
ZOO_KINDS = (
    "img2img",
    "inpaint",
    "controlnet",
    "animatediff",
    "kandinsky_prior",
    "kandinsky_decoder",
    "pixart",
    "dit",
)


def _image(size: int = 32) -> torch.Tensor:
    """A fixed image in [0, 1] (B, C, H, W) for img2img, inpaint and ControlNet calls."""
    return torch.linspace(0.0, 1.0, 3 * size * size).reshape(1, 3, size, size)


def _embeds(n: int = 1, dim: int = 32) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, n * dim).reshape(n, dim)


#: Per kind: ``(call kwargs without generator, names of tensor inputs a test may poison)``.
ZOO_CALLS: dict[str, tuple[Callable[[], dict[str, Any]], tuple[str, ...]]] = {
    "sd": (lambda: {"prompt": "a cat"}, ("latents", "prompt_embeds")),
    "img2img": (lambda: {"prompt": "a cat", "image": _image(), "strength": 1.0}, ("image", "prompt_embeds")),
    "inpaint": (
        lambda: {"prompt": "a cat", "image": _image(), "mask_image": _image()[:, :1], "strength": 1.0},
        ("image", "latents"),
    ),
    "controlnet": (lambda: {"prompt": "a cat", "image": _image()}, ("image", "latents")),
    "animatediff": (lambda: {"prompt": "a cat", "num_frames": 2, "height": 32, "width": 32}, ("latents",)),
    "kandinsky_prior": (lambda: {"prompt": "a cat"}, ("latents",)),
    "kandinsky_decoder": (
        lambda: {"image_embeds": _embeds(), "negative_image_embeds": -_embeds(), "height": 32, "width": 32},
        ("image_embeds", "latents"),
    ),
    "pixart": (
        lambda: {
            "prompt": "a cat",
            "height": 32,
            "width": 32,
            "use_resolution_binning": False,
            "clean_caption": False,
        },
        ("latents", "prompt_embeds"),
    ),
    "dit": (lambda: {"class_labels": [1]}, ("latents",)),
}


def build_controlnet(make: Make) -> dict[str, Any]:
    from diffusers import ControlNetModel

    controlnet = make(
        "controlnet",
        lambda: ControlNetModel(
            in_channels=4,
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            block_out_channels=(32, 64),
            layers_per_block=1,
            cross_attention_dim=32,
            attention_head_dim=8,
            norm_num_groups=32,
            conditioning_embedding_out_channels=(16, 32, 32),  # / 4, as the tiny VAE
        ),
    )
    return {**build_sd(make), "controlnet": controlnet}


def build_animatediff(make: Make) -> dict[str, Any]:
    from diffusers import MotionAdapter

    adapter = make(
        "motion_adapter",
        lambda: MotionAdapter(
            block_out_channels=(32, 64),
            motion_layers_per_block=1,
            motion_norm_num_groups=2,
            motion_num_attention_heads=4,
            motion_max_seq_length=8,
        ),
    )
    sd = build_sd(make)
    parts = {k: sd[k] for k in ("unet", "vae", "text_encoder", "tokenizer", "scheduler")}
    return {**parts, "motion_adapter": adapter, "feature_extractor": None, "image_encoder": None}


def build_kandinsky_prior(make: Make) -> dict[str, Any]:
    from diffusers import PriorTransformer, UnCLIPScheduler
    from transformers import (
        CLIPImageProcessor,
        CLIPTextModelWithProjection,
        CLIPVisionConfig,
        CLIPVisionModelWithProjection,
    )

    def prior():
        model = PriorTransformer(num_attention_heads=2, attention_head_dim=16, embedding_dim=32, num_layers=1)
        model.clip_std = torch.nn.Parameter(torch.ones(model.clip_std.shape))
        return model

    vision = CLIPVisionConfig(
        hidden_size=32,
        image_size=32,
        projection_dim=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_channels=3,
        num_hidden_layers=1,
        patch_size=8,
    )
    return dict(
        prior=make("prior", prior),
        image_encoder=make("image_encoder", lambda: CLIPVisionModelWithProjection(vision)),
        text_encoder=make("text_encoder", lambda: CLIPTextModelWithProjection(clip_text_config(projection_dim=32))),
        tokenizer=clip_tokenizer(),
        scheduler=UnCLIPScheduler(
            variance_type="fixed_small_log",
            prediction_type="sample",
            num_train_timesteps=1000,
            clip_sample=True,
            clip_sample_range=10.0,
        ),
        image_processor=CLIPImageProcessor(
            crop_size=32,
            do_center_crop=True,
            do_normalize=True,
            do_resize=True,
            image_mean=[0.48145466, 0.4578275, 0.40821073],
            image_std=[0.26862954, 0.26130258, 0.27577711],
            resample=3,
            size=32,
        ),
    )


def tiny_movq():
    """A tiny MoVQ (a ``VQModel`` with spatial norms, sizes as diffusers' tests): Kandinsky 2.2's and 3's VAE."""
    from diffusers import VQModel

    return VQModel(
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
    )


def build_kandinsky_decoder(make: Make) -> dict[str, Any]:
    from diffusers import DDIMScheduler, UNet2DConditionModel

    unet = make(
        "unet",
        lambda: UNet2DConditionModel(
            in_channels=4,
            out_channels=8,  # learned variance, split off by the pipeline
            addition_embed_type="image",
            down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
            up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
            mid_block_type="UNetMidBlock2DSimpleCrossAttn",
            block_out_channels=(32, 64),
            layers_per_block=1,
            encoder_hid_dim=32,
            encoder_hid_dim_type="image_proj",
            cross_attention_dim=32,
            attention_head_dim=4,
            resnet_time_scale_shift="scale_shift",
            class_embed_type=None,
        ),
    )
    movq = make("movq", tiny_movq)
    scheduler = DDIMScheduler(
        num_train_timesteps=1000,
        beta_schedule="linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        set_alpha_to_one=False,
        steps_offset=1,
        prediction_type="epsilon",
    )
    return dict(unet=unet, scheduler=scheduler, movq=movq)


def build_pixart(make: Make) -> dict[str, Any]:
    from diffusers import DPMSolverMultistepScheduler, PixArtTransformer2DModel
    from transformers import T5EncoderModel

    tokenizer = t5_tokenizer(WORDS)
    t5 = t5_encoder_config(tokenizer)
    transformer = make(
        "transformer",
        lambda: PixArtTransformer2DModel(
            sample_size=8,
            num_layers=1,
            patch_size=2,
            attention_head_dim=8,
            num_attention_heads=3,
            caption_channels=32,
            in_channels=4,
            cross_attention_dim=24,
            out_channels=8,
            attention_bias=True,
            activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
        ),
    )
    return dict(
        transformer=transformer,
        vae=make("vae", vae),
        text_encoder=make("text_encoder", lambda: T5EncoderModel(t5)),
        tokenizer=tokenizer,
        scheduler=DPMSolverMultistepScheduler(),
    )


def build_dit(make: Make) -> dict[str, Any]:
    from diffusers import DDIMScheduler, DiTTransformer2DModel

    transformer = make(
        "transformer",
        lambda: DiTTransformer2DModel(
            sample_size=8,
            num_layers=1,
            patch_size=2,
            attention_head_dim=8,
            num_attention_heads=2,
            in_channels=4,
            out_channels=8,  # learned sigma, split off by the pipeline
            norm_num_groups=32,
            num_embeds_ada_norm=1000,  # the pipeline uses label 1000 as the null class
        ),
    )
    return dict(
        transformer=transformer,
        vae=make("vae", vae),
        scheduler=DDIMScheduler(timestep_spacing="trailing"),
        id2label={1: "cat"},
    )


#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[[Make], dict[str, Any]]]] = {
    "img2img": ("StableDiffusionImg2ImgPipeline", build_sd),
    "inpaint": ("StableDiffusionInpaintPipeline", build_sd),
    "controlnet": ("StableDiffusionControlNetPipeline", build_controlnet),
    "animatediff": ("AnimateDiffPipeline", build_animatediff),
    "kandinsky_prior": ("KandinskyV22PriorPipeline", build_kandinsky_prior),
    "kandinsky_decoder": ("KandinskyV22Pipeline", build_kandinsky_decoder),
    "pixart": ("PixArtAlphaPipeline", build_pixart),
    "dit": ("DiTPipeline", build_dit),
}
