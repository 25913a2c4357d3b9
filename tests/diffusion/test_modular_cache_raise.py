"""Policy ``raise`` on a modular pipeline whose denoiser runs a caching hook. Modular Diffusers' own
call resets no cache at its end (two clean calls of a cached modular LTX differ, unwatched); Cosmos 3
omni's ``__call__`` resets its transformer's in a ``finally``, which the policy's error passes through.
So the debugger resets nothing there and leaves the next call to that end: clean, bitwise a fresh
pipeline's. ``why()`` replays the bundled call from its cache as that call began (kept by the debugger):
it replayed a fresh cache, another call than the run's."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.faults import plant_nonfinite
from diffusion_debug.testing.features import HAS_CACHE_HOOKS, HAS_MODULAR

pytestmark = pytest.mark.skipif(not (HAS_CACHE_HOOKS and HAS_MODULAR), reason="no caching hooks or modular pipelines")


def cosmos_ended_ltx():
    """A modular LTX-Video (the tiny LTX's components, a two-block transformer: FirstBlockCache needs a
    tail) under diffusers' ``Cosmos3OmniModularPipeline.__call__``, whose end resets the transformer's
    caches; FirstBlockCache that caches the tail from step 1 on."""
    try:
        from diffusers.modular_pipelines.cosmos.modular_pipeline import Cosmos3OmniModularPipeline
    except ImportError:
        pytest.skip("this diffusers has no Cosmos 3 omni modular pipeline")
    from diffusers import FirstBlockCacheConfig, LTXVideoTransformer3DModel
    from diffusers.modular_pipelines.ltx import LTXBlocks, LTXModularPipeline

    class CosmosEndedLTX(Cosmos3OmniModularPipeline, LTXModularPipeline):
        """LTX's blocks and properties, Cosmos 3 omni's call."""

    components = {k: v for k, v in tiny_pipeline("ltx").components.items() if v is not None}
    torch.manual_seed(0)
    # the zoo's tiny LTX transformer with a second block (the first block and the cached tail)
    components["transformer"] = LTXVideoTransformer3DModel.from_config(
        {**components["transformer"].config, "num_layers": 2}
    )
    pipe = CosmosEndedLTX(blocks=LTXBlocks())
    pipe.update_components(**components)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=1e9))
    return pipe


def call(pipe):
    generator = torch.Generator().manual_seed(0)
    kwargs = dict(height=32, width=32, num_frames=9, num_inference_steps=3, max_sequence_length=16)
    return pipe(prompt="a cat", generator=generator, output="latents", **kwargs)


def test_a_raised_call_of_a_modular_pipeline_that_resets_its_caches_at_its_end_is_why_replayed_from_its_cache(
    tmp_path,
):
    """A NaN planted in ``proj_out`` at step 1's first call (two calls a step: cond and uncond), which took the
    tail from step 0's cached residual: ``why()`` replays that call from its cache as it began, not from the
    fresh cache the call's end left (the tail computed again): its output is the run's to the bit. (The state
    the raise left is the same here, a call that took the residual leaves it: test_cached_replays' PAB test
    is where the two differ.)"""
    pipe, fresh = cosmos_ended_ltx(), cosmos_ended_ltx()
    expected = call(fresh)
    torch.testing.assert_close(call(fresh), expected, rtol=0, atol=0)  # its end resets: calls repeat
    config = DebugConfig(level="advanced", output_dir=tmp_path, log_level="error", policy="raise")
    dbg = DiffusionModelDebugger(pipe, config)
    outputs = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, out: outputs.append(out[0]))
    with plant_nonfinite(pipe.transformer.proj_out, from_call=2, value=float("nan")):  # why() too
        with dbg, pytest.raises(DiffusionDebugError) as raised:
            call(pipe)
        handle.remove()
        anomaly = raised.value.anomaly
        assert (anomaly.component, anomaly.module, anomaly.step) == ("transformer", "proj_out", 1)
        dbg.close()
        result = dbg.report().why()
    run = outputs[2].float()
    run_max = float(run.abs().where(run.isfinite(), 0.0).amax())
    assert (result.component, result.module, result.step, result.baseline.finite) == (
        "transformer",
        "proj_out",
        1,
        False,
    )
    assert result.baseline.max_abs == run_max
    uncached = {r.factor: r.max_abs for r in result.replays}["caching off"]
    assert uncached != run_max  # (the tail computed: the fresh cache's replay was another call)
    later = call(pipe)  # the call's end reset its caches; why() put back the live ones it replayed over
    torch.testing.assert_close(later, expected, rtol=0, atol=0)
