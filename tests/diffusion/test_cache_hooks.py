"""diffusers' stateful caching hooks: the localising replay runs in the watched call's cache
context and leaves every hook's state as it was, so neither the watched image nor a later call
changes (compared with a twin pipeline making the same calls without the debugger)."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components.cache_hooks import cache_context, hook_state_kept, stateful_hooks
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.faults import plant_nonfinite, plant_overflow
from diffusion_debug.testing.features import HAS_CACHE_HOOKS

pytestmark = pytest.mark.skipif(not HAS_CACHE_HOOKS, reason="this diffusers has no caching hooks (diffusers.hooks)")


def generator():
    return torch.Generator().manual_seed(0)


def test_first_block_cache_replay_runs_in_the_pipelines_cache_context_and_names_the_module(tmp_path):
    from diffusers import FirstBlockCacheConfig

    pipe = tiny_pipeline("flux")
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    assert stateful_hooks(pipe.transformer)
    target = "transformer_blocks.0.ff.net.2"  # inside the first block, which the cache always runs
    kwargs = dict(num_inference_steps=3, output_type="pt", height=32, width=32)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path)))
    with dbg, plant_nonfinite(pipe.transformer.get_submodule(target), from_call=1):
        pipe("a cat", generator=generator(), **kwargs)
    anomalies = dbg.report().anomalies
    assert not [a for a in anomalies if a.kind == "debugger_error"]
    (error,) = [a for a in anomalies if a.severity == "error"]
    assert (error.component, error.module, error.step) == ("transformer", target, 1)
    assert "replay" in error.details["localized_by"]
    dbg.close()


@pytest.mark.parametrize("step", [1, 3])
def test_pyramid_attention_broadcast_on_flux_names_the_producer_at_its_step(tmp_path, step):
    # the cache's state moves on with every call: a step read one step late replayed the next step's
    # cached attention (naming transformer_blocks.0.attn), and after the last step no timestep at all
    from diffusers import PyramidAttentionBroadcastConfig

    pipe = tiny_pipeline("flux")
    pipe.transformer.enable_cache(
        PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: pipe.current_timestep,
        )
    )
    kwargs = dict(num_inference_steps=4, output_type="pt", height=32, width=32)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path)))  # policy record: steps may be read late
    with dbg, plant_nonfinite(pipe.transformer.proj_out, from_call=step):
        pipe("a cat", generator=generator(), **kwargs)
    anomalies = dbg.report().anomalies
    assert not [a for a in anomalies if a.kind == "debugger_error"]
    (error,) = [a for a in anomalies if a.severity == "error"]
    assert (error.component, error.module, error.step) == ("transformer", "proj_out", step)
    dbg.close()


def test_a_replay_under_pyramid_attention_broadcast_changes_no_image_now_or_later(tmp_path):
    from diffusers import PyramidAttentionBroadcastConfig, apply_pyramid_attention_broadcast

    def make():
        pipe = tiny_pipeline("sd", dtype=torch.float16)
        config = PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: 500,
        )
        apply_pyramid_attention_broadcast(pipe.unet, config)
        return pipe

    watched, twin = make(), make()
    block = "up_blocks.1"  # a block: the overflow warning replays the UNet to look inside it
    kwargs = dict(num_inference_steps=3, output_type="pt")
    dbg = DiffusionModelDebugger(watched, DebugConfig(output_dir=str(tmp_path), level="basic"))
    with plant_overflow(watched.unet.get_submodule(block), fraction=0.7, from_call=1), dbg:  # planted first
        seen = watched("a cat", generator=generator(), **kwargs).images
    with plant_overflow(twin.unet.get_submodule(block), fraction=0.7, from_call=1):
        expected = twin("a cat", generator=generator(), **kwargs).images
    assert [e["component"] for e in dbg.record.events if e["type"] == "replay"] == ["unet"]
    assert {a.component for a in dbg.report().anomalies if a.kind == "overflow_risk"} == {"unet"}
    torch.testing.assert_close(seen, expected, rtol=0, atol=0)
    later = watched("a cat", generator=generator(), **kwargs).images
    torch.testing.assert_close(later, twin("a cat", generator=generator(), **kwargs).images, rtol=0, atol=0)
    dbg.close()


def _first_block_cache():
    from diffusers import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=0.2)


def _taylor_seer():  # grows its taylor_factors dicts in place during a call
    from diffusers import TaylorSeerCacheConfig

    return TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1)


@pytest.mark.parametrize("cache", [_first_block_cache, _taylor_seer], ids=["first_block", "taylor_seer"])
def test_hook_state_kept_restores_the_state_and_sets_the_context(cache):
    pipe, twin = tiny_pipeline("flux"), tiny_pipeline("flux")  # seeded: the same weights
    for p in (pipe, twin):
        p.transformer.enable_cache(cache())
    kept = {}

    def keep(module, args, kwargs):
        kept["call"], kept["context"] = (args, kwargs), cache_context(module)

    handle = pipe.transformer.register_forward_pre_hook(keep, with_kwargs=True)
    kwargs = dict(num_inference_steps=6, output_type="pt", height=32, width=32)  # predicted steps after replays

    def replay(p, i, t, callback_kwargs):
        args, call_kwargs = kept["call"]
        with hook_state_kept(p.transformer, kept["context"]), torch.no_grad():
            p.transformer(*args, **call_kwargs)
        return callback_kwargs

    seen = pipe("a cat", generator=generator(), callback_on_step_end=replay, **kwargs).images
    handle.remove()
    assert kept["context"] is not None
    torch.testing.assert_close(seen, twin("a cat", generator=generator(), **kwargs).images, rtol=0, atol=0)
    later = pipe("a cat", generator=generator(), **kwargs).images
    torch.testing.assert_close(later, twin("a cat", generator=generator(), **kwargs).images, rtol=0, atol=0)


def test_a_cache_disabled_between_two_attaches_no_longer_counts_as_stateful(tmp_path):
    """The components running stateful hooks are found at each attach, not only added to: once the
    cache is disabled, steps are read a step late again (``defer``), as on a pipeline never cached."""
    from diffusers import FirstBlockCacheConfig

    pipe = tiny_pipeline("flux")
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        assert dbg._steps.calls.stateful == {"transformer"} and not dbg._steps.defer
    pipe.transformer.disable_cache()
    assert stateful_hooks(pipe.transformer) == []
    with dbg:
        assert dbg._steps.calls.stateful == set() and dbg._steps.defer
    dbg.close()
