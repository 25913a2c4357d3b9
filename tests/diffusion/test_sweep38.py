"""Session 38's sweep of the stacks users run on a pipeline, more than of families: PEFT LoRAs loaded with
``load_lora_weights`` from adapters saved to a local folder (built with peft, written with
``save_lora_weights``): two adapters mixed by ``set_adapters``, one fused (``fuse_lora``), one fused
then unfused; each watched against an unwatched twin by the one shared check
(``diffusion_helpers.assert_watched_unchanged_and_fault_named``): two calls on one attach and a call
after detach bitwise equal to the twin's, nothing recorded, and an Inf planted in one inner module at
one call named at exactly that component, module and step.

Limits: the clean SD run is told one ``scheduler_config`` (3 steps spaced ``leading`` start at t=667;
``trailing`` makes the random tiny UNet's latents diverge, rightly told too). The fault is planted on an
attention's output projection, not on a query projection: torch's CPU ``scaled_dot_product_attention``
in float16 and bfloat16 returns zeros, not NaN, for a query holding an Inf (float32 returns NaN), so a
query's Inf never reaches the image in half precision and there is nothing to name.
"""

from __future__ import annotations

import pytest
import torch
from diffusion_helpers import assert_watched_unchanged_and_fault_named

from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import HAS_REPEATED_BLOCKS
from diffusion_debug.testing.zoo_latest import ZOO_CALLS

pytest.importorskip("peft")

Z_IMAGE_CALL = ZOO_CALLS["z_image"]
ATTENTION = "down_blocks.1.attentions.0.transformer_blocks.0.attn1"


def generator():
    return torch.Generator().manual_seed(0)


def saved_adapter(folder, seed: int) -> str:
    """A rank-4 LoRA on a tiny SD UNet's attention projections (random A and B: it changes the image),
    written by ``save_lora_weights`` to ``folder``, which is returned."""
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = tiny_pipeline("sd")
    torch.manual_seed(seed)
    targets = ["to_q", "to_k", "to_v", "to_out.0"]
    pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights=False))
    type(pipe).save_lora_weights(str(folder), unet_lora_layers=get_peft_model_state_dict(pipe.unet))
    return str(folder)


def sd_with(adapters, dtype, stack):
    def build():
        pipe = tiny_pipeline("sd", dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        pipe.load_lora_weights(adapters[0], adapter_name="one")
        if stack == "two_adapters":
            pipe.load_lora_weights(adapters[1], adapter_name="two")
            pipe.set_adapters(["one", "two"], [0.5, 0.7])
        elif stack in ("fused", "unfused"):
            pipe.fuse_lora(lora_scale=0.8)
            if stack == "unfused":
                pipe.unfuse_lora()
        return pipe

    return build


def call_sd(pipe):
    return pipe("a cat", num_inference_steps=3, generator=generator(), output_type="pt").images


CASES = {  # case -> (dtype, the module planted in, from its call, the step named: CFG batched, one call a step)
    "two_adapters-fp16": (torch.float16, f"{ATTENTION}.to_out.0.lora_B.two", 2, 2),
    "two_adapters-fp32": (torch.float32, f"{ATTENTION}.to_q.lora_B.two", 1, 1),
    "fused-fp16": (torch.float16, f"{ATTENTION}.to_out.0", 1, 1),
    "unfused-bf16": (torch.bfloat16, f"{ATTENTION}.to_out.0.lora_B.one", 2, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_sd_lora_loaded_from_a_local_folder_is_watched_unchanged_and_its_fault_named(tmp_path, case):
    dtype, module, from_call, step = CASES[case]
    adapters = [saved_adapter(tmp_path / "one", 3), saved_adapter(tmp_path / "two", 4)]
    build = sd_with(adapters, dtype, case.split("-")[0])
    told = ("scheduler_config",)  # 3 steps, timestep_spacing "leading": the first at t=667 of 1000
    assert_watched_unchanged_and_fault_named(tmp_path, build, call_sd, "unet", module, from_call, step, told=told)


def z_image_compiled(dtype):
    def build():
        pipe = tiny_pipeline("z_image", dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        pipe.transformer.compile_repeated_blocks(backend="aot_eager", fullgraph=True)
        return pipe

    return build


def call_z_image(pipe):
    kwargs = Z_IMAGE_CALL[0]()  # guided (a negative prompt), both branches in one transformer call a step
    return pipe(num_inference_steps=3, generator=generator(), output_type="pt", **kwargs).images


@pytest.mark.skipif(not HAS_REPEATED_BLOCKS, reason="this diffusers has no compile_repeated_blocks")
def test_z_image_compiled_regionally_with_fullgraph_in_bf16_gets_no_graph_and_its_fault_named(tmp_path):
    build = z_image_compiled(torch.bfloat16)
    assert_watched_unchanged_and_fault_named(tmp_path, build, call_z_image, "transformer", "layers.0", 2, 2, True)


IP_EMBED = 8  # the image encoder's projection width


def ip_adapter_file(folder, unet) -> str:
    """An IP-Adapter for ``unet`` saved as ``load_ip_adapter`` reads a local ``.bin``: the image projection
    to 4 tokens and a key and value projection per cross-attention (seeded, small)."""
    generator = torch.Generator().manual_seed(0)
    cross = unet.config.cross_attention_dim
    image_proj = {
        "proj.weight": torch.randn(4 * cross, IP_EMBED, generator=generator) * 0.1,
        "proj.bias": torch.zeros(4 * cross),
        "norm.weight": torch.ones(cross),
        "norm.bias": torch.zeros(cross),
    }
    ip_adapter, key = {}, 1
    for name in unet.attn_processors:
        if name.endswith("attn2.processor"):
            hidden = unet.get_submodule(name.removesuffix(".processor")).to_q.out_features
            for which in ("to_k_ip", "to_v_ip"):
                ip_adapter[f"{key}.{which}.weight"] = torch.randn(hidden, cross, generator=generator) * 0.1
            key += 2
    folder.mkdir()
    torch.save({"image_proj": image_proj, "ip_adapter": ip_adapter}, folder / "ip_adapter.bin")
    return str(folder)


def sdxl_with_ip_adapter(folder, dtype):
    def build():
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

        pipe = tiny_pipeline("sdxl", dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        vision = CLIPVisionConfig(
            hidden_size=32,
            image_size=32,
            projection_dim=IP_EMBED,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=1,
            patch_size=8,
        )
        torch.manual_seed(0)
        encoder = CLIPVisionModelWithProjection(vision).to(dtype).eval()
        pipe.register_modules(image_encoder=encoder, feature_extractor=CLIPImageProcessor(crop_size=32, size=32))
        pipe.load_ip_adapter(folder, subfolder="", weight_name="ip_adapter.bin", image_encoder_folder=None)
        pipe.set_ip_adapter_scale(0.6)
        pipe.unet.to(dtype)
        return pipe

    return build


def call_sdxl_ip(pipe):
    from PIL import Image

    pixels = torch.rand(32, 32, 3, generator=torch.Generator().manual_seed(2)) * 255
    image = Image.fromarray(pixels.to(torch.uint8).numpy())
    return pipe("a cat", ip_adapter_image=image, num_inference_steps=3, generator=generator(), output_type="pt").images


def test_sdxl_with_an_ip_adapter_loaded_from_a_local_file_in_fp16_is_watched_unchanged_and_its_fault_named(tmp_path):
    build = sdxl_with_ip_adapter(ip_adapter_file(tmp_path / "ip", tiny_pipeline("sdxl").unet), torch.float16)
    module = "down_blocks.0.attentions.0.transformer_blocks.0.attn2.processor.to_k_ip.0"  # inside its processor
    told = ("scheduler_config",)
    assert_watched_unchanged_and_fault_named(tmp_path, build, call_sdxl_ip, "unet", module, 1, 1, told=told)
