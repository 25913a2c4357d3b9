"""Two shapes of diffusers 0.42's newest families, built by
:mod:`~diffusion_debug.testing.zoo_no_text_encoder` from tiny configs (no text encoder: the prompt's
features are given), each watched against a twin making the same calls unwatched (two on one attach
and one after detach: bitwise equal, nothing reported) and with an Inf planted in a denoiser, named at
its module and step: Ideogram 4, which guides with a second denoiser of its own name
(``unconditional_transformer``, called after ``transformer`` in every step, on the image tokens alone),
and NucleusMoE-Image under diffusers' ``TextKVCache``, a stateful hook that keys its cached text
projections by the prompt embedding's ``data_ptr()`` (a replay given other tensors would miss it, or
grow it)."""

from __future__ import annotations

import diffusers
import pytest
import torch
from diffusion_helpers import assert_watched_unchanged_and_fault_named

from diffusion_debug.testing.zoo_no_text_encoder import call_ideogram4, call_nucleus_moe, ideogram4, nucleus_moe

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
    assert_watched_unchanged_and_fault_named(tmp_path, lambda: build(dtype), call, component, module, from_call, step)
