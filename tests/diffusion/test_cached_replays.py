"""A cached component's call replayed outside the pipeline's loop: ``compare_pipelines``' replay on
equal inputs and ``replay(bundle, component)`` run in the call's cache context (the pipeline's
``cache_context`` has ended by then: TaylorSeer and FirstBlockCache refused, "No cache context is
set"), each side from its own hooks' state as the call began, and leave the hooks as they were."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger, compare_pipelines
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.faults import plant_nonfinite
from diffusion_debug.testing.features import HAS_CACHE_HOOKS

pytestmark = pytest.mark.skipif(not HAS_CACHE_HOOKS, reason="this diffusers has no caching hooks (diffusers.hooks)")

MODULE = "transformer_blocks.0.attn.to_out.0"
CALL = dict(num_inference_steps=3, output_type="pt", height=16, width=16)


def generator():
    return torch.Generator().manual_seed(0)


def _taylor_seer():
    from diffusers import TaylorSeerCacheConfig

    return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1)


def _first_block_cache():
    from diffusers import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=0.2)


CACHES = pytest.mark.parametrize("cache", [_taylor_seer, _first_block_cache], ids=["taylor_seer", "first_block"])


def cached_flux(cache):
    pipe = tiny_pipeline("flux")  # seeded: every one has the same weights
    pipe.transformer.enable_cache(cache())
    return pipe


def scale(pipe, factor: float):
    """``MODULE``'s weight times ``factor``; returns the undo (a change ``compare_pipelines`` takes)."""
    weight = pipe.transformer.get_submodule(MODULE).weight
    kept = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(factor)

    def undo():
        with torch.no_grad():
            weight.copy_(kept)

    return undo


@CACHES
def test_two_pipelines_under_the_same_cache_are_compared_to_the_changed_module(cache):
    a, b, twin = cached_flux(cache), cached_flux(cache), cached_flux(cache)
    scale(b, 1.5)
    found = compare_pipelines(a, b, seed=0, prompt="a cat", **CALL)
    d = found.first_divergence
    assert (d.component, d.module, d.step, d.made_here, d.cause) == ("transformer", MODULE, 0, True, "")
    assert [m.module for m in found.modules if m.made_here] == [MODULE]
    later = a("a cat", generator=generator(), **CALL).images  # the replays left each cache as its call did
    torch.testing.assert_close(later, twin("a cat", generator=generator(), **CALL).images, rtol=0, atol=0)


@CACHES
def test_a_cached_pipeline_compared_with_itself_changed_finds_the_change_and_is_put_back(cache):
    pipe, twin = cached_flux(cache), cached_flux(cache)
    d = compare_pipelines(pipe, pipe, seed=0, b=lambda p: scale(p, 1.5), prompt="a cat", **CALL).first_divergence
    assert (d.component, d.module, d.step, d.made_here, d.cause) == ("transformer", MODULE, 0, True, "")
    assert compare_pipelines(pipe, twin, seed=0, prompt="a cat", **CALL).first_divergence is None


@CACHES
def test_a_bundle_replayed_on_a_cached_live_component_names_the_producer(cache, tmp_path):
    from diffusion_debug.diffusion import replay

    pipe, twin = cached_flux(cache), cached_flux(cache)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with plant_nonfinite(pipe.transformer.get_submodule(MODULE), from_call=0, value=float("nan")):
        with dbg:
            pipe("a cat", generator=generator(), **CALL)
        (anomaly,) = [a for a in dbg.report().anomalies if a.kind == "nonfinite" and a.severity == "error"]
        assert anomaly.details["bundle"] and (anomaly.module, anomaly.step) == (MODULE, 0)
        found = replay(dbg.report().save() / anomaly.details["bundle"], pipe.transformer)  # the fault still planted
    assert (found["module"], found["output_finite"]) == (MODULE, False)
    later = pipe("a cat", generator=generator(), **CALL).images
    torch.testing.assert_close(later, twin("a cat", generator=generator(), **CALL).images, rtol=0, atol=0)
    dbg.close()
