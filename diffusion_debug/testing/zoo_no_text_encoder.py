"""Tiny, offline pipelines of diffusers 0.42's newest families built without a text encoder (the
prompt's features are given, seeded), as ``build(dtype) -> pipeline`` and ``call_x(pipeline) -> images``
pairs for the sweeps (``tests/diffusion/test_sweep37.py``, ``test_newest_families.py``, ``test_sweep38.py``):
QwenImage 2.1 (its prefix KV cache; optionally a PEFT LoRA on its attention), Ovis-Image (optionally under
TaylorSeer), PRX, Motif-Video (under ``AdaptiveProjectedGuidance``), Wan text-to-video under ``SeaCache``,
modular QwenImage 2.1 and Z-Image, Ideogram 4 (its ``unconditional_transformer``) and NucleusMoE-Image
(under ``TextKVCache``). Sizes follow diffusers' own fast tests; every call takes 3 steps (Wan's 4), seed 0.

Limits: each builder needs its family in the installed diffusers (the tests skip where it is missing);
random tiny weights (see :mod:`~diffusion_debug.testing.pipelines`); these are not ``tiny_pipeline`` kinds.
"""

from __future__ import annotations

import types

import diffusers
import torch

from .flux import one_block_vae
from .pipelines import tiny_pipeline
from .qwenimage import qwenimage_vae
from .zoo_recent import tiny_flux2_vae
from .zoo_video_audio import WAN_TRANSFORMER, wan_vae


def generator():
    return torch.Generator().manual_seed(0)


def features(count, tokens, width, dtype):
    return torch.randn(count, tokens, width, generator=torch.Generator().manual_seed(1)).to(dtype)


def quiet(pipe):
    pipe.set_progress_bar_config(disable=True)
    return pipe


class Processor:
    """Stands in for Qwen-VL's processor, which QwenImage 2.1's ``__init__`` asks for its system
    prompt's length and its image pad token; the calls give the prompt's features."""

    class tokenizer:  # noqa: N801 (the processor's attribute)
        @staticmethod
        def encode(text):
            return [7]

    def apply_chat_template(self, *args, **kwargs):
        return [[1, 2, 3]]


def qwenimage21(dtype, lora=False):
    torch.manual_seed(0)
    size = dict(in_channels=4, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2)
    transformer = diffusers.QwenImage21Transformer2DModel(**size, context_in_dim=16, axes_dims_rope=(4, 6, 6))
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLQwenImage21(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=4,
        dim_mult=[1, 1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False] * 4,
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
        in_channels=3,
        out_channels=3,
    )
    pipe = diffusers.QwenImage21Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
        vae=vae.to(dtype).eval(),
        text_encoder=None,
        processor=Processor(),
        transformer=transformer.to(dtype).eval(),
    )
    if lora:
        from peft import LoraConfig

        torch.manual_seed(3)  # random A and B: the adapter changes the image
        targets = ["to_q", "to_k", "to_v", "to_out.0"]
        pipe.transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights=False))
    return quiet(pipe)


def call_qwenimage21(pipe):
    embeds, mask = features(2, 5, 16, pipe.transformer.dtype), torch.ones(1, 5, dtype=torch.long)
    kwargs = dict(prompt_embeds_mask=mask, negative_prompt_embeds_mask=mask, true_cfg_scale=4.0, height=32, width=32)
    return pipe(
        prompt_embeds=embeds[:1],
        negative_prompt_embeds=embeds[1:],
        num_inference_steps=3,
        output_type="pt",
        generator=generator(),
        **kwargs,
    ).images


def ovis(dtype):
    torch.manual_seed(0)
    transformer = diffusers.OvisImageTransformer2DModel(
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 4, 8),
    )
    torch.manual_seed(0)
    vae = one_block_vae(1)
    return quiet(
        diffusers.OvisImagePipeline(
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
            vae=vae.to(dtype).eval(),
            text_encoder=None,
            tokenizer=None,
            transformer=transformer.to(dtype).eval(),
        )
    )


def call_ovis(pipe):
    embeds = features(2, 6, 32, pipe.transformer.dtype)
    return pipe(
        negative_prompt=None,  # else its default "" beside negative_prompt_embeds is refused
        prompt_embeds=embeds[:1],
        negative_prompt_embeds=embeds[1:],
        guidance_scale=5.0,
        height=16,
        width=16,
        num_inference_steps=3,
        output_type="pt",
        generator=generator(),
    ).images


def prx(dtype):
    torch.manual_seed(0)
    transformer = diffusers.PRXTransformer2DModel(
        patch_size=1,
        in_channels=4,
        context_in_dim=8,
        hidden_size=8,
        mlp_ratio=2.0,
        num_heads=2,
        depth=1,
        axes_dim=[2, 2],
    )
    torch.manual_seed(0)
    vae = one_block_vae(4, shift_factor=0.0, scaling_factor=1.0)
    return quiet(
        diffusers.PRXPipeline(
            transformer=transformer.to(dtype).eval(),
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
            text_encoder=None,
            tokenizer=None,
            vae=vae.to(dtype).eval(),
        )
    )


def call_prx(pipe):
    embeds, mask = features(2, 6, 8, pipe.transformer.dtype), torch.ones(1, 6, dtype=torch.bool)
    kwargs = dict(prompt_attention_mask=mask, negative_prompt_attention_mask=mask, use_resolution_binning=False)
    return pipe(
        prompt_embeds=embeds[:1],
        negative_prompt_embeds=embeds[1:],
        guidance_scale=4.0,
        height=32,
        width=32,
        num_inference_steps=3,
        output_type="pt",
        generator=generator(),
        **kwargs,
    ).images


def motif(dtype):
    torch.manual_seed(0)
    vae = wan_vae()
    torch.manual_seed(0)
    transformer = diffusers.MotifVideoTransformer3DModel(
        in_channels=33,
        out_channels=16,
        num_attention_heads=2,
        attention_head_dim=12,
        num_layers=1,
        num_single_layers=1,
        mlp_ratio=4.0,
        patch_size=1,
        patch_size_t=1,
        qk_norm="rms_norm",
        text_embed_dim=32,
        rope_axes_dim=(4, 4, 4),
    )
    return quiet(
        diffusers.MotifVideoPipeline(
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
            vae=vae.to(dtype).eval(),
            text_encoder=None,
            tokenizer=None,
            transformer=transformer.to(dtype).eval(),
            guider=diffusers.AdaptiveProjectedGuidance(),
            feature_extractor=None,
        )
    )


def call_motif(pipe):
    embeds, mask = features(2, 6, 32, pipe.transformer.dtype), torch.ones(1, 6, dtype=torch.long)
    kwargs = dict(prompt_attention_mask=mask, negative_prompt_attention_mask=mask, num_frames=9)
    return pipe(
        prompt_embeds=embeds[:1],
        negative_prompt_embeds=embeds[1:],
        height=16,
        width=16,
        num_inference_steps=3,
        output_type="pt",
        generator=generator(),
        **kwargs,
    ).frames


def ovis_taylor_seer(dtype):
    pipe = ovis(dtype)
    config = diffusers.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, max_order=1)
    pipe.transformer.enable_cache(config)  # step 1 predicted: no attention module runs in it
    return pipe


def wan_sea_cache(dtype):
    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(**WAN_TRANSFORMER).to(dtype).eval()
    torch.manual_seed(0)
    pipe = diffusers.WanPipeline(
        transformer=transformer,
        vae=wan_vae().to(dtype).eval(),
        text_encoder=None,
        tokenizer=None,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
    pipe.transformer.enable_cache(diffusers.SeaCacheConfig(threshold=10.0))  # the middle steps reuse
    return quiet(pipe)


def call_wan(pipe):
    embeds = features(2, 8, 32, pipe.transformer.dtype)
    return pipe(
        prompt=None,
        prompt_embeds=embeds[:1],
        negative_prompt_embeds=embeds[1:],
        guidance_scale=5.0,
        height=16,
        width=16,
        num_frames=5,
        num_inference_steps=4,
        output_type="pt",
        generator=generator(),
    ).frames


def modular_qwenimage21(dtype):
    from diffusers.modular_pipelines.qwenimage21 import QwenImage21AutoBlocks

    blocks = QwenImage21AutoBlocks()
    blocks.sub_blocks.pop("text_encoder")  # the prompt's features are given
    pipe = blocks.init_pipeline()
    parts = qwenimage21(dtype).components
    pipe.update_components(**{name: parts[name] for name in ("transformer", "vae", "scheduler")})
    return pipe


def call_modular_qwenimage21(pipe):
    embeds, mask = features(2, 5, 16, pipe.transformer.dtype), torch.ones(1, 5, dtype=torch.long)
    no_image = torch.zeros(1, 5, dtype=torch.bool)
    return pipe(
        prompt_embeds=embeds[:1],
        prompt_embeds_mask=mask,
        image_pad_mask=no_image,
        negative_prompt_embeds=embeds[1:],
        negative_prompt_embeds_mask=mask,
        negative_image_pad_mask=no_image,
        num_inference_steps=3,
        height=32,
        width=32,
        generator=generator(),
        output_type="pt",
    ).values["images"]


def modular_z_image(dtype):
    from diffusers.modular_pipelines.z_image import ZImageAutoBlocks

    pipe = ZImageAutoBlocks().init_pipeline()
    pipe.update_components(**{k: v for k, v in tiny_pipeline("z_image", dtype=dtype).components.items() if v})
    return pipe


def call_modular_z_image(pipe):
    out = pipe(prompt="a cat", num_inference_steps=3, height=32, width=32, generator=generator(), output_type="pt")
    return out.values["images"]


def ideogram4(dtype):
    features = torch.randn(1, 4, 8, generator=torch.Generator().manual_seed(1))  # 4 tokens of width 8

    def encode_prompt(self, prompt, grid_h, grid_w, max_sequence_length, device):
        text = torch.zeros(1, max_sequence_length, 8)  # left-padded, as the pipeline's own
        text[:, max_sequence_length - features.shape[1] :] = features
        ids = self._prepare_ids([features.shape[1]], grid_h, grid_w, max_sequence_length, device)
        return (torch.cat([text, torch.zeros(1, grid_h * grid_w, 8)], dim=1), *ids)

    torch.manual_seed(0)
    size = dict(in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2, intermediate_size=32)
    size.update(adaln_dim=16, llm_features_dim=8, mrope_section=(4, 2, 2))
    pipe = diffusers.Ideogram4Pipeline(
        transformer=diffusers.Ideogram4Transformer2DModel(**size).to(dtype).eval(),
        unconditional_transformer=diffusers.Ideogram4Transformer2DModel(**size).to(dtype).eval(),
        vae=tiny_flux2_vae().to(dtype).eval(),
        text_encoder=None,
        tokenizer=None,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
    )
    pipe.encode_prompt = types.MethodType(encode_prompt, pipe)  # its Qwen3-VL taps 36 layers: features given
    return quiet(pipe)


def call_ideogram4(pipe):
    kwargs = dict(height=16, width=16, max_sequence_length=6, guidance_schedule=[4.0, 3.0, 2.0])
    return pipe("a cat", num_inference_steps=3, output_type="pt", generator=generator(), **kwargs).images


def nucleus_moe(dtype):
    torch.manual_seed(0)
    transformer = diffusers.NucleusMoEImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=5,  # the first three and the last dense, one block of experts
        attention_head_dim=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        joint_attention_dim=16,
        axes_dims_rope=(2, 2, 4),
        mlp_ratio=2.0,
        num_experts=4,
        moe_intermediate_dim=16,
        capacity_factors=1.0,
    )
    for name, parameter in transformer.named_parameters():  # made with torch.empty, left uninitialised
        if ".experts." in name:
            parameter.data.copy_(torch.randn(parameter.shape) * 0.1)
    vae = qwenimage_vae(4)
    pipe = diffusers.NucleusMoEImagePipeline(
        transformer=transformer.to(dtype).eval(),
        vae=vae.to(dtype).eval(),
        text_encoder=None,
        processor=None,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
    )
    pipe.transformer.enable_cache(diffusers.TextKVCacheConfig())
    return quiet(pipe)


def call_nucleus_moe(pipe):
    embeds = features(2, 5, 16, pipe.transformer.dtype)
    mask = torch.ones(1, 5, dtype=torch.long)
    kwargs = dict(prompt_embeds_mask=mask, negative_prompt_embeds_mask=mask, height=32, width=32, guidance_scale=4.0)
    return pipe(
        prompt_embeds=embeds[:1],
        negative_prompt_embeds=embeds[1:],
        num_inference_steps=3,
        output_type="pt",
        generator=generator(),
        **kwargs,
    ).images
