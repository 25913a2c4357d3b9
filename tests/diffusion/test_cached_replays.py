"""A cached component's call replayed outside the pipeline's loop: ``compare_pipelines``' replay on
equal inputs and ``replay(bundle, component)`` run in the call's cache context (the pipeline's
``cache_context`` has ended by then: TaylorSeer and FirstBlockCache refused, "No cache context is
set"), each side from its own hooks' state as the call began, and leave the hooks as they were;
``why()``'s copies of a cached component run in another dtype from the call's cache, cast; and a cache
that asks the pipeline's ``current_timestep`` (None once the call ended) is answered the bundled step's by
``replay(bundle, component)`` and ``why()``, which replays from the cache as the bundled call began."""

from __future__ import annotations

import contextlib

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


# TaylorSeer and FirstBlockCache refused a call outside a cache context alike: one of them per path


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


def test_two_pipelines_under_the_same_cache_are_compared_to_the_changed_module():
    cache = _taylor_seer
    a, b, twin = cached_flux(cache), cached_flux(cache), cached_flux(cache)
    scale(b, 1.5)
    found = compare_pipelines(a, b, seed=0, prompt="a cat", **CALL)
    d = found.first_divergence
    assert (d.component, d.module, d.step, d.made_here, d.cause) == ("transformer", MODULE, 0, True, "")
    assert [m.module for m in found.modules if m.made_here] == [MODULE]
    later = a("a cat", generator=generator(), **CALL).images  # the replays left each cache as its call did
    torch.testing.assert_close(later, twin("a cat", generator=generator(), **CALL).images, rtol=0, atol=0)


def test_a_cached_pipeline_compared_with_itself_changed_finds_the_change_and_is_put_back():
    cache = _first_block_cache
    pipe, twin = cached_flux(cache), cached_flux(cache)
    d = compare_pipelines(pipe, pipe, seed=0, b=lambda p: scale(p, 1.5), prompt="a cat", **CALL).first_divergence
    assert (d.component, d.module, d.step, d.made_here, d.cause) == ("transformer", MODULE, 0, True, "")
    assert compare_pipelines(pipe, twin, seed=0, prompt="a cat", **CALL).first_divergence is None


def test_a_bundle_replayed_on_a_cached_live_component_names_the_producer(tmp_path):
    from diffusion_debug.diffusion import replay

    cache = _first_block_cache
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


def _faster_cache(pipe):
    from diffusers import FasterCacheConfig

    return FasterCacheConfig(  # step 0 outside the range: computed; block 0 approximates at step 1
        spatial_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(-1, 901),
        current_timestep_callback=lambda: pipe.current_timestep,
        attention_weight_callback=lambda _: 0.5,
        is_guidance_distilled=True,
    )


def _tail_cached(pipe):
    from diffusers import FirstBlockCacheConfig

    return FirstBlockCacheConfig(threshold=1e9)  # from step 1 on the tail is its cached residual


@pytest.mark.parametrize(
    ("cache", "run_dtype"),
    [
        (_faster_cache, torch.bfloat16),  # a bfloat16 cached attention read by the float32 copy
        (_tail_cached, torch.float32),  # a float32 residual read by the bfloat16 copy
    ],
    ids=["faster_cache-bf16", "first_block-fp32"],
)
def test_a_why_copy_in_another_dtype_replays_the_cached_call_the_run_made(cache, run_dtype):
    """``why()``'s dtype rows replay a copy of the component (``cast_copy(isolated_copy(...))``). The copy's
    hooks were registered again, and ``initialize_hook`` gave FasterCache a fresh state (a block that
    approximates read an empty cache: TypeError); kept, a float32 run's cached attention or FirstBlockCache
    residual then reached a bfloat16 layer ("mat1 and mat2 must have the same dtype"). Now a copy in the
    run's dtype is the call bitwise, and one in each other dtype takes the call's cached path: it parts from
    the same copy without caching exactly where the run parted from the uncached call."""
    from diffusion_debug.diffusion.components.cache_hooks import hook_state, hook_state_kept
    from diffusion_debug.diffusion.replay.copies import cast_copy, isolated_copy

    pipe = tiny_pipeline("flux", dtype=run_dtype)
    pipe.transformer.enable_cache(cache(pipe))
    kept, rows = {}, []

    def keep(module, args, kwargs):
        kept["call"], kept["state"] = (args, kwargs), hook_state(module)

    def made(module, args, kwargs, output):
        kept["output"] = output[0]

    def run_copy(copy, args, kwargs, context, dtype):
        cast = {k: v.to(dtype) if torch.is_tensor(v) and v.dtype == run_dtype else v for k, v in kwargs.items()}
        with hook_state_kept(copy, context), torch.no_grad():
            return copy(*args, **cast)[0].float()

    def replay(p, i, t, callback_kwargs):
        (args, kwargs), (context, state), run = kept["call"], kept["state"], kept["output"].float()
        for dtype in (torch.float32, torch.bfloat16):  # (float16: cast as bfloat16 is)
            with hook_state_kept(p.transformer, context, state):  # the live hooks as the call began
                cached = cast_copy(isolated_copy(p.transformer), dtype)
                uncached = cast_copy(isolated_copy(p.transformer, drop_hooks="caching"), dtype)
            out, plain = (run_copy(m, args, kwargs, context, dtype) for m in (cached, uncached))
            rows.append((i, dtype, out, plain, run))
        return callback_kwargs

    handles = [
        pipe.transformer.register_forward_pre_hook(keep, with_kwargs=True),
        pipe.transformer.register_forward_hook(made, with_kwargs=True),  # (its copies' calls too: read first)
    ]
    pipe(
        "a cat",
        generator=generator(),
        callback_on_step_end=replay,
        num_inference_steps=3,
        output_type="pt",
        height=16,
        width=16,
    )
    for handle in handles:
        handle.remove()
    same = [(step, out, plain, run) for step, dtype, out, plain, run in rows if dtype == run_dtype]
    assert all(torch.equal(out, run) for _, out, _, run in same)  # the call itself
    cached_steps = {step for step, _, plain, run in same if not torch.equal(plain, run)}
    assert cached_steps == ({1} if cache is _faster_cache else {1, 2})
    for step, dtype, out, plain, run in rows:
        if dtype != run_dtype:
            assert ((out - run).norm() / run.norm()) < 0.1, (step, dtype)  # that dtype's rounding, no more
            assert torch.equal(out, plain) == (step not in cached_steps), (step, dtype)


def test_why_on_a_faster_cache_call_replays_every_dtype_row(tmp_path):
    """Every row of ``why()`` on a float32 FasterCache call that approximated (step 1, policy ``raise``)
    replays: the bfloat16 row failed (its copy's block read an empty cache)."""
    from diffusion_debug import DiffusionDebugError

    pipe = tiny_pipeline("flux")
    pipe.transformer.enable_cache(_faster_cache(pipe))
    config = DebugConfig(level="advanced", output_dir=tmp_path, log_level="error", policy="raise")
    dbg = DiffusionModelDebugger(pipe, config)
    target = "transformer_blocks.0.ff.net.2"
    with plant_nonfinite(pipe.transformer.get_submodule(target), from_call=1, value=float("nan")):  # why() too
        with dbg, pytest.raises(DiffusionDebugError):
            pipe("a cat", generator=generator(), num_inference_steps=4, output_type="latent", height=32, width=32)
        result = dbg.report().why()
    dbg.close()
    assert (result.module, result.step) == (target, 1)
    assert {r.factor: (r.finite, r.error) for r in result.replays} == {
        "SDPA math kernel": (False, ""),
        "caching off": (False, ""),
        "bfloat16": (False, ""),
        "finite inputs": (False, ""),
    }


def test_a_cache_that_reads_the_pipelines_current_timestep_is_compared_to_the_changed_module():
    """PyramidAttentionBroadcast (and FasterCache) ask ``current_timestep_callback`` for the call's
    timestep, in diffusers' own examples ``lambda: pipe.current_timestep``; by the replay on equal
    inputs the pipeline's call has ended and set it to None ("'<' not supported between instances of
    'int' and 'NoneType'", the comparison's cause). Each side replays with its pipeline's timestep as
    the call began, put back after."""
    a, b, twin = (_pab_flux() for _ in range(3))
    scale(b, 1.5)
    d = compare_pipelines(a, b, seed=0, prompt="a cat", **CALL).first_divergence
    assert (d.component, d.module, d.step, d.made_here, d.cause) == ("transformer", MODULE, 0, True, "")
    assert a.current_timestep is None and b.current_timestep is None
    later = a("a cat", generator=generator(), **CALL).images
    torch.testing.assert_close(later, twin("a cat", generator=generator(), **CALL).images, rtol=0, atol=0)


def test_a_cached_b_whose_second_call_stops_early_is_reported_as_not_reached():
    """B's second recording (for the replay, its cache's state as the diverging call began) ends before
    that call: B was replayed with no cache context, and diffusers' "No cache context is set" became the
    comparison's cause. Now the comparison says plainly that B's second call did not reach it."""
    pipe_a, pipe_b = cached_flux(_first_block_cache), cached_flux(_first_block_cache)
    applied = []

    def b(pipe):  # the step-1 call changed; B's second call interrupted after step 0 (not deterministic)
        applied.append(1)
        calls = []

        def scaled(module, args, output):
            calls.append(1)
            return output * 1.5 if len(calls) > 1 else output

        def interrupt(module, args, output):
            pipe._interrupt = True

        handles = [pipe.transformer.get_submodule(MODULE).register_forward_hook(scaled)]
        if len(applied) == 2:
            handles.append(pipe.transformer.register_forward_hook(interrupt))

        def undo():
            for handle in handles:
                handle.remove()
            pipe._interrupt = False

        return undo

    d = compare_pipelines(pipe_a, pipe_b, seed=0, b=b, prompt="a cat", **CALL).first_divergence
    assert (d.component, d.module, d.step, d.made_here) == ("transformer", "", 1, True)
    assert d.cause == "B's second call did not reach this call again: not deterministic"
    assert len(applied) == 2


def _pab_flux():
    """A Flux under PyramidAttentionBroadcast as diffusers' docs set it up: its callback reads
    ``pipe.current_timestep`` (None once a call has ended); at step 1 each block's attention is the
    cached step 0's (iteration 1 of a skip range of 2), at step 2 it is computed again."""
    from diffusers import PyramidAttentionBroadcastConfig

    pipe = tiny_pipeline("flux")
    pipe.transformer.enable_cache(
        PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 1001),
            current_timestep_callback=lambda: pipe.current_timestep,
        )
    )
    return pipe


def _faster_cache_flux():
    """A Flux under FasterCache (:func:`_faster_cache`: its callback reads ``pipe.current_timestep``): at
    step 1 block 0's attention is approximated from its cache of steps 0 (computed outside the range)."""
    pipe = tiny_pipeline("flux")
    pipe.transformer.enable_cache(_faster_cache(pipe))
    return pipe


def _finite_max(output: torch.Tensor) -> float:
    values = output.detach().float()
    return float(values.abs().where(values.isfinite(), 0.0).amax())


def _watched(pipe, tmp_path, policy: str):
    """``pipe``'s call watched under ``policy``; returns the debugger, the step-1 output's largest finite
    |x| and what the replays must leave as it is: the callbacks of its caching hooks and its
    ``current_timestep`` (None after a normal end, the raised step's after a raise)."""
    from diffusion_debug import DiffusionDebugError
    from diffusion_debug.diffusion.components.cache_hooks import stateful_hooks

    outputs = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, out: outputs.append(out[0]))
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", policy=policy))
    callbacks = [getattr(hook, "current_timestep_callback", None) for hook in stateful_hooks(pipe.transformer)]
    raised = pytest.raises(DiffusionDebugError) if policy == "raise" else contextlib.nullcontext()
    with dbg, raised:
        pipe("a cat", generator=generator(), **CALL)
    handle.remove()
    return dbg, _finite_max(outputs[1]), (callbacks, pipe.current_timestep)


def _leaves_the_pipeline_as_it_was(pipe, kept, make=_pab_flux):
    from diffusion_debug.diffusion.components.cache_hooks import stateful_hooks

    callbacks, timestep = kept
    assert pipe.current_timestep is timestep
    assert [hook.current_timestep_callback for hook in stateful_hooks(pipe.transformer)] == callbacks
    later, twin = pipe("a cat", generator=generator(), **CALL).images, make()
    torch.testing.assert_close(later, twin("a cat", generator=generator(), **CALL).images, rtol=0, atol=0)


@pytest.mark.parametrize("make", [_pab_flux, _faster_cache_flux], ids=["pyramid_attention", "faster_cache"])
def test_a_bundle_and_why_after_a_normal_end_replay_the_call_a_timestep_cache_made(tmp_path, make):
    """After a call that ended normally ``pipe.current_timestep`` is None: ``replay(bundle, component)``
    raised diffusers' TypeError ("'<' not supported between instances of 'int' and 'NoneType'") and every
    row of ``why()`` but "caching off" failed (nothing could be concluded). Now the hooks' callback
    answers the bundled step's timestep during the replays, and ``why()`` replays from the cache as the
    call began: its as-is output is the run's, to the bit. A bundle holds no cache: FasterCache's, reset at
    the call's end, fails the block that approximated (diffusers reads its empty cache), so the bundle's
    replay runs without the caching hooks and says so."""
    from diffusion_debug.diffusion import replay
    from diffusion_debug.diffusion.replay.why import explain_run

    pipe = make()
    with plant_nonfinite(pipe.transformer.proj_out, from_call=1, value=float("nan")):  # from step 1 on
        dbg, run_max, kept = _watched(pipe, tmp_path, "record")
        report = dbg.report()
        (anomaly,) = [a for a in report.anomalies if a.kind == "nonfinite" and a.severity == "error"]
        where = (anomaly.module, anomaly.step, anomaly.details["bundle"])
        assert where == ("proj_out", 1, "bundles/transformer-step1")
        found = replay(report.save() / anomaly.details["bundle"], pipe.transformer)
        result = report.why()
        bare = explain_run(report.run_dir, report.anomalies, pipe)  # the command's: no cache kept
    dbg.close()
    note = (
        "transformer was replayed without its caching hooks: the replay from the cache they hold now failed "
        "(TypeError: 'NoneType' object is not subscriptable), and a bundle holds no cache"
    )
    assert (found["module"], found["output_finite"]) == ("proj_out", False)
    assert found["note"] == (note if make is _faster_cache_flux else "")
    assert (result.module, result.step, result.baseline.finite, result.note) == ("proj_out", 1, False, "")
    assert result.baseline.max_abs == run_max
    assert (bare.module, bare.baseline.finite, bare.note) == ("proj_out", False, found["note"])
    _leaves_the_pipeline_as_it_was(pipe, kept, make)


def test_why_after_a_raise_replays_the_cache_as_the_kept_call_began(tmp_path):
    """``why()`` of a call ended by policy ``raise`` replayed from the caches that call left: PAB's
    counters had moved on (the attention computed again, not the cached step 0's the call took), so the
    as-is replay was another call than the run's. It now replays from the hooks' state as the bundled
    call began: its output is the run's to the bit, and the uncached replay's is not."""
    pipe = _pab_flux()
    with plant_nonfinite(pipe.transformer.proj_out, from_call=1, value=float("nan")):
        dbg, run_max, kept = _watched(pipe, tmp_path, "raise")
        result = dbg.report().why()
    dbg.close()
    assert (result.module, result.step, result.baseline.finite, result.note) == ("proj_out", 1, False, "")
    assert result.baseline.max_abs == run_max
    (uncached,) = [r.max_abs for r in result.replays if r.factor == "caching off"]
    assert uncached != run_max  # (the two states differ: the cached attention is what the run used)
    _leaves_the_pipeline_as_it_was(pipe, kept)


def test_a_bundle_without_a_timestep_is_replayed_without_its_caching_hooks_and_says_so(tmp_path):
    """A bundle that holds no timestep (``meta.json``'s ``timestep`` null) on a component whose caching
    hooks ask the ended pipeline's: replayed with them passed through, with one sentence saying so."""
    import json

    from diffusion_debug.diffusion import replay

    pipe = _pab_flux()
    with plant_nonfinite(pipe.transformer.proj_out, from_call=1, value=float("nan")):
        dbg, _, kept = _watched(pipe, tmp_path, "record")
        report = dbg.report()
        bundle = report.save() / "bundles/transformer-step1"
        meta = json.loads((bundle / "meta.json").read_text())
        (bundle / "meta.json").write_text(json.dumps({**meta, "timestep": None}))
        found = replay(bundle, pipe.transformer)
        result = report.why()
    dbg.close()
    note = (
        "transformer was replayed without its caching hooks: they ask the pipeline's current timestep, "
        "which is unset once its call has ended, and the bundle holds none"
    )
    assert (found["module"], found["output_finite"], found["note"]) == ("proj_out", False, note)
    assert (result.module, result.baseline.finite, result.note) == ("proj_out", False, note)
    assert result.markdown().endswith(f"\n{note}\n")
    _leaves_the_pipeline_as_it_was(pipe, kept)


def test_a_compiled_component_replayed_on_a_copy_without_its_caching_hooks_says_it_ran_eagerly(tmp_path, monkeypatch):
    """why29: where the caching hooks cannot be passed through in place, ``why()`` replays a copy without them,
    which runs eagerly (a compiled copy would add graphs to the user's cache): the note said only that the
    hooks were off. Now it says the copy ran eagerly, as a row on a copy does."""
    import json

    from diffusion_debug.diffusion.replay import why

    pipe = _pab_flux()
    with plant_nonfinite(pipe.transformer.proj_out, from_call=1, value=float("nan")):
        dbg, _, _ = _watched(pipe, tmp_path, "record")
        bundle = dbg.report().save() / "bundles/transformer-step1"
        meta = json.loads((bundle / "meta.json").read_text())
        (bundle / "meta.json").write_text(json.dumps({**meta, "timestep": None}))  # the hooks' timestep: none
        pipe.transformer.compile(backend="eager")  # (in place; never called: the replays run on the copy)
        monkeypatch.setattr(why, "hooks_passed", lambda *_: contextlib.nullcontext(False))  # cannot pass them
        result = why.explain_bundle(bundle, pipe.transformer)
    dbg.close()
    assert (result.module, result.baseline.finite) == ("proj_out", False)
    assert result.note == (
        "transformer was replayed without its caching hooks: they ask the pipeline's current timestep, which is "
        "unset once its call has ended, and the bundle holds none; it was replayed on a copy without them: the "
        "copy runs eagerly (compiled in place: compiling a copy would add graphs to its cache)"
    )


def test_a_bundle_replayed_without_its_caching_hooks_copies_no_component_and_puts_them_back(tmp_path, monkeypatch):
    """review26b: ``replay(bundle, component)`` replayed a FasterCache component whose live cache cannot take
    the call on a deep copy of the whole component (twice its weights: a 12B transformer's copy is out of
    memory where its run fit), and ``why()`` held such a copy beside each row's own copy of it (three times
    its weights). Both now run the live component with its caching hooks passed through (a row's copy leaves
    them off), and each hook's link is put back after, even when the replay raises."""
    import copy
    import gc
    import weakref

    from diffusion_debug.diffusion import replay
    from diffusion_debug.diffusion.components.cache_hooks import stateful_hooks
    from diffusion_debug.diffusion.replay.why import explain_run

    pipe = _faster_cache_flux()
    with plant_nonfinite(pipe.transformer.proj_out, from_call=1, value=float("nan")):
        dbg, _, kept = _watched(pipe, tmp_path, "record")
        report = dbg.report()
        bundle = report.save() / "bundles/transformer-step1"
        copies, most, deepcopy = [], [0], copy.deepcopy

        def spied(value, *args, **kwargs):  # how many copies of the component live as another is made
            copied = deepcopy(value, *args, **kwargs)
            if type(value) is type(pipe.transformer):
                gc.collect()
                most[0] = max(most[0], sum(ref() is not None for ref in copies))
                copies.append(weakref.ref(copied))
            return copied

        monkeypatch.setattr(copy, "deepcopy", spied)
        links = [vars(hook.fn_ref).copy() for hook in stateful_hooks(pipe.transformer)]
        found = replay(bundle, pipe.transformer)
        replayed_copies = len(copies)

        def fail(module, args):
            raise RuntimeError("planted")

        handle = pipe.transformer.transformer_blocks[0].register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="planted"):
            replay(bundle, pipe.transformer)
        handle.remove()
        bare = explain_run(report.run_dir, report.anomalies, pipe)  # the command's: no cache kept
        monkeypatch.undo()
    dbg.close()
    assert (found["module"], found["output_finite"]) == ("proj_out", False)
    assert found["note"].startswith("transformer was replayed without its caching hooks: the replay from the cache")
    assert replayed_copies == 0
    assert (bare.module, bare.baseline.finite, bare.note) == ("proj_out", False, found["note"])
    assert [r.factor for r in bare.replays] == ["SDPA math kernel", "bfloat16", "finite inputs"]
    assert most[0] == 1  # (a row's copy is made while the last row's is held, as for any component)
    assert [vars(hook.fn_ref) for hook in stateful_hooks(pipe.transformer)] == links
    _leaves_the_pipeline_as_it_was(pipe, kept, _faster_cache_flux)


def test_a_caching_hook_without_new_forward_is_passed_through_and_put_back():
    """``hooks_passed`` on a caching hook that acts in ``pre_forward`` only (SeaCache's root hook: its link's
    ``original_forward`` is None): the call is the module's own within the block, the hook's after."""
    from diffusers.hooks import HookRegistry, ModelHook

    from diffusion_debug.diffusion.replay.copies import hooks_passed

    class Doubled(ModelHook):
        _is_stateful = True

        def pre_forward(self, module, *args, **kwargs):
            return tuple(a * 2 for a in args), kwargs

    torch.manual_seed(0)
    layer, x = torch.nn.Linear(3, 3), torch.randn(2, 3)
    plain = layer(x)
    HookRegistry.check_if_exists_or_initialize(layer).register_hook(Doubled(), "sea_cache_root")
    hooked = layer(x)
    with hooks_passed(layer, "caching") as passed:
        within = layer(x)
    assert passed and torch.equal(within, plain) and not torch.equal(hooked, plain)
    assert torch.equal(layer(x), hooked)


def _first_block_flux():
    """A Flux under FirstBlockCache (its state per cache context, in a StateManager)."""
    return cached_flux(_first_block_cache)


@pytest.mark.usefixtures("only_the_tests_objects")  # its gc.collect() walks only what the test made
@pytest.mark.parametrize(
    ("make", "policy"),
    [(_pab_flux, "record"), (_pab_flux, "raise"), (_first_block_flux, "record"), (_first_block_flux, "raise")],
    ids=["pyramid_attention-record", "pyramid_attention-raise", "first_block-record", "first_block-raise"],
)
def test_a_cached_transformer_replaced_after_its_bundle_is_let_go_while_the_debugger_lives(tmp_path, make, policy):
    """heldstate27: the bundled call's hooks' state (and a raise's left caches) kept for ``why()`` held the
    hooks, their ``fn_ref`` (the transformer's bound forward) and the transformer itself as the key, until the
    next bundle or ``clear_debug_history()``: a user who replaced ``pipe.transformer`` after the anomaly kept
    the old one alive as long as the debugger. Now the state is held while its transformer lives: ``why()``
    on it still replays the run's call to the bit, and once the pipeline lets it go (the debugger detached,
    or closed after a raise) it is collected and its state with it."""
    import gc
    import weakref

    pipe = make()
    with plant_nonfinite(pipe.transformer.proj_out, from_call=1, value=float("nan")):
        dbg, run_max, _ = _watched(pipe, tmp_path, policy)
        report = dbg.report()
        result = report.why()
    calls = dbg._steps.calls
    held = [calls.bundled_state.get(pipe.transformer), calls.raised_states.get(pipe.transformer)]
    if policy == "raise":
        dbg.close()
    assert (result.module, result.step, result.baseline.finite) == ("proj_out", 1, False)
    assert result.baseline.max_abs == run_max
    assert [state is not None for state in held] == [True, policy == "raise"]
    old = weakref.ref(pipe.transformer)
    pipe.transformer = make().transformer  # (seeded: the same weights, its own caching hooks)
    del held
    gc.collect()
    assert old() is None  # nothing of the debugger's holds the transformer the pipeline let go of
    assert (calls.bundled_state.get(pipe.transformer), calls.raised_states.get(pipe.transformer)) == (None, None)
    assert [(a.module, a.step) for a in report.anomalies if a.severity == "error"] == [("proj_out", 1)]
    dbg.close()
