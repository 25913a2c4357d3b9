"""Tiny, offline pipelines of the latest families people run: Stable Cascade (its prior, a
``StableCascadeUNet`` over CLIP text, and its decoder, a second ``StableCascadeUNet`` over the
prior's image embeddings, decoded by the Paella VQ-GAN, whose ``encode`` / ``decode`` run children
of its own, no ``encoder`` / ``decoder`` module), SkyReels-V2 diffusion forcing (Wan's design; every
latent frame has its own timestep and is stepped by its own deep copy of the scheduler, never the
pipeline's: the first copy stepped after the denoiser's calls is the step), Kandinsky 5
text-to-video (Qwen2.5-VL and CLIP text encoders, channels-last video latents that the pipeline
updates in place: ``latents[..., :c] = scheduler.step(...)``), CogView4 (a GLM text encoder, its
schedule shifted by the image's sequence length), Sana-Sprint (Sana with the guidance scale
embedded, stepped by ``SCMScheduler`` over angles, not noise levels), Z-Image (a Qwen3 text
encoder; its transformer takes and returns a list of latents, one per image) and Allegro (T5, a VAE
that decodes only in tiles of 24 frames: the call asks for 24).

>>> from diffusion_debug.testing import tiny_pipeline
>>> type(tiny_pipeline("stable_cascade_prior")).__name__
'StableCascadePriorPipeline'

:data:`ZOO_CALLS` gives, per kind, the keyword arguments of a call (without ``generator``,
``num_inference_steps`` and ``output_type``) and the pipeline inputs a test can make non-finite, as
:data:`~diffusion_debug.testing.zoo_newer.ZOO_CALLS` does. Sizes follow diffusers' own fast tests
of each pipeline (``tests/pipelines/<name>``), smaller where that keeps a 2-step call under a second.
Long because it holds eight kinds' tiny configs, each a builder read on its own; a ninth goes in a new module.

Limits: random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`); the tokenizers are the
offline ones of :mod:`~diffusion_debug.testing.text_encoders`. SkyReels-V2 is called with prompt
embeddings: like Wan's, its pipeline cleans a prompt with ``ftfy`` without asking whether it is
installed; the debugger records no step row for it (the steps are its scheduler copies', unwatched:
its denoiser calls are checked as its VAE call begins). Kandinsky 5's Qwen2.5-VL reads
:func:`~.text_encoders.qwen_tokenizer`'s byte ids through a ``Qwen2VLProcessor`` without a video
processor, and its template's crop index assumes the real tokenizer (so the template is cut, with
diffusers' truncation warning). Not here, because a 2-step call at diffusers' fast-test sizes takes
far too long on a CPU: QwenImage Edit and Edit Plus (the image is resized to 1024x1024 for the VAE
and the vision encoder: about 90 s), LTX-Video (about 50 s), HiDream-I1 (every request is scaled to
128x128 latents, 4,096 tokens: about 6 s).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .stable_diffusion import Make
from .text_encoders import WORDS, clip_text_config, clip_tokenizer, qwen_tokenizer, t5_encoder_config, t5_tokenizer
from .zoo_video_audio import WAN_TRANSFORMER, wan_vae

__all__ = ["BUILDERS", "ZOO_CALLS", "ZOO_KINDS"]

#: The kinds this module builds (``tiny_pipeline(kind)`` accepts them too).
ZOO_KINDS = (
    "stable_cascade_prior",
    "stable_cascade",
    "skyreels_v2_df",
    "kandinsky5",
    "cogview4",
    "sana_sprint",
    "z_image",
    "allegro",
)


def _embeds(sign: float) -> torch.Tensor:
    """Prompt embeddings of 16 tokens for the T5 width (32) of the tiny Wan-like transformers."""
    return torch.linspace(-sign, sign, 16 * 32).reshape(1, 16, 32)


#: Per kind: ``(call kwargs without generator and num_inference_steps, names of tensor inputs a test may poison)``.
ZOO_CALLS: dict[str, tuple[Callable[[], dict[str, Any]], tuple[str, ...]]] = {
    "stable_cascade_prior": (
        lambda: {"prompt": "a cat", "negative_prompt": "bad", "guidance_scale": 4.0, "height": 128, "width": 128},
        ("latents",),
    ),
    "stable_cascade": (
        lambda: {
            "image_embeddings": torch.linspace(-1.0, 1.0, 16 * 3 * 3).reshape(1, 16, 3, 3),
            "prompt": "a cat",
            "negative_prompt": "bad",
            "guidance_scale": 4.0,
        },
        ("image_embeddings",),
    ),
    "skyreels_v2_df": (
        lambda: {
            "prompt": None,  # required by its signature
            "prompt_embeds": _embeds(1.0),
            "negative_prompt_embeds": _embeds(-1.0),
            "guidance_scale": 6.0,
            "height": 16,
            "width": 16,
            "num_frames": 9,
            "base_num_frames": 9,
        },
        ("latents", "prompt_embeds"),
    ),
    "kandinsky5": (
        lambda: {
            "prompt": "a cat",
            "negative_prompt": "bad",
            "guidance_scale": 5.0,
            "height": 32,
            "width": 32,
            "num_frames": 5,
            "max_sequence_length": 16,
        },
        ("latents",),
    ),
    "cogview4": (
        lambda: {
            "prompt": "a cat",
            "negative_prompt": "bad",
            "guidance_scale": 6.0,
            "height": 16,
            "width": 16,
            "max_sequence_length": 16,
        },
        ("latents",),
    ),
    "sana_sprint": (
        lambda: {
            "prompt": "a cat",
            "height": 32,
            "width": 32,
            "max_sequence_length": 16,
            "use_resolution_binning": False,
        },
        ("latents",),
    ),
    "z_image": (
        lambda: {
            "prompt": "a cat",
            "negative_prompt": "bad",
            "guidance_scale": 3.0,
            "cfg_normalization": False,
            "cfg_truncation": 1.0,
            "height": 16,
            "width": 16,
            "max_sequence_length": 16,
        },
        ("latents",),
    ),
    "allegro": (
        lambda: {
            "prompt": "a cat",
            "negative_prompt": "",
            "guidance_scale": 6.0,
            "height": 16,
            "width": 16,
            "num_frames": 24,  # its VAE decodes tiles of 24 frames: fewer decode none
            "max_sequence_length": 16,
            "clean_caption": False,
        },
        ("latents",),
    ),
}


def _clip_with_projection(make: Make, name: str):
    from transformers import CLIPTextModelWithProjection

    return make(name, lambda: CLIPTextModelWithProjection(clip_text_config(hidden_act="gelu")))


def build_stable_cascade_prior(make: Make) -> dict[str, Any]:
    from diffusers import DDPMWuerstchenScheduler, StableCascadeUNet

    prior = make(
        "prior",
        lambda: StableCascadeUNet(
            conditioning_dim=32,
            block_out_channels=(32, 32),
            num_attention_heads=(2, 2),
            down_num_layers_per_block=(1, 1),
            up_num_layers_per_block=(1, 1),
            clip_image_in_channels=32,
            switch_level=(False,),
            clip_text_in_channels=32,  # the CLIP's width
            clip_text_pooled_in_channels=32,  # its projection
        ),
    )
    return dict(
        tokenizer=clip_tokenizer(),
        text_encoder=_clip_with_projection(make, "text_encoder"),
        prior=prior,
        scheduler=DDPMWuerstchenScheduler(),
        feature_extractor=None,
        image_encoder=None,
    )


def build_stable_cascade(make: Make) -> dict[str, Any]:
    from diffusers import DDPMWuerstchenScheduler, StableCascadeUNet
    from diffusers.pipelines.stable_cascade.pipeline_stable_cascade import PaellaVQModel  # moves across versions

    decoder = make(
        "decoder",
        lambda: StableCascadeUNet(
            in_channels=4,
            out_channels=4,
            conditioning_dim=32,
            block_out_channels=(16, 32),
            num_attention_heads=(-1, 2),
            down_num_layers_per_block=(1, 1),
            up_num_layers_per_block=(1, 1),
            down_blocks_repeat_mappers=(1, 1),
            up_blocks_repeat_mappers=(2, 2),
            block_types_per_layer=(
                ("SDCascadeResBlock", "SDCascadeTimestepBlock"),
                ("SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"),
            ),
            switch_level=None,
            clip_text_pooled_in_channels=32,
            effnet_in_channels=16,  # the prior's image embeddings
            pixel_mapper_in_channels=3,
            dropout=(0.0, 0.0),
        ),
    )
    vqgan = make(
        "vqgan",
        lambda: PaellaVQModel(levels=2, bottleneck_blocks=1, embed_dim=8, latent_channels=4, num_vq_embeddings=2),
    )
    return dict(
        decoder=decoder,
        tokenizer=clip_tokenizer(),
        text_encoder=_clip_with_projection(make, "text_encoder"),
        scheduler=DDPMWuerstchenScheduler(),
        vqgan=vqgan,
        latent_dim_scale=4.0,
    )


def build_skyreels_v2_df(make: Make) -> dict[str, Any]:
    from diffusers import SkyReelsV2Transformer3DModel, UniPCMultistepScheduler
    from transformers import T5EncoderModel

    tokenizer = t5_tokenizer(WORDS)
    transformer = make(
        "transformer",
        lambda: SkyReelsV2Transformer3DModel(**WAN_TRANSFORMER),
    )
    video_vae = make("vae", wan_vae)
    return dict(
        transformer=transformer,
        vae=video_vae,
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=7.0),
        text_encoder=make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        tokenizer=tokenizer,
    )


def _qwen2vl_processor():
    """A ``Qwen2VLProcessor`` over :func:`~.text_encoders.qwen_tokenizer` (Kandinsky 5 calls it as its
    tokenizer, text alone). Its video processor is left out: without torchvision, transformers 5 cannot
    find the class it checks one against, so the check skips a missing one."""
    import transformers
    from transformers import Qwen2VLProcessor

    class TextProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            return type(None) if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    images = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    return TextProcessor(image_processor=images(), tokenizer=qwen_tokenizer(), video_processor=None)


def build_kandinsky5(make: Make) -> dict[str, Any]:
    from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, Kandinsky5Transformer3DModel
    from transformers import CLIPTextModel, Qwen2_5_VLForConditionalGeneration

    from .qwenimage import qwen25vl_config

    transformer = make(
        "transformer",
        lambda: Kandinsky5Transformer3DModel(
            in_visual_dim=4,
            in_text_dim=16,  # the Qwen2.5-VL's width
            in_text_dim2=32,  # the CLIP's
            time_dim=32,
            out_visual_dim=4,
            patch_size=(1, 2, 2),
            model_dim=48,
            ff_dim=128,
            num_text_blocks=1,
            num_visual_blocks=1,
            axes_dims=(8, 8, 8),
            visual_cond=False,
        ),
    )
    video_vae = make(
        "vae",
        lambda: AutoencoderKLHunyuanVideo(
            in_channels=3,
            out_channels=3,
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
            latent_channels=4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            norm_num_groups=4,
        ),
    )
    return dict(
        transformer=transformer,
        vae=video_vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        # text alone: a vocabulary of the tokenizer's size, not the 152,064 whose logits it would compute
        text_encoder=make("text_encoder", lambda: Qwen2_5_VLForConditionalGeneration(qwen25vl_config(512))),
        tokenizer=_qwen2vl_processor(),
        text_encoder_2=make("text_encoder_2", lambda: CLIPTextModel(clip_text_config(hidden_act="gelu"))),
        tokenizer_2=clip_tokenizer(),
    )


def build_cogview4(make: Make) -> dict[str, Any]:
    from diffusers import CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import GlmConfig, GlmForCausalLM

    from .flux import one_block_vae

    tokenizer = qwen_tokenizer()  # byte-level BPE, as GLM-4's
    glm = GlmConfig(
        hidden_size=32,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=8,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
    )
    transformer = make(
        "transformer",
        lambda: CogView4Transformer2DModel(
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=4,
            num_attention_heads=4,
            out_channels=4,
            text_embed_dim=32,  # the GLM's width
            time_embed_dim=8,
            condition_dim=4,
        ),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
    )
    return dict(
        transformer=transformer,
        vae=make("vae", lambda: one_block_vae(latent_channels=4)),
        scheduler=scheduler,
        text_encoder=make("text_encoder", lambda: GlmForCausalLM(glm)),
        tokenizer=tokenizer,
    )


def build_sana_sprint(make: Make) -> dict[str, Any]:
    from diffusers import SanaTransformer2DModel, SCMScheduler

    from .zoo_more import build_sana

    found = build_sana(make)
    transformer = make(
        "transformer",
        lambda: SanaTransformer2DModel(
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            num_attention_heads=2,
            attention_head_dim=4,
            num_cross_attention_heads=2,
            cross_attention_head_dim=4,
            cross_attention_dim=8,
            caption_channels=8,
            sample_size=32,
            qk_norm="rms_norm_across_heads",
            guidance_embeds=True,  # the distilled guidance scale, an input of the transformer
        ),
    )
    return {**found, "transformer": transformer, "scheduler": SCMScheduler()}


_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen3_chat() -> tuple[Any, Any]:
    """The byte tokenizer with Qwen3's chat turns (a pipeline wraps each prompt in them), and the config of a
    2-layer Qwen3 of width 16 over it (Z-Image's and FLUX.2 [klein]'s text encoder)."""
    from transformers import Qwen3Config

    tokenizer = qwen_tokenizer()
    tokenizer.chat_template = _CHAT_TEMPLATE
    config = Qwen3Config(
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=512,
    )
    return tokenizer, config


def build_z_image(make: Make) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Model

    from .flux import one_block_vae

    tokenizer, qwen3 = qwen3_chat()
    transformer = make(
        "transformer",
        lambda: ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=16,
            dim=32,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            norm_eps=1e-5,
            qk_norm=True,
            cap_feat_dim=16,  # the Qwen3's width
            rope_theta=256.0,
            t_scale=1000.0,
            axes_dims=[8, 4, 4],
            axes_lens=[256, 32, 32],
        ),
    )
    return dict(
        transformer=transformer,
        vae=make("vae", lambda: one_block_vae(latent_channels=16)),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=make("text_encoder", lambda: Qwen3Model(qwen3)),
        tokenizer=tokenizer,
    )


def build_allegro(make: Make) -> dict[str, Any]:
    from diffusers import AllegroTransformer3DModel, AutoencoderKLAllegro, DDIMScheduler
    from transformers import T5EncoderModel

    tokenizer = t5_tokenizer(WORDS)
    transformer = make(
        "transformer",
        lambda: AllegroTransformer3DModel(
            num_attention_heads=2,
            attention_head_dim=12,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            cross_attention_dim=24,
            sample_width=8,
            sample_height=8,
            sample_frames=8,
            caption_channels=32,  # the T5's width
        ),
    )

    def allegro_vae():
        found = AutoencoderKLAllegro(
            in_channels=3,
            out_channels=3,
            down_block_types=("AllegroDownBlock3D",) * 4,
            up_block_types=("AllegroUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=2,
            temporal_compression_ratio=4,
            sample_size=16,  # its decode's tile: 24 frames of 16x16
        )
        found.enable_tiling()  # its decode without tiling is not implemented
        return found

    return dict(
        transformer=transformer,
        vae=make("vae", allegro_vae),
        scheduler=DDIMScheduler(),
        text_encoder=make("text_encoder", lambda: T5EncoderModel(t5_encoder_config(tokenizer))),
        tokenizer=tokenizer,
    )


#: kind -> (diffusers pipeline class name, builder of its components from ``make``).
BUILDERS: dict[str, tuple[str, Callable[[Make], dict[str, Any]]]] = {
    "stable_cascade_prior": ("StableCascadePriorPipeline", build_stable_cascade_prior),
    "stable_cascade": ("StableCascadeDecoderPipeline", build_stable_cascade),
    "skyreels_v2_df": ("SkyReelsV2DiffusionForcingPipeline", build_skyreels_v2_df),
    "kandinsky5": ("Kandinsky5T2VPipeline", build_kandinsky5),
    "cogview4": ("CogView4Pipeline", build_cogview4),
    "sana_sprint": ("SanaSprintPipeline", build_sana_sprint),
    "z_image": ("ZImagePipeline", build_z_image),
    "allegro": ("AllegroPipeline", build_allegro),
}
