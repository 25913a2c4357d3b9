"""diffusers' stateful caching hooks: the localising replay runs in the watched call's cache
context and leaves every hook's state as it was, so neither the watched image nor a later call
changes (compared with a twin pipeline making the same calls without the debugger)."""

from __future__ import annotations

import contextlib
import tempfile

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components import cache_hooks
from diffusion_debug.diffusion.components.cache_hooks import (
    cache_context,
    hook_state,
    hook_state_kept,
    stateful_hooks,
)
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


def test_a_faster_cache_replay_without_the_older_attention_its_call_dropped_computes_what_the_call_did():
    """A FasterCache block that approximates reads its ``[older, newer]`` cached outputs and drops the
    older; held by weak reference (beyond ``KEPT_BYTES``: every real model) it is gone by the replay,
    which failed (a ``debugger_error``, the anomaly named at the block). The replay now takes the
    call's own output back from the hooks' state: each replay of each step is bitwise the call."""
    from diffusers import FasterCacheConfig

    pipe, twin = tiny_pipeline("flux", dtype=torch.float16), tiny_pipeline("flux", dtype=torch.float16)
    for p in (pipe, twin):
        p.transformer.enable_cache(
            FasterCacheConfig(
                spatial_attention_block_skip_range=2,
                spatial_attention_timestep_skip_range=(-1, 901),  # step 0 computes; 1 and 3 approximate
                current_timestep_callback=lambda p=p: p.current_timestep,
                is_guidance_distilled=True,
            )
        )
    kept, same = {}, []

    def keep(module, args, kwargs):
        kept["call"], kept["state"] = (args, kwargs), hook_state(module, budget=[0])  # none held: all weak

    def made(module, args, kwargs, output):
        kept["output"] = output[0]

    def replay(p, i, t, callback_kwargs):
        (args, call_kwargs), (context, state) = kept["call"], kept["state"]
        with hook_state_kept(p.transformer, context, state), torch.no_grad():
            again = p.transformer(*args, **call_kwargs)[0]
        same.append(torch.equal(again, kept["output"]))
        return callback_kwargs

    handles = [
        pipe.transformer.register_forward_pre_hook(keep, with_kwargs=True),
        pipe.transformer.register_forward_hook(made, with_kwargs=True),
    ]
    kwargs = dict(num_inference_steps=4, output_type="pt", height=32, width=32)
    seen = pipe("a cat", generator=generator(), callback_on_step_end=replay, **kwargs).images
    for handle in handles:
        handle.remove()
    assert same == [True] * 4
    torch.testing.assert_close(seen, twin("a cat", generator=generator(), **kwargs).images, rtol=0, atol=0)
    later = pipe("a cat", generator=generator(), **kwargs).images
    torch.testing.assert_close(later, twin("a cat", generator=generator(), **kwargs).images, rtol=0, atol=0)


def test_a_call_policy_raise_ends_leaves_no_cache_state_to_the_next_call(tmp_path):
    """Policy ``raise`` ends the call at the step of its NaN, before the pipeline's end resets its
    caching hooks (``maybe_free_model_hooks``): the call's TaylorSeer factors (NaN) fed the next call,
    made after detach, a NaN image. The raise resets them as the call's end would: the next call is the
    clean one, as after the same faulty call unwatched."""
    from diffusion_debug import DiffusionDebugError

    pipe = tiny_pipeline("flux")
    pipe.transformer.enable_cache(_taylor_seer())
    kwargs = dict(num_inference_steps=3, output_type="pt", height=16, width=16)
    clean = pipe("a cat", generator=generator(), **kwargs).images
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", policy="raise"))
    module = "transformer_blocks.0.attn.to_out.0"
    with pytest.raises(DiffusionDebugError) as raised:
        with dbg, plant_nonfinite(pipe.transformer.get_submodule(module), from_call=1, value=float("nan")):
            pipe("a cat", generator=generator(), **kwargs)
    assert (raised.value.anomaly.component, raised.value.anomaly.module, raised.value.anomaly.step) == (
        "transformer",
        module,
        2,  # TaylorSeer computes steps 0 and 2 (1 predicted): the planted module's second call
    )
    torch.testing.assert_close(pipe("a cat", generator=generator(), **kwargs).images, clean, rtol=0, atol=0)
    dbg.close()


def test_a_reset_that_fails_as_policy_raise_ends_a_call_still_raises_the_policys_error(tmp_path, monkeypatch):
    """A stateful hook whose ``reset_state`` fails (a user's own) as the raise resets the caches: the
    policy's DiffusionDebugError is still what the call raises, and the failure is a debugger_error."""
    from diffusers.hooks.taylorseer_cache import TaylorSeerCacheHook

    from diffusion_debug import DiffusionDebugError

    def failing(self, module):
        raise RuntimeError("a reset that fails")

    pipe = tiny_pipeline("flux")
    pipe.transformer.enable_cache(_taylor_seer())
    monkeypatch.setattr(TaylorSeerCacheHook, "reset_state", failing)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", policy="raise"))
    module = pipe.transformer.get_submodule("transformer_blocks.0.attn.to_out.0")
    with pytest.raises(DiffusionDebugError):
        with dbg, plant_nonfinite(module, from_call=0, value=float("nan")):
            pipe("a cat", generator=generator(), num_inference_steps=2, output_type="latent", height=16, width=16)
    assert [e.details.get("where") for e in dbg.report().anomalies if e.kind == "debugger_error"] == ["cache_reset"]
    dbg.close()


def test_a_save_for_why_that_fails_as_policy_raise_ends_a_call_still_resets_the_caches(tmp_path, monkeypatch):
    """why29: the state the raised call left (kept for ``why()``) and the reset its end would do shared one
    ``try``: a save that failed skipped the reset, and the next call, after detach, read the raised call's NaN
    TaylorSeer factors. Now the failed save is a debugger_error of its own and the next call is the clean one."""
    from diffusion_debug import DiffusionDebugError

    def failing(state):
        raise RuntimeError("a save that fails")

    pipe = tiny_pipeline("flux")
    pipe.transformer.enable_cache(_taylor_seer())
    kwargs = dict(num_inference_steps=3, output_type="pt", height=16, width=16)
    clean = pipe("a cat", generator=generator(), **kwargs).images
    monkeypatch.setattr(cache_hooks, "held_apart", failing)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", policy="raise"))
    module = pipe.transformer.get_submodule("transformer_blocks.0.attn.to_out.0")
    with pytest.raises(DiffusionDebugError):
        with dbg, plant_nonfinite(module, from_call=1, value=float("nan")):
            pipe("a cat", generator=generator(), **kwargs)
    failed = [
        (e.details.get("where"), e.details.get("error")) for e in dbg.report().anomalies if e.kind == "debugger_error"
    ]
    assert [where for where, _ in failed] == ["raised_state"] and "a save that fails" in str(failed)
    assert not dbg._steps.calls.raised_states
    torch.testing.assert_close(pipe("a cat", generator=generator(), **kwargs).images, clean, rtol=0, atol=0)
    dbg.close()


def test_policy_raise_leaves_the_caches_a_pipelines_end_never_resets_as_they_are(tmp_path):
    """A pipeline's end resets only the caches of components that have ``_reset_stateful_cache``
    (diffusers' CacheMixin: a UNet has none): a UNet's PyramidAttentionBroadcast keeps its state from
    call to call, unwatched, so the raise leaves it as the call left it (the 2 calls it counted)."""
    from diffusers import PyramidAttentionBroadcastConfig, apply_pyramid_attention_broadcast

    from diffusion_debug import DiffusionDebugError

    pipe = tiny_pipeline("sd")
    config = PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=lambda: 500,
    )
    apply_pyramid_attention_broadcast(pipe.unet, config)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", policy="raise"))
    with pytest.raises(DiffusionDebugError):
        with dbg, plant_nonfinite(pipe.unet.get_submodule("up_blocks.1"), from_call=1, value=float("nan")):
            pipe("a cat", generator=generator(), num_inference_steps=3, output_type="latent")
    counts = {hook.state.iteration for hook in stateful_hooks(pipe.unet)}
    assert counts == {2}


def _flux_with_pyramid_attention_broadcast():
    """A tiny Flux whose transformer reuses its attention every other call (a counted, cached state)."""
    from diffusers import PyramidAttentionBroadcastConfig

    pipe = tiny_pipeline("flux")
    config = PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=lambda: 500,
    )
    pipe.transformer.enable_cache(config)
    return pipe


def test_compare_pipelines_replays_leave_each_pipelines_cache_as_its_last_call_left_it():
    """compare_pipelines replays the diverging transformer call on both pipelines after their calls
    ended: under PyramidAttentionBroadcast the replay counted one more call and cached its attention,
    so each pipeline's next call (after the end's reset, a fresh cache) started from the replay's."""
    from diffusion_debug import compare_pipelines

    make = _flux_with_pyramid_attention_broadcast
    kwargs = dict(num_inference_steps=2, output_type="pt", height=16, width=16)
    a, b, twin = make(), make(), make()
    with torch.no_grad():
        b.transformer.transformer_blocks[0].attn.to_out[0].weight.mul_(1.5)
    found = compare_pipelines(a, b, seed=0, prompt="a cat", **kwargs).first_divergence
    assert (found.component, found.module, found.step) == ("transformer", "transformer_blocks.0.attn.to_out.0", 0)
    later = a("a cat", generator=generator(), **kwargs).images
    torch.testing.assert_close(later, twin("a cat", generator=generator(), **kwargs).images, rtol=0, atol=0)


def test_a_bundle_replayed_on_the_live_component_leaves_its_cache_as_the_call_left_it(tmp_path):
    """``replay(bundle, pipe.transformer)`` after the call: under PyramidAttentionBroadcast the replay
    counted one more call and cached its attention, which the next call (its cache reset at the last
    call's end) started from: its image changed."""
    from diffusion_debug.diffusion import replay

    pipe, twin = _flux_with_pyramid_attention_broadcast(), _flux_with_pyramid_attention_broadcast()
    kwargs = dict(num_inference_steps=2, output_type="pt", height=16, width=16)
    module = "transformer_blocks.0.attn.to_out.0"
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg, plant_nonfinite(pipe.transformer.get_submodule(module), from_call=0, value=float("nan")):
        pipe("a cat", generator=generator(), **kwargs)
    (anomaly,) = [a for a in dbg.report().anomalies if a.kind == "nonfinite" and a.severity == "error"]
    run_dir = dbg.report().save()
    assert replay(run_dir / anomaly.details["bundle"], pipe.transformer)["output_finite"] is True  # no fault now
    later = pipe("a cat", generator=generator(), **kwargs).images
    torch.testing.assert_close(later, twin("a cat", generator=generator(), **kwargs).images, rtol=0, atol=0)
    dbg.close()


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


def _caches(pipe):
    """Every caching hook diffusers has, on a tiny Flux, each replacing cache tensors in some call."""
    from diffusers import (
        FasterCacheConfig,
        FirstBlockCacheConfig,
        MagCacheConfig,
        PyramidAttentionBroadcastConfig,
        TaylorSeerCacheConfig,
    )

    now = lambda: pipe.current_timestep  # noqa: E731
    return {
        "pyramid_attention_broadcast": PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=now,
        ),
        "faster_cache": FasterCacheConfig(  # the first step outside the range: computed, so cached
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 901),
            current_timestep_callback=now,
            is_guidance_distilled=True,
        ),
        "taylor_seer": TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, max_order=1),
        "first_block_cache": FirstBlockCacheConfig(threshold=1e-9),
        "mag_cache": MagCacheConfig(mag_ratios=[1.0] * 4, num_inference_steps=4, threshold=0.5),
    }


def _state_tensors(value, found, seen):
    """The tensors a hook's state holds: through attributes, state objects, tuples and containers."""
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif id(value) not in seen and (isinstance(value, (tuple, list, dict, set)) or hasattr(value, "__dict__")):
        seen.add(id(value))
        if isinstance(value, torch.nn.Module) or callable(value):
            return
        items = (
            value.values()
            if isinstance(value, dict)
            else vars(value).values()
            if hasattr(value, "__dict__")
            else value
        )
        for item in items:
            _state_tensors(item, found, seen)


def _kept_alive(pipe, watched: bool) -> list[int]:
    """Per transformer call, as it ends: the tensors its stateful hooks held as it began that they no
    longer hold and that are still alive (freed in a plain run: kept alive by someone else)."""
    import weakref

    began, counts = [], []

    def before(module, args, kwargs):
        found = []
        for hook in stateful_hooks(module):
            _state_tensors(hook, found, set())
        began[:] = [weakref.ref(t) for t in found]

    def after(module, args, kwargs, output):
        now = []
        for hook in stateful_hooks(module):
            _state_tensors(hook, now, set())
        live = {id(t) for t in now}
        counts.append(sum(1 for ref in began if ref() is not None and id(ref()) not in live))

    handles = [
        pipe.transformer.register_forward_pre_hook(before, with_kwargs=True, prepend=True),
        pipe.transformer.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        kwargs = dict(num_inference_steps=4, output_type="pt", height=32, width=32)
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tempfile.mkdtemp(), log_level="error"))
        with dbg if watched else contextlib.nullcontext():
            pipe("a cat", generator=generator(), **kwargs)
        dbg.close()
    finally:
        for handle in handles:
            handle.remove()
    return counts


@pytest.mark.parametrize(
    "cache", ["pyramid_attention_broadcast", "faster_cache", "taylor_seer", "first_block_cache", "mag_cache"]
)
def test_a_watched_call_keeps_no_cache_tensor_it_replaced_alive_beyond_the_budget(cache, monkeypatch):
    """Beyond ``KEPT_BYTES`` a call's saved hook state holds cache tensors by weak reference: one the call
    replaces is freed as in the plain run (PyramidAttentionBroadcast on Flux.1-dev: ~1.6 GB a step).
    Within it (the default, on a tiny Flux) they are kept: the replaced ones outlive the call."""
    pipe = tiny_pipeline("flux", dtype=torch.float16)
    pipe.transformer.enable_cache(_caches(pipe)[cache])
    plain = _kept_alive(pipe, watched=False)
    assert plain == [0, 0, 0, 0]
    assert sum(_kept_alive(pipe, watched=True)) > 0  # within the default budget: kept for an exact replay
    monkeypatch.setattr(cache_hooks, "KEPT_BYTES", 0, raising=False)  # (fails at the value before it)
    assert _kept_alive(pipe, watched=True) == plain


def test_a_cached_components_calls_find_its_hooks_once_an_attach_and_see_hooks_changed_between_calls(tmp_path):
    """A call under a caching hook saves the hooks' state without walking the component's modules
    again (Flux.1-dev: ~1200 modules, ~2 ms a call): the hooks found at its first call are checked by
    their registries' counts and identity, so a cache disabled, or enabled again, between two calls
    is seen at the next."""
    from diffusers import PyramidAttentionBroadcastConfig

    pipe = tiny_pipeline("flux")

    def config():
        return PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: pipe.current_timestep,
        )

    pipe.transformer.enable_cache(config())
    walks, states = [0], []
    real = type(pipe.transformer).modules

    def counted(self):
        walks[0] += 1
        return real(self)

    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    kwargs = dict(output_type="pt", height=32, width=32)

    def walked(steps: int, callback=None) -> int:
        with dbg:  # attached: the attach's own walks not counted
            pipe.transformer.modules = counted.__get__(pipe.transformer)
            walks[0] = 0
            try:
                pipe(
                    "a cat", generator=generator(), num_inference_steps=steps, callback_on_step_end=callback, **kwargs
                )
            finally:
                del pipe.transformer.modules
        return walks[0]

    assert walked(2) == walked(5)  # not one walk a call

    def saved(module, args, output):  # whether the call's hook state was saved as it began
        states.append(dbg._steps.calls.contexts.get(("transformer", ""), (None, None))[1] is not None)

    def toggle(p, i, t, callback_kwargs):
        if i == 0:
            p.transformer.disable_cache()
        elif i == 1:
            p.transformer.enable_cache(config())  # new hooks in the same registries: the same counts
        return callback_kwargs

    handle = pipe.transformer.register_forward_hook(saved)
    walked(4, toggle)
    handle.remove()
    assert states == [True, False, True, True]
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()


def _faster(pipe, skip: int = 2):
    from diffusers import FasterCacheConfig

    return FasterCacheConfig(  # the first step outside the range: computed, so cached
        spatial_attention_block_skip_range=skip,
        spatial_attention_timestep_skip_range=(-1, 901),
        current_timestep_callback=lambda: pipe.current_timestep,
        attention_weight_callback=lambda _: 0.5,
        is_guidance_distilled=True,
    )


def test_a_fault_after_a_faster_cache_approximation_is_named_at_its_module_beyond_the_budget(tmp_path, monkeypatch):
    """FasterCache reads the older cached attention in a call that approximates it, and drops it: held
    beyond the budget (every real model), it is gone by the replay, which failed (a ``debugger_error``,
    the NaN named at its block). The replay takes the call's own output back from the hooks' state:
    step 3's block 0 approximates, and the NaN its feed-forward makes is named there; the anomaly says
    how many bytes the replay ran without; the image is the unwatched one, fault and all."""
    monkeypatch.setattr(cache_hooks, "KEPT_BYTES", 0, raising=False)  # (fails at the value before it)
    pipe, twin = tiny_pipeline("flux", dtype=torch.float16), tiny_pipeline("flux", dtype=torch.float16)
    for p in (pipe, twin):
        p.transformer.enable_cache(_faster(p))
    kwargs = dict(num_inference_steps=4, output_type="pt", height=32, width=32)
    target = "transformer_blocks.0.ff.net.2"
    with plant_nonfinite(twin.transformer.get_submodule(target), from_call=3):
        expected = twin("a cat", generator=generator(), **kwargs).images
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg, plant_nonfinite(pipe.transformer.get_submodule(target), from_call=3):
        seen = pipe("a cat", generator=generator(), **kwargs).images
    torch.testing.assert_close(seen, expected, rtol=0, atol=0, equal_nan=True)
    anomalies = dbg.report().anomalies
    assert not [a for a in anomalies if a.kind == "debugger_error"]
    (error,) = [a for a in anomalies if a.severity == "error"]
    assert (error.component, error.module, error.step) == ("transformer", target, 3)
    assert error.details["replay_cache_released_bytes"] > 0
    dbg.close()


def test_a_replay_without_the_cache_tensors_its_call_replaced_says_so(tmp_path, monkeypatch):
    """Where the hooks' state is no longer the replayed call's (true CFG: the unconditional call came
    after it in the step, under the same FasterCache state) the older attention its approximation read
    cannot be had back: the replay fails and says why, the NaN is named at its block, and the anomaly
    says how many bytes the replay ran without (PyramidAttentionBroadcast, FirstBlockCache, TaylorSeer
    and MagCache compute again what the call replaced: exact without them, test_fp16_user_stacks)."""
    monkeypatch.setattr(cache_hooks, "KEPT_BYTES", 0, raising=False)
    pipe = tiny_pipeline("flux", dtype=torch.float16)
    pipe.transformer.enable_cache(_faster(pipe, skip=3))  # step 1's conditional call approximates
    kwargs = dict(num_inference_steps=3, output_type="pt", height=32, width=32)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg, plant_nonfinite(pipe.transformer.get_submodule("transformer_blocks.0.ff.net.2"), from_call=2):
        pipe("a cat", negative_prompt="a dog", true_cfg_scale=2.0, generator=generator(), **kwargs)
    anomalies = dbg.report().anomalies
    (failed,) = [a for a in anomalies if a.kind == "debugger_error"]
    assert "the replay ran without the" in str(failed.details)
    (error,) = [a for a in anomalies if a.severity == "error"]
    assert (error.component, error.module, error.step) == ("transformer", "transformer_blocks.0", 1)
    assert error.details["replay_cache_released_bytes"] > 0
    dbg.close()


class _State:
    pass


class _Hook:  # a stateful diffusers hook as the saved state sees one
    _is_stateful = True

    def __init__(self):
        self.state = _State()


class _Registry:
    def __init__(self, hook):
        self.hooks = {"cache": hook}


def test_a_saved_state_lets_go_of_what_the_call_replaced_and_puts_its_containers_back_as_made():
    """Beyond the budget a call's state holds tensors weakly and never holds a container: a list the
    call replaced and an inner dict it swapped are freed with their tensors; the replay gets the
    live containers refilled (a deque keeps its ``maxlen``, a defaultdict its factory), new ones for
    those replaced, None for a freed tensor (a dict's entry left out); afterwards all is as the call left it."""
    import collections
    import weakref

    module, hook = torch.nn.Linear(1, 1), _Hook()
    state, (a, b, c) = hook.state, (torch.full((4,), float(i)) for i in range(3))
    state.outputs, state.history, state.count = [a, b], collections.deque([b], maxlen=2), 1
    state.factors = collections.defaultdict(dict, {0: {0: c}})
    module.__dict__["_diffusers_hook"] = _Registry(hook)
    _, saved = cache_hooks.hook_state(module, budget=[0])
    freed = weakref.ref(a), weakref.ref(c)
    new = torch.zeros(4)  # the call:
    state.outputs, state.count = [b, new], 2
    state.history.append(new)
    state.factors[0] = {0: new}
    history, factors = state.history, state.factors
    del a, c
    assert [ref() for ref in freed] == [None, None]
    with hook_state_kept(module, None, saved) as released:
        assert released == 2 * 4 * 4
        assert state.outputs[0] is None and state.outputs[1] is b and state.count == 1
        assert state.history is history and list(state.history) == [b] and state.history.maxlen == 2
        assert state.factors is factors and dict(state.factors) == {0: {}} and state.factors.default_factory is dict
    assert state.outputs[1] is new and state.count == 2 and list(state.history) == [b, new]
    assert state.factors[0][0] is new


def test_a_state_held_apart_puts_the_call_back_while_its_module_lives_and_lets_it_go_after():
    """heldstate27: a bundled call's state kept for ``why()`` (:func:`~.cache_hooks.held_apart`) holds the hook,
    its state objects and what reaches the module (a bound forward, as diffusers' ``fn_ref`` does) by weak
    reference: put back while the module lives it is the call's state as the state itself was; once the module
    (and the hooks its registry holds) is let go it is collected, the holder forgets it, and putting the state
    back is a no-op."""
    import gc
    import weakref

    module, hook = torch.nn.Linear(1, 1), _Hook()
    hook.forward_ref, state, (a, b) = module.forward, hook.state, (torch.full((2,), float(i)) for i in range(2))
    state.outputs, state.count, state.by_name = [a], 1, {"a": a}
    module.__dict__["_diffusers_hook"] = _Registry(hook)
    _, saved = cache_hooks.hook_state(module)
    held = cache_hooks.held_apart(saved)
    forward = hook.forward_ref
    state.outputs, state.count, state.by_name = [b], 2, {"b": b}  # the call
    for kept in (saved, held):
        with hook_state_kept(module, None, kept) as released:
            put_back = (released, state.outputs[0] is a, state.count, list(state.by_name), hook.forward_ref is forward)
        assert put_back == (0, True, 1, ["a"], True)
        assert (state.outputs[0] is b, state.count, list(state.by_name)) == (True, 2, ["b"])
    states = cache_hooks.HeldStates()
    states[module] = held
    assert states.get(module) is held and states.get(torch.nn.Linear(1, 1)) is None
    gone, hook_gone = weakref.ref(module), weakref.ref(hook)
    del module, hook, state, forward, saved, put_back
    gc.collect()
    assert (gone(), hook_gone(), len(states)) == (None, None, 0)  # nothing in the held state kept them
    assert cache_hooks._restore(held) == 0  # (every object it would put back into is gone)


def test_a_guiders_hooks_put_back_for_a_replay_come_off_every_layer_when_one_fails_to_come_off():
    """:func:`placement_kept` puts a guider's layer hooks back on two layers for a replay; the second layer's
    hook fails as it is taken off after it: the first layer's comes off all the same (before: left on, changing
    every later call) and the error goes on to the replay's guard."""
    from diffusers.hooks import HookRegistry, ModelHook

    class Guider(ModelHook):
        fail = False

        def new_forward(self, module, *args, **kwargs):
            return torch.zeros_like(module.__class__.forward(module, *args, **kwargs))

        def deinitalize_hook(self, module):
            if self.fail:
                raise RuntimeError("cannot come off")
            return module

    layers = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    registries = [HookRegistry.check_if_exists_or_initialize(layer) for layer in layers]
    hooks = [Guider(), Guider()]
    for registry, hook in zip(registries, hooks):
        registry.register_hook(hook, "guider")
    placement = cache_hooks.hook_placement(registries)  # as the guided call began
    for registry in registries:  # the guider's cleanup after it
        registry.remove_hook("guider", recurse=False)
    x = torch.ones(1, 2)
    plain = layers(x)
    with pytest.raises(RuntimeError, match="cannot come off"):
        with cache_hooks.placement_kept(placement):
            assert torch.equal(layers(x), torch.zeros(1, 2))  # the guided call's hooks, on for the replay
            hooks[1].fail = True
    assert list(registries[0].hooks) == []
    first = layers[0]
    assert torch.equal(first(x), torch.nn.functional.linear(x, first.weight, first.bias))  # its plain forward again
    assert not torch.equal(plain, torch.zeros(1, 2))
