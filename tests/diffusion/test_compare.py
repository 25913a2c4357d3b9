"""compare_pipelines on the tiny SD pipeline: each planted change is named at its origin
(component, module, step), made there or received; an unchanged twin is equal within the stated
tolerance (a compiled one too: test_compiled_wrappers.py's compile-side test, which compiles the UNet
once for that and for a change inside it)."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest
import torch

from diffusion_debug import DiffusionDebugError, compare_pipelines
from diffusion_debug.record.jsonio import load_json
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import SAME_NOISE_IN_HALF, clip_name

CALL = dict(prompt="a cat", num_inference_steps=2, output_type="np")
CONV = "up_blocks.1.resnets.0.conv2"
FC1 = clip_name("encoder.layers.0.mlp.fc1")


@pytest.fixture(scope="module")
def pipe():
    """The reference; tests leave it as they found it."""
    return tiny_pipeline("sd")


def scaled(pipe, component: str, module: str, factor: float = 1.01):
    """The change ``weight *= factor`` on one module, as a toggle: returns its bitwise undo."""
    weight = getattr(pipe, component).get_submodule(module).weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.mul_(factor)

    def undo():
        with torch.no_grad():
            weight.copy_(saved)

    return undo


def test_a_weight_changed_by_one_percent_is_made_in_its_conv_at_step_0(pipe):
    changed = tiny_pipeline("sd")
    scaled(changed, "unet", CONV)
    c = compare_pipelines(pipe, changed, **CALL)
    d = c.first_divergence
    assert (d.component, d.module, d.step, d.made_here) == ("unet", CONV, 0, True)
    assert d.timestep == float(pipe.scheduler.timesteps[0])
    assert 0.005 < d.relative_error < 0.02
    # the conv made it; every module after it (the resnet and block holding it too) received it
    assert c.modules[0].module == CONV and c.modules[0].input_error == 0.0
    assert not any(m.made_here for m in c.modules[1:])
    assert "up_blocks.1.resnets.0" in {m.module for m in c.modules}
    assert [s.step for s in c.steps] == [0, 1] and all(s.relative_error > c.tolerance for s in c.steps)
    assert c.tolerance == 1e-5
    assert str(c) == (
        f"first divergence: unet {CONV}, step 0, relative error {d.relative_error:.3g} > rtol 1e-05 "
        "(float32 against float32), made there"
    )


def test_a_swapped_scheduler_is_named_not_a_module(pipe):
    from diffusers import EulerDiscreteScheduler

    swapped = tiny_pipeline("sd")
    swapped.scheduler = EulerDiscreteScheduler.from_config(swapped.scheduler.config)
    d = compare_pipelines(pipe, swapped, **CALL).first_divergence
    assert (d.component, d.module, d.step, d.made_here) == ("scheduler", "", 0, True)


def test_a_perturbed_text_encoder_layer_is_named_not_the_unet_it_feeds(pipe):
    changed = tiny_pipeline("sd")
    scaled(changed, "text_encoder", FC1)
    c = compare_pipelines(pipe, changed, **CALL)
    d = c.first_divergence
    assert (d.component, d.module, d.step, d.made_here) == ("text_encoder", FC1, None, True)
    assert [m.module for m in c.modules if m.made_here] == [FC1]


def test_a_toggle_on_one_pipeline_is_found_and_undone(pipe):
    before = pipe(**CALL, generator=torch.Generator().manual_seed(0)).images
    c = compare_pipelines(pipe, pipe, b=lambda p: scaled(p, "unet", CONV), **CALL)
    d = c.first_divergence
    assert (d.component, d.module, d.step, d.made_here) == ("unet", CONV, 0, True)
    after = pipe(**CALL, generator=torch.Generator().manual_seed(0)).images
    np.testing.assert_array_equal(after, before)
    assert "step" not in vars(pipe.scheduler)  # the step wrapper came off
    assert not pipe.unet._forward_hooks and not pipe.unet._forward_pre_hooks


def test_call_arguments_that_differ_are_named_as_the_input(pipe):
    embeds = pipe.encode_prompt("a cat", "cpu", 1, False)[0]
    same = dict(prompt=None, prompt_embeds=embeds)
    call = {k: v for k, v in CALL.items() if k != "prompt"}
    assert (
        compare_pipelines(pipe, pipe, a=same, b={**same, "prompt_embeds": embeds.clone()}, **call).first_divergence
        is None
    )
    d = compare_pipelines(pipe, pipe, a=dict(guidance_scale=5.0), b=dict(guidance_scale=9.0), **CALL).first_divergence
    assert (d.component, d.module, d.step) == ("input", "guidance_scale", 0)


def test_the_comparison_saves_strict_json_and_a_report(pipe, tmp_path):
    changed = tiny_pipeline("sd")
    scaled(changed, "unet", CONV)
    c = compare_pipelines(pipe, changed, **CALL)
    out = c.save(tmp_path / "cmp")
    record = load_json(out / "comparison.json")
    assert record["summary"] == c.summary()
    assert record["first_divergence"]["module"] == CONV and record["first_divergence"]["made_here"] is True
    assert record["tolerance"] == 1e-5 and len(record["steps"]) == 2
    page = (out / "report.html").read_text()
    headline, curve = page.index(html.escape(c.summary())), page.index("<polyline points=")
    made, received = page.index("<h3>made there"), page.index("<h3>received")
    assert headline < curve < made < page.index(f"<td>{CONV}</td>") < received
    assert received < page.index("<td>up_blocks.1.resnets.0</td>")
    assert len(re.search(r'<polyline points="([^"]*)"', page).group(1).split()) == 2  # one point a step


def test_bad_input_is_one_sentence_before_any_call(pipe):
    with pytest.raises(
        DiffusionDebugError,
        match=r"^compare_pipelines needs two diffusers DiffusionPipelines; pipe_b is a UNet2DConditionModel\.$",
    ):
        compare_pipelines(pipe, pipe.unet, **CALL)
    with pytest.raises(DiffusionDebugError, match="leave generator= out"):
        compare_pipelines(pipe, pipe, generator=torch.Generator(), **CALL)
    with pytest.raises(DiffusionDebugError, match="b= takes a dict"):
        compare_pipelines(pipe, pipe, b=3, **CALL)
    with pytest.raises(DiffusionDebugError, match=r"^compare_pipelines: seed= takes an int, not a str\.$"):
        compare_pipelines(pipe, pipe, seed="0", **CALL)


@pytest.mark.skipif(not SAME_NOISE_IN_HALF, reason="this torch draws other noise in float16 than in float32")
def test_fp32_against_fp16_is_judged_against_fp16_rounding(pipe):
    """Replayed on A's fp32 inputs, B's fp16 components take them cast to fp16, as their own upstream
    would have made them; the rounding stays within fp16's tolerance, which the summary states."""
    c = compare_pipelines(pipe, tiny_pipeline("sd", dtype=torch.float16), **{**CALL, "output_type": "latent"})
    assert c.first_divergence is None
    assert c.tolerance == 1e-2 and c.dtypes == ("float32", "float16")
    assert all(0 < s.relative_error < 1e-2 for s in c.steps)
    assert str(c) == "equal within rtol 0.01 (float32 against float16): 2 steps compared"


def test_a_change_beyond_fp16_rounding_is_found_in_an_fp16_unet_replayed_on_fp32_inputs(pipe):
    changed = tiny_pipeline("sd", dtype=torch.float16)
    scaled(changed, "unet", CONV, 1.1)
    d = compare_pipelines(pipe, changed, **{**CALL, "output_type": "latent"}).first_divergence
    assert (d.component, d.module, d.step, d.made_here) == ("unet", CONV, 0, True)
    assert 0.05 < d.relative_error < 0.15


def test_an_fp16_overflow_prone_module_is_first_and_the_rest_received_it(pipe):
    """The same weights (one conv scaled by 1e5) in fp32 and fp16: only fp16 overflows, in that conv."""
    big, small = tiny_pipeline("sd"), tiny_pipeline("sd", dtype=torch.float16)
    for p in (big, small):
        scaled(p, "unet", "down_blocks.1.resnets.0.conv1", 1e5)
    c = compare_pipelines(big, small, **{**CALL, "output_type": "latent"})
    d = c.first_divergence
    assert (d.component, d.module, d.step, d.made_here) == ("unet", "down_blocks.1.resnets.0.conv1", 0, True)
    assert d.relative_error == float("inf")
    assert c.modules[0].module == "down_blocks.1.resnets.0.conv1" and not any(m.made_here for m in c.modules[1:])


def test_fp8_layerwise_casting_is_equal_within_fp8_rounding_with_its_modules_ranked(pipe):
    cast = tiny_pipeline("sd")
    if not hasattr(cast.unet, "enable_layerwise_casting"):
        pytest.skip("this diffusers has no layerwise casting (0.33+)")
    cast.unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    c = compare_pipelines(pipe, cast, **{**CALL, "output_type": "latent"})
    assert c.first_divergence is None and c.tolerance == 0.1
    assert str(c) == "equal within rtol 0.1 (float32 against float8_e4m3fn): 2 steps compared"
    keys = [(not m.made_here, -(m.relative_error - m.input_error)) for m in c.modules]
    assert len(c.modules) == 20 and keys == sorted(keys)  # made first, then by the error each added
    assert all(m.component == "unet" for m in c.modules)


def test_a_scheduler_toggled_on_one_pipeline_is_named_and_put_back(pipe):
    from diffusers import EulerDiscreteScheduler

    original = pipe.scheduler

    def euler(p):
        saved, p.scheduler = p.scheduler, EulerDiscreteScheduler.from_config(p.scheduler.config)
        return lambda: setattr(p, "scheduler", saved)

    d = compare_pipelines(pipe, pipe, b=euler, **CALL).first_divergence
    assert (d.component, d.module, d.step) == ("scheduler", "", 0)
    assert pipe.scheduler is original and "step" not in vars(original)


def test_first_block_cache_on_against_off_is_attributed_to_the_cache_at_the_step_it_skipped():
    hooks = pytest.importorskip("diffusers.hooks")
    if not hasattr(hooks, "FirstBlockCacheConfig"):
        pytest.skip("this diffusers has no FirstBlockCache (0.34+)")
    from diffusion_debug.diffusion.components.cache_hooks import stateful_hooks
    from diffusion_debug.testing.flux import FLUX_CALL

    flux = tiny_pipeline("flux")

    def cached(p):
        p.transformer.enable_cache(hooks.FirstBlockCacheConfig(threshold=0.5))
        return p.transformer.disable_cache

    c = compare_pipelines(flux, flux, b=cached, **FLUX_CALL[0](), num_inference_steps=4)
    d = c.first_divergence
    assert (d.component, d.module, d.step, d.made_here) == ("transformer", "", 1, True)
    assert d.cause == "diffusers caching hook FBCHeadBlockHook on B only"
    assert c.steps[0].relative_error == 0.0 and c.steps[1].relative_error > c.tolerance
    assert not stateful_hooks(flux.transformer)  # the toggle's undo ran


def test_a_scheduler_copied_inside_a_compared_call_steps_itself_unrecorded(pipe):
    """LTX-2 deep-copies its scheduler inside its call (for the audio) and steps the copy: while a
    call is recorded, ``scheduler.step`` is the recording's, and a deep copy or a pickle of the
    scheduler gets the class's own ``step`` bound to the copy (a copied wrapper stepped the original,
    and recorded it); the original's steps alone are recorded."""
    import copy
    import pickle

    from diffusion_debug.diffusion.compare.recording import record_call

    copies = []

    def copy_and_step(p, i, t, kwargs):
        for twin in (copy.deepcopy(p.scheduler), pickle.loads(pickle.dumps(p.scheduler))):
            assert twin.step.__self__ is twin and twin.step.__func__ is type(twin).step
            copies.append(twin)
        return kwargs

    recording = record_call(pipe, None, {**CALL, "callback_on_step_end": copy_and_step}, seed=0)
    assert [e.step for e in recording.events if e.kind == "step"] == [0, 1] and len(copies) == 4
    assert "step" not in vars(pipe.scheduler)


def test_a_scheduler_state_copied_and_put_back_inside_a_compared_call_stays_recorded(pipe):
    """MultiDiffusion (StableDiffusionPanoramaPipeline) keeps ``copy.deepcopy(self.scheduler.__dict__)``
    per view and puts it back with ``self.scheduler.__dict__.update(...)`` before each view's step: the
    scheduler itself is not copied, so its recorded ``step`` is the very one put back, and every
    step of the call is still recorded (not the class's ``step`` from the second step on)."""
    import copy

    from diffusion_debug.diffusion.compare.recording import record_call

    def keep_and_put_back(p, i, t, kwargs):
        status = copy.deepcopy(p.scheduler.__dict__)
        p.scheduler.__dict__.update(status)
        return kwargs

    recording = record_call(pipe, None, {**CALL, "callback_on_step_end": keep_and_put_back}, seed=0)
    assert [e.step for e in recording.events if e.kind == "step"] == [0, 1]
    assert "step" not in vars(pipe.scheduler)
