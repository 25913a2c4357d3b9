"""The stacks users run around an fp16 or bf16 pipeline, on the cheap default read paths (an fp16
DiT read at each repeated block list's last block, a bf16 one at its output only, a NaN/Inf named
by a replay of the kept call with full probes): diffusers' caching hooks, group offloading,
layerwise casting to fp8, LoRA adapters and compiled blocks. Each: a clean call is bitwise the
unwatched one and quiet, so is the call after; a NaN planted in a middle block is named at its
module and step; the watched image is the unwatched one, fault and all (no hook state changed)."""

from __future__ import annotations

import tempfile

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.features import HAS_CACHE_HOOKS
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
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tempfile.mkdtemp(), log_level="error"))
    with dbg:
        run(pipe)
    return dbg


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


@pytest.mark.skipif(not HAS_CACHE_HOOKS, reason="this diffusers has no caching hooks (diffusers.hooks)")
@pytest.mark.parametrize(
    "cache", [_pyramid_attention_broadcast, _taylor_seer], ids=["pyramid_attention_broadcast", "taylor_seer"]
)
def test_a_cache_that_skips_a_middle_blocks_attention_has_its_fault_named_at_the_module_and_step_it_ran(cache):
    """The cache computes block 1's attention at steps 0 and 2 (cached or predicted at 1 and 3): the
    NaN its ``to_out.0`` makes on its second call is step 2's. The replay starts from the hooks'
    state as step 2's call began: the attention is computed again, and ``to_out.0`` named (a replay
    from the state the call left reused the cache, and named the attention module around it)."""
    pipe = flux(torch.float16)
    pipe.transformer.enable_cache(cache(pipe))
    clean = run(pipe)
    with plant_nonfinite(pipe.transformer.get_submodule(MIDDLE), from_call=1, value=float("nan")):
        expected = run(pipe)
    dbg = debugger(pipe)
    before = len(dbg.report().anomalies)
    with plant_nonfinite(pipe.transformer.get_submodule(MIDDLE), from_call=1, value=float("nan")), dbg:
        seen = run(pipe)
    assert made(dbg, before) == [("nonfinite", "error", "transformer", MIDDLE, 2, REPLAYED[torch.float16])]
    same(seen, expected)
    with dbg:
        same(run(pipe), clean)
    dbg.close()
