"""Two shapes of diffusers 0.42's newest families, built here from tiny configs (no text encoder:
the prompt's features are given), each watched against a twin making the same two calls unwatched
(bitwise equal, nothing reported) and with an Inf planted in a denoiser, named at its module and
step: Ideogram 4, which guides with a second denoiser of its own name (``unconditional_transformer``,
called after ``transformer`` in every step, on the image tokens alone), and NucleusMoE-Image under
diffusers' ``TextKVCache``, a stateful hook that keys its cached text projections by the prompt
embedding's ``data_ptr()`` (a replay given other tensors would miss it, or grow it)."""

from __future__ import annotations

import types

import diffusers
import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite
from diffusion_debug.testing.zoo_recent import tiny_flux2_vae


def generator():
    return torch.Generator().manual_seed(0)


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
    pipe.set_progress_bar_config(disable=True)
    return pipe


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
    vae = diffusers.AutoencoderKLQwenImage(
        base_dim=24,
        z_dim=4,
        dim_mult=[1, 2, 4],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    )
    pipe = diffusers.NucleusMoEImagePipeline(
        transformer=transformer.to(dtype).eval(),
        vae=vae.to(dtype).eval(),
        text_encoder=None,
        processor=None,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
    )
    pipe.transformer.enable_cache(diffusers.TextKVCacheConfig())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_nucleus_moe(pipe):
    embeds = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1)).to(pipe.transformer.dtype)
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


CASES = {  # family -> (builder, call, the denoiser and module to plant in, from its call, the step named)
    "ideogram4_unconditional": (ideogram4, call_ideogram4, "unconditional_transformer", "layers.1", 2, 2),
    "nucleus_moe_text_kv_cache": (
        nucleus_moe,
        call_nucleus_moe,
        "transformer",
        "transformer_blocks.3.attn.to_out.0",
        2,
        1,
    ),
}
NEEDS = {"ideogram4_unconditional": "Ideogram4Pipeline", "nucleus_moe_text_kv_cache": "TextKVCacheConfig"}


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("ideogram4_unconditional", torch.float16), ("nucleus_moe_text_kv_cache", torch.float32)],  # (both pass in both)
    ids=["ideogram4_unconditional-fp16", "nucleus_moe_text_kv_cache-fp32"],
)
def test_a_newest_family_is_watched_unchanged_over_two_calls_and_its_fault_named(tmp_path, family, dtype):
    if not hasattr(diffusers, NEEDS[family]):
        pytest.skip(f"this diffusers has no {NEEDS[family]}")
    build, call, component, module, from_call, step = CASES[family]
    twin, pipe = build(dtype), build(dtype)
    expected = [call(twin), call(twin)]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "clean"), log_level="error"))
    with dbg:
        seen = [call(pipe), call(pipe)]
    for image, twins in zip(seen, expected):
        torch.testing.assert_close(image, twins, rtol=0, atol=0)
    assert dbg.report().anomalies == []
    dbg.close()

    pipe = build(dtype)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "fault"), log_level="error"))
    with plant_nonfinite(getattr(pipe, component).get_submodule(module), from_call=from_call), dbg:
        call(pipe)
    errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert [(a.kind, a.component, a.module, a.step) for a in errors] == [("nonfinite", component, module, step)]
    dbg.close()
