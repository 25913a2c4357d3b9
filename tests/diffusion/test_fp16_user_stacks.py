"""The stacks users run around an fp16 or bf16 pipeline, on the cheap default read paths (an fp16
DiT read at each repeated block list's last block, a bf16 one at its output only, a NaN/Inf named
by a replay of the kept call with full probes): diffusers' caching hooks, group offloading,
layerwise casting to fp8, LoRA adapters and compiled blocks. Each: a clean call is bitwise the
unwatched one and quiet, so is the call after; a NaN planted in a middle block is named at its
module and step; the watched image is the unwatched one, fault and all (no hook state changed)."""

from __future__ import annotations

import pytest
import torch
from diffusion_helpers import dynamo_counts, inf_weight, warmed

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components import cache_hooks
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.features import (
    HAS_CACHE_HOOKS,
    HAS_GROUP_OFFLOAD,
    HAS_LAYERWISE_CASTING,
    HAS_REPEATED_BLOCKS,
)
from diffusion_debug.testing.flux import FLUX_CALL, deeper

MIDDLE = "transformer_blocks.1.attn.to_out.0"  # the dual-stream list's middle block (of 3)
REPLAYED = {
    torch.float16: "sentinel -> replay with full probes",
    torch.bfloat16: "output check -> replay with full probes",
}


def flux(dtype: torch.dtype):
    """A tiny Flux with 3 dual-stream and 3 single-stream blocks."""
    return deeper(tiny_pipeline("flux", dtype=dtype), num_layers=3, num_single_layers=3)


def run(pipe, steps: int = 4) -> torch.Tensor:
    kwargs = FLUX_CALL[0]()
    return pipe(num_inference_steps=steps, generator=torch.Generator().manual_seed(0), **kwargs).images


def debugger(pipe) -> DiffusionModelDebugger:
    """A debugger of ``pipe`` whose first call (full probes on the text encoders and the VAE) is behind it."""
    return warmed(pipe, run)


def said(dbg, before: int = 0) -> list[tuple]:
    """Every warning, error and ``debugger_error`` since ``before`` but the true scheduler warning."""
    return [
        (a.kind, a.severity, a.component, a.module, a.step, a.details.get("localized_by"))
        for a in dbg.report().anomalies[before:]
        if a.kind == "debugger_error" or (a.severity in ("error", "warning") and a.kind != "scheduler_config")
    ]


def made(dbg, before: int) -> list[tuple]:
    return [f for f in said(dbg, before) if f[0] == "nonfinite" and f[1] == "error"]


def same(seen: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(seen, expected, rtol=0, atol=0, equal_nan=True)


def _pyramid_attention_broadcast(pipe):
    from diffusers import PyramidAttentionBroadcastConfig

    return PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=lambda: pipe.current_timestep,
    )


def _taylor_seer(pipe):
    from diffusers import TaylorSeerCacheConfig

    return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, max_order=1)


def _first_block_cache(pipe):
    from diffusers import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=1e-9)  # every step's first block residual differs: all computed


def _first_block_cache_skipping(pipe):
    from diffusers import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=0.5)  # the tiny Flux's later steps reuse the cached residual


@pytest.mark.skipif(not HAS_CACHE_HOOKS, reason="this diffusers has no caching hooks (diffusers.hooks)")
@pytest.mark.parametrize(
    "cache, step",
    [(_pyramid_attention_broadcast, 2), (_taylor_seer, 2), (_first_block_cache, 1)],
    ids=["pyramid_attention_broadcast", "taylor_seer", "first_block_cache"],
)
@pytest.mark.parametrize("kept", [None, 0], ids=["tensors_kept", "none_kept"])
def test_a_caches_fault_in_a_middle_block_is_named_at_its_module_and_the_step_it_ran(cache, step, kept, monkeypatch):
    """PyramidAttentionBroadcast and TaylorSeer compute block 1's attention at steps 0 and 2 (cached
    or predicted at 1 and 3): the NaN its ``to_out.0`` makes on its second call is step 2's; under
    FirstBlockCache every block runs every step, and it is step 1's. The replay starts from the
    hooks' state as the call began, so it computes what the call computed, and ``to_out.0`` is named.
    (From the state the call left, the replay took the attention from the cache, naming the
    attention module around the producer, or skipped the remaining blocks, naming the last.) So it
    does with none of the cache tensors kept (``KEPT_BYTES`` 0, as on Flux.1-dev's 1.6 GB): those the
    call replaced are ones it computed again, and so does the replay, finding None in their place."""
    if kept is not None:
        monkeypatch.setattr(cache_hooks, "KEPT_BYTES", kept, raising=False)
    pipe = flux(torch.float16)
    pipe.transformer.enable_cache(cache(pipe))
    clean = run(pipe)
    with plant_nonfinite(pipe.transformer.get_submodule(MIDDLE), from_call=1, value=float("nan")):
        expected = run(pipe)
    dbg = debugger(pipe)
    before = len(dbg.report().anomalies)
    with plant_nonfinite(pipe.transformer.get_submodule(MIDDLE), from_call=1, value=float("nan")), dbg:
        seen = run(pipe)
    assert made(dbg, before) == [("nonfinite", "error", "transformer", MIDDLE, step, REPLAYED[torch.float16])]
    same(seen, expected)
    with dbg:
        same(run(pipe), clean)
    dbg.close()


def lora(pipe, seed: int, rank: int = 2) -> dict[str, torch.Tensor]:
    """A LoRA for the transformer's attention projections, in peft's key format, in its dtype."""
    generator = torch.Generator().manual_seed(seed)
    found = {}
    for name, module in pipe.transformer.named_modules():
        if name.endswith(("attn.to_q", "attn.to_k", "attn.to_out.0")):
            shape = (rank, module.in_features), (module.out_features, rank)
            for part, size in zip(("lora_A", "lora_B"), shape):
                found[f"transformer.{name}.{part}.weight"] = (torch.randn(size, generator=generator) * 0.1).to(
                    module.weight.dtype
                )
    return found


def _two_adapters_mixed(pipe):
    one, two = lora(pipe, 0), lora(pipe, 1)
    pipe.load_lora_weights(one, adapter_name="one")
    pipe.load_lora_weights(two, adapter_name="two")
    pipe.set_adapters(["one", "two"], [0.5, 1.0])


def _fused_adapter_group_offloaded(pipe):
    pipe.load_lora_weights(lora(pipe, 0), adapter_name="one")
    pipe.fuse_lora(lora_scale=0.7)
    cpu = torch.device("cpu")
    pipe.transformer.enable_group_offload(cpu, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1)


def _leaf_level_group_offload(pipe):
    cpu = torch.device("cpu")
    pipe.transformer.enable_group_offload(cpu, offload_device=cpu, offload_type="leaf_level")


def _fp8_layerwise_casting(pipe):
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=pipe.transformer.dtype)


def _model_cpu_offload(pipe):
    pipe.enable_model_cpu_offload(device="cpu")  # accelerate's hooks move each component in turn


STACKS = {
    "two_adapters_mixed": _two_adapters_mixed,
    "model_cpu_offload": _model_cpu_offload,
    "fused_adapter_group_offloaded": _fused_adapter_group_offloaded,
    "leaf_level_group_offload": _leaf_level_group_offload,
    "fp8_layerwise_casting": _fp8_layerwise_casting,
}
# what each stack asks of diffusers above the floor: a reason to skip where it lacks it
_STACK_MISSING = {
    "fused_adapter_group_offloaded": None if HAS_GROUP_OFFLOAD else "this diffusers has no group offloading",
    "leaf_level_group_offload": None if HAS_GROUP_OFFLOAD else "this diffusers has no group offloading",
    "fp8_layerwise_casting": None if HAS_LAYERWISE_CASTING else "this diffusers has no layerwise casting",
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize(
    "stack",
    [
        pytest.param(
            name, marks=pytest.mark.skipif(bool(_STACK_MISSING.get(name)), reason=str(_STACK_MISSING.get(name)))
        )
        for name in STACKS
    ],
)
def test_a_stack_changes_no_image_and_a_middle_blocks_fault_is_named_at_its_module_and_step(stack, dtype):
    pytest.importorskip("peft")
    pipe = flux(dtype)
    STACKS[stack](pipe)
    clean = run(pipe, steps=2)
    dbg = debugger(pipe)
    with dbg:
        same(run(pipe, steps=2), clean)
    assert said(dbg) == []
    with plant_nonfinite(pipe.transformer.get_submodule(MIDDLE), from_call=1, value=float("nan")), dbg:
        run(pipe, steps=2)
    assert made(dbg, 0) == [("nonfinite", "error", "transformer", MIDDLE, 1, REPLAYED[dtype])]
    with dbg:
        same(run(pipe, steps=2), clean)
    dbg.close()


@pytest.mark.skipif(not HAS_REPEATED_BLOCKS, reason="this diffusers has no compile_repeated_blocks")
def test_regionally_compiled_fp16_blocks_change_no_image_and_a_middle_blocks_inf_weight_is_named():
    """``compile_repeated_blocks`` compiles each block in place (aot_eager here): no probe inside
    them; the call's output check sees the NaN/Inf, and the eager replay names the module. No graph
    is added by watching, by the fault (a weight is a graph input) or by the replay."""
    pipe = flux(torch.float16)
    pipe.transformer.compile_repeated_blocks(backend="aot_eager")
    clean = run(pipe, steps=2)
    dbg = debugger(pipe)
    counts = dynamo_counts()
    with dbg:
        same(run(pipe, steps=2), clean)
    assert said(dbg) == []
    with inf_weight(pipe.transformer.get_submodule(MIDDLE)), dbg:
        run(pipe, steps=2)
    assert made(dbg, 0) == [
        ("nonfinite", "error", "transformer", MIDDLE, 0, "output check -> replay with full probes")
    ]
    with dbg:
        same(run(pipe, steps=2), clean)
    assert dynamo_counts() == counts
    dbg.close()


def _faster_cache(pipe):
    from diffusers import FasterCacheConfig

    return FasterCacheConfig(  # step 0 computes, 1 and 3 approximate
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(-1, 901),
        current_timestep_callback=lambda: pipe.current_timestep,
        is_guidance_distilled=True,
    )


def _mag_cache(pipe):
    from diffusers import MagCacheConfig

    return MagCacheConfig(mag_ratios=[1.0] * 4, num_inference_steps=4, threshold=0.5)


def _cached_and_model_cpu_offload(cache):
    def stack(pipe):
        pipe.transformer.enable_cache(cache(pipe))
        _model_cpu_offload(pipe)

    return stack


def _cached_and_block_offloaded(cache):
    def stack(pipe):
        pipe.transformer.enable_cache(cache(pipe))
        cpu = torch.device("cpu")
        pipe.transformer.enable_group_offload(
            cpu, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1
        )

    return stack


def _cached_over_a_fused_adapter(cache):
    def stack(pipe):
        pipe.load_lora_weights(lora(pipe, 0), adapter_name="one")
        pipe.fuse_lora(lora_scale=0.7)
        pipe.transformer.enable_cache(cache(pipe))

    return stack


@pytest.mark.skipif(not HAS_CACHE_HOOKS, reason="this diffusers has no caching hooks (diffusers.hooks)")
@pytest.mark.parametrize(
    "dtype, stack, inference",
    [
        (torch.float16, _cached_and_model_cpu_offload(_first_block_cache_skipping), False),
        (torch.bfloat16, _cached_and_model_cpu_offload(_taylor_seer), True),
        (torch.bfloat16, _cached_and_block_offloaded(_mag_cache), False),
        (torch.float16, _cached_over_a_fused_adapter(_faster_cache), True),
    ],
    ids=[
        "fbc_model_offload_fp16",
        "taylor_seer_model_offload_bf16_inference",
        "mag_group_offload_bf16",
        "faster_fused_lora_fp16_inference",
    ],
)
def test_a_cache_with_offloading_or_a_fused_adapter_changes_no_image_and_stays_quiet(
    dtype, stack, inference, tmp_path
):
    """Diffusers' caching hooks on a half-precision transformer with the stacks users put them with (accelerate's
    model offload, block-level group offloading, a fused LoRA), some under ``torch.inference_mode``: a fresh
    debugger's first call (full probes on the encoders and the VAE) and the next are bitwise the unwatched
    call, and nothing is said."""
    pytest.importorskip("peft")
    pipe = flux(dtype)
    stack(pipe)
    around = torch.inference_mode if inference else torch.no_grad
    with around():
        clean = run(pipe)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    try:
        for _ in range(2):
            with dbg, around():
                same(run(pipe), clean)
        assert said(dbg) == []
    finally:
        dbg.close()
