"""A compiled cached component's call replayed by ``replay(bundle, component)`` and ``why()`` compiles nothing
for the live component. Each replay swaps the caching hooks' timestep callbacks and, where the live cache
cannot take the call, their links (in place, then put back); ``why()``'s rows on the live component ran the
user's compiled code with them swapped, and dynamo recompiled (regional: 2 frames), its guards on
``current_timestep_callback.__code__`` or ``function_reference`` (a link) failing; under ``torch.compile``
FasterCache's ``new_forward`` hit ``recompile_limit`` (8), past which torch runs the user's own later
recompiles of it eagerly. The user's next call is the unwatched one's, to the bit, and compiles nothing.
``why()``'s rows on a copy (caching off, bfloat16) run it eagerly, and say so: a copy of a ``torch.compile``
wrapper, compiled, ran the same code and compiled in its cache (11 graphs, FasterCache's ``new_forward`` at
``recompile_limit``), and the user's next call then compiled ``_compute_approximated_attention_output`` again."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.installed import HAS_SET_STANCE
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import HAS_CACHE_HOOKS, HAS_REPEATED_BLOCKS

pytestmark = pytest.mark.skipif(
    not (HAS_CACHE_HOOKS and HAS_REPEATED_BLOCKS and HAS_SET_STANCE),
    reason="this diffusers has no caching hooks or regional compilation, or this torch no set_stance",
)

CALL = dict(num_inference_steps=3, output_type="pt", height=16, width=16)


def generator():
    return torch.Generator().manual_seed(0)


def compiled_flux(cache: str, how: str):
    """A tiny Flux under FasterCache or PyramidAttentionBroadcast (their callback reads
    ``pipe.current_timestep``, None once a call has ended), compiled with aot_eager as a whole or by region."""
    from diffusers import FasterCacheConfig, PyramidAttentionBroadcastConfig

    pipe = tiny_pipeline("flux")
    if cache == "faster_cache":  # step 0 computed; block 0 approximates at step 1 (from a cache reset at the end)
        config = FasterCacheConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 901),
            current_timestep_callback=lambda: pipe.current_timestep,
            attention_weight_callback=lambda _: 0.5,
            is_guidance_distilled=True,
        )
    else:
        config = PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: pipe.current_timestep,
        )
    pipe.transformer.enable_cache(config)
    if how == "torch.compile":
        pipe.transformer = torch.compile(pipe.transformer, backend="aot_eager")
    else:
        pipe.transformer.compile_repeated_blocks(backend="aot_eager")
    return pipe


def graphs() -> tuple[int, int]:
    """Dynamo's graphs made and frames it compiled so far (its ``counters``)."""
    return counters["stats"]["unique_graphs"], counters["frames"]["total"]


@pytest.mark.parametrize(
    ("cache", "how", "policy"),
    [
        ("faster_cache", "torch.compile", "record"),  # a normal end: the live cache is passed through
        ("faster_cache", "regional", "record"),
        ("pyramid_attention", "regional", "raise"),  # a raise: replayed from the cache as the call began
    ],
)
def test_replays_of_a_compiled_cached_component_add_no_graph(cache, how, policy, tmp_path):
    from diffusion_debug.diffusion import replay
    from diffusion_debug.diffusion.components.cache_hooks import stateful_hooks
    from diffusion_debug.diffusion.replay.why import explain_run

    torch._dynamo.reset()
    counters.clear()
    pipe = compiled_flux(cache, how)
    plain = pipe("a cat", generator=generator(), **CALL).images  # compiles: the unwatched call's graphs
    unwatched = graphs()
    assert pipe("a cat", generator=generator(), **CALL).images.equal(plain) and graphs() == unwatched

    transformer = getattr(pipe.transformer, "_orig_mod", pipe.transformer)
    weight, kept = transformer.proj_out.weight, transformer.proj_out.weight.detach().clone()

    def nan_from_step_1(pipe, i, t, kwargs):  # a weight, not a hook: nothing traced changes
        if i == 0:
            with torch.no_grad():
                weight.fill_(float("nan"))
        return {}

    links = [vars(hook.fn_ref).copy() for hook in stateful_hooks(transformer)]
    callbacks = [hook.current_timestep_callback for hook in stateful_hooks(transformer)]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", policy=policy))
    try:
        with dbg:
            pipe("a cat", generator=generator(), callback_on_step_end=nan_from_step_1, **CALL)
    except DiffusionDebugError:
        assert policy == "raise"
    assert graphs() == unwatched
    report = dbg.report()
    (anomaly,) = [a for a in report.anomalies if a.kind == "nonfinite" and a.severity == "error"]
    assert (anomaly.module, anomaly.step, anomaly.details["bundle"]) == ("proj_out", 1, "bundles/transformer-step1")
    found = replay(report.save() / anomaly.details["bundle"], pipe.transformer)
    assert graphs() == unwatched
    result = report.why()
    bare = explain_run(report.run_dir, report.anomalies, pipe)  # the command's: no cache kept
    assert graphs() == unwatched, "why() compiled the user's functions again"
    made = graphs()
    dbg.close()
    with torch.no_grad():
        weight.copy_(kept)

    assert (found["module"], found["output_finite"]) == ("proj_out", False)
    assert (result.module, result.step, result.baseline.finite, result.note) == ("proj_out", 1, False, "")
    assert (bare.module, bare.baseline.finite, bare.note) == ("proj_out", False, found["note"])
    compiled_as = {"torch.compile": "compiled with torch.compile", "regional": "compiled regionally"}[how]
    eagerly = f"the copy runs eagerly ({compiled_as}: compiling a copy would add graphs to its cache)"
    copies = {r.factor: r.note for r in result.replays if r.factor in ("caching off", "bfloat16")}
    assert copies == {"caching off": eagerly, "bfloat16": eagerly}
    passed = cache == "faster_cache"  # its cache, reset at the end, cannot take the call: passed through
    assert found["note"].startswith("transformer was replayed without its caching hooks") is passed
    assert [vars(hook.fn_ref) for hook in stateful_hooks(transformer)] == links
    assert [hook.current_timestep_callback for hook in stateful_hooks(transformer)] == callbacks
    later = pipe("a cat", generator=generator(), **CALL).images
    assert graphs() == made, "the user's next call compiled again"
    torch.testing.assert_close(later, plain, rtol=0, atol=0)
