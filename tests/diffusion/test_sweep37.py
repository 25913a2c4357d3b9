"""Session 37's sweep of the diffusers 0.42 families and stacks not swept before, each built by
:mod:`~diffusion_debug.testing.zoo_no_text_encoder` from tiny configs (sizes after diffusers' own fast
tests; no text encoder: the prompt's features are given), watched against an unwatched twin (the same
seed): two calls on one attach and a call after detach bitwise equal to the twin's three, nothing
recorded, and an Inf planted in one inner module at one call named at exactly that component, module and
step (one shared check, ``diffusion_helpers.assert_watched_unchanged_and_fault_named``). The stacks:
QwenImage 2.1's own prefix KV cache (a ``QwenImage21KVCache`` object passed to each transformer call;
step 0 prefills the text's keys and values, later steps read them) under true CFG, in bf16 (fp16 passes
as well), and with a PEFT LoRA on its attention (the fault in a ``lora_B``); Ovis-Image in bf16, and in
fp16 under TaylorSeer (a step whose attention is predicted, not run); PRX in bf16 (its guidance batched:
one call a step); Motif-Video under its ``AdaptiveProjectedGuidance`` guider; Wan text-to-video under
diffusers' ``SeaCache`` (a threshold that reuses the residual on the middle steps) in bf16, the fault
planted on a block (called, its output the cached residual) and on a module inside it (not called in the
reused steps: its third call is step 3's); a modular QwenImage 2.1 (its text encoder step left out) and
a modular Z-Image (``ZImageAutoBlocks``) with its guider.

Limits: LongCat-Image is not here (diffusers 0.42.1's ``LongCatImagePipeline`` cannot be called with
``prompt_embeds``: ``check_inputs`` refuses a prompt beside them and ``encode_prompt`` takes
``len(prompt)``); nor DreamLite (its tiny ``AutoencoderTiny`` decodes 38% of pixels outside [-1, 1] with
random weights, which the debugger rightly reports as ``vae_saturation``, and a call takes about 15 s on
a loaded CPU); QwenImage 2.1's blocks are not registered for diffusers' block caches
(``FirstBlockCacheConfig`` raises at ``enable_cache``)."""

from __future__ import annotations

import diffusers
import pytest
import torch
from diffusion_helpers import assert_watched_unchanged_and_fault_named

from diffusion_debug.testing.zoo_no_text_encoder import (
    call_modular_qwenimage21,
    call_modular_z_image,
    call_motif,
    call_ovis,
    call_prx,
    call_qwenimage21,
    call_wan,
    modular_qwenimage21,
    modular_z_image,
    motif,
    ovis,
    ovis_taylor_seer,
    prx,
    qwenimage21,
    wan_sea_cache,
)

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
    assert_watched_unchanged_and_fault_named(
        tmp_path, lambda: build(dtype), call, "transformer", module, from_call, step
    )
