"""Session 37's sweep of the diffusers 0.42 families and stacks not swept before, each built here from
tiny configs (sizes after diffusers' own fast tests; no text encoder: the prompt's features are
given), watched against an unwatched twin (the same seed): two calls on one attach and a call after
detach bitwise equal to the twin's three, nothing recorded, and an Inf planted in one inner module at
one call named at exactly that component, module and step. The stacks: QwenImage 2.1's own prefix KV
cache (a ``QwenImage21KVCache`` object passed to each transformer call; step 0 prefills the text's
keys and values, later steps read them) under true CFG, in bf16 (fp16 passes as well), and with a PEFT
LoRA on its attention (the fault in a ``lora_B``); Ovis-Image in bf16, and in fp16 under TaylorSeer (a
step whose attention is predicted, not run); PRX in bf16 (its guidance batched: one call a step);
Motif-Video under its ``AdaptiveProjectedGuidance`` guider; Wan text-to-video under diffusers'
``SeaCache`` (a threshold that reuses the residual on the middle steps) in bf16, the fault planted on
a block (called, its output the cached residual) and on a module inside it (not called in the reused
steps: its third call is step 3's); a modular QwenImage 2.1 (its text encoder step left out) and a
modular Z-Image (``ZImageAutoBlocks``) with its guider.

Limits: LongCat-Image is not here (diffusers 0.42.1's ``LongCatImagePipeline`` cannot be called with
``prompt_embeds``: ``check_inputs`` refuses a prompt beside them and ``encode_prompt`` takes
``len(prompt)``); nor DreamLite (its tiny ``AutoencoderTiny`` decodes 38% of pixels outside [-1, 1]
with random weights, which the debugger rightly reports as ``vae_saturation``, and a call takes about
15 s on a loaded CPU); QwenImage 2.1's blocks are not registered for diffusers' block caches
(``FirstBlockCacheConfig`` raises at ``enable_cache``)."""

from __future__ import annotations

import diffusers
import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.zoo_video_audio import WAN_TRANSFORMER, wan_vae


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


def tiny_kl(latent_channels, **scaling):
    torch.manual_seed(0)
    size = dict(sample_size=32, block_out_channels=(4,), layers_per_block=1, norm_num_groups=1)
    return diffusers.AutoencoderKL(
        **size, latent_channels=latent_channels, use_quant_conv=False, use_post_quant_conv=False, **scaling
    )


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
    vae = tiny_kl(1, shift_factor=0.0609, scaling_factor=1.5035)
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
    vae = tiny_kl(4, shift_factor=0.0, scaling_factor=1.0)
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
    vae = diffusers.AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
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


CASES = {  # case -> (builder, call, dtype, the component and module planted in, from its call, the step named)
    "qwenimage21_kv_cache-bf16": (
        qwenimage21,
        call_qwenimage21,
        torch.bfloat16,
        "transformer_blocks.1.attn.to_out.0",
        1,  # the negative branch's call in step 0, the one that fills its cache
        0,
    ),
    "qwenimage21_lora-fp32": (
        lambda dtype: qwenimage21(dtype, lora=True),
        call_qwenimage21,
        torch.float32,
        "transformer_blocks.1.attn.to_out.0.lora_B.default",
        2,
        1,
    ),
    "ovis_image-bf16": (ovis, call_ovis, torch.bfloat16, "transformer_blocks.0.attn.to_out.0", 2, 1),
    "prx-bf16": (prx, call_prx, torch.bfloat16, "blocks.0", 2, 2),
    "motif_video_apg-fp32": (motif, call_motif, torch.float32, "transformer_blocks.0", 2, 1),
    "ovis_image_taylor_seer-fp16": (
        ovis_taylor_seer,
        call_ovis,
        torch.float16,
        "transformer_blocks.0.attn.to_out.0",
        2,  # its calls: twice in step 0, none in step 1, twice in step 2
        2,
    ),
    "wan_sea_cache-bf16": (wan_sea_cache, call_wan, torch.bfloat16, "blocks.1", 2, 1),  # step 1 reuses
    "wan_sea_cache_inner-bf16": (
        wan_sea_cache,
        call_wan,
        torch.bfloat16,
        "blocks.1.ffn.net.2",
        2,  # its calls: twice in step 0, none in steps 1 and 2 (the residual reused), twice in step 3
        3,
    ),
    "modular_qwenimage21-fp32": (
        modular_qwenimage21,
        call_modular_qwenimage21,
        torch.float32,
        "transformer_blocks.1.attn.to_out.0",
        1,
        1,
    ),
    "modular_z_image-fp32": (
        modular_z_image,
        call_modular_z_image,
        torch.float32,
        "layers.0.attention.to_out.0",
        2,
        2,
    ),
}
NEEDS = {
    "qwenimage21": "QwenImage21Pipeline",
    "modular_qwenimage21": "QwenImage21AutoBlocks",
    "ovis_image_taylor_seer": "TaylorSeerCacheConfig",
    "ovis_image": "OvisImagePipeline",
    "prx": "PRXPipeline",
    "motif_video": "MotifVideoPipeline",
    "wan_sea_cache": "SeaCacheConfig",
    "modular_z_image": "ZImageAutoBlocks",
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_swept_family_is_watched_unchanged_and_its_planted_inf_named_at_its_origin(tmp_path, case):
    needs = NEEDS[max((k for k in NEEDS if case.startswith(k)), key=len)]
    if not hasattr(diffusers, needs):
        pytest.skip(f"this diffusers has no {needs}")
    if "lora" in case:
        pytest.importorskip("peft")
    build, call, dtype, module, from_call, step = CASES[case]
    twin, pipe = build(dtype), build(dtype)
    expected = [call(twin), call(twin), call(twin)]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "clean"), log_level="error"))
    with dbg:
        seen = [call(pipe), call(pipe)]
    seen.append(call(pipe))  # detached
    for image, twins in zip(seen, expected):
        torch.testing.assert_close(image, twins, rtol=0, atol=0)
    assert dbg.report().anomalies == []
    dbg.close()

    pipe = build(dtype)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "fault"), log_level="error"))
    with plant_nonfinite(pipe.transformer.get_submodule(module), from_call=from_call), dbg:
        call(pipe)
    errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert [(a.kind, a.component, a.module, a.step) for a in errors] == [("nonfinite", "transformer", module, step)]
    dbg.close()
