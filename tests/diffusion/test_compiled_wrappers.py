"""Components compiled the way users compile them: replaced by their ``torch.compile`` wrapper
(``pipe.vae = torch.compile(pipe.vae)``, ``pipe.unet = torch.compile(pipe.unet)``) before the debugger
attaches or between two calls of one attach, and a VAE decode compiled and sliced. The debugger adds
no graph break or graph (dynamo's counters), the images are the plain compiled call's, a fault is named
at its module, and detach leaves the wrapper as it was. The VAE's backend is ``eager`` (aot_eager fails
on the tiny decoder without the debugger: see test_compiled.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusion_helpers import SD_FP16_VAE, changed_weight, dynamo_counts, inf_weight, scaled
from torch._dynamo.utils import counters

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.call_events import COMPILED_OUTPUT
from diffusion_debug.diffusion.components.compiled import compile_state
from diffusion_debug.testing import plant_nonfinite, plant_overflow, tiny_pipeline

FAULTY = "up_blocks.1.resnets.0.conv2"
REPLAYED = "output check -> replay with full probes"
VAE_UPSAMPLER = "decoder.up_blocks.0.upsamplers.0.conv"


def call(pipe):
    return pipe("a cat", num_inference_steps=2, output_type="np", generator=torch.Generator().manual_seed(0)).images


def fresh(dtype: torch.dtype):
    torch._dynamo.reset()
    counters.clear()
    return tiny_pipeline("sd").to(dtype=dtype)


def left_as_it_was(wrapper: torch.nn.Module, own: dict) -> bool:
    """Whether no hook is left on any module under ``wrapper`` and its and its original's attributes
    are the objects they were (``own``: ``{"wrapper": vars(...), "original": vars(...)}`` copied)."""
    hooked = [m for m in wrapper.modules() if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks]
    now = {"wrapper": dict(vars(wrapper)), "original": dict(vars(wrapper._orig_mod))}
    same = all(now[k].keys() == own[k].keys() and all(now[k][n] is own[k][n] for n in own[k]) for k in own)
    return not hooked and same


def attributes(wrapper: torch.nn.Module) -> dict:
    return {"wrapper": dict(vars(wrapper)), "original": dict(vars(wrapper._orig_mod))}


def found(dbg) -> list[tuple]:
    anomalies = [a for a in dbg.report().anomalies if a.kind != "scheduler_config"]
    return [(a.kind, a.component, a.module, a.details.get("localized_by")) for a in anomalies]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_vae_replaced_by_its_torch_compile_wrapper_is_watched_as_the_eager_vae_it_runs_as(dtype, tmp_path):
    """``torch.compile(vae)`` compiles the VAE's ``forward``; the pipeline's ``vae.decode``, looked up
    through the wrapper, is the original's and runs eagerly (no graph at all). The VAE is watched as an
    uncompiled one: in fp16 its decoder's near-overflow is warned of (the wrapper was taken for compiled
    code and the VAE got no probe: nothing was warned), and a NaN is named at its module, whether the
    wrapper replaced the VAE between two calls of one attach or was there before the debugger; the
    images are the unwatched call's, and detach leaves the wrapper and its VAE as they were."""
    pipe = fresh(dtype)
    config = DebugConfig(output_dir=str(tmp_path), log_level="error")
    dbg = DiffusionModelDebugger(pipe, config)
    dbg.attach()
    try:
        call(pipe)
        pipe.vae = wrapper = torch.compile(pipe.vae, backend="eager")
        own = attributes(wrapper)
        watched = call(pipe)  # replaced between two calls of one attach
    finally:
        dbg.detach()
    assert left_as_it_was(wrapper, own) and pipe.vae is wrapper
    np.testing.assert_array_equal(watched, call(pipe))
    assert compile_state(wrapper) is None and found(dbg) == []

    later = DiffusionModelDebugger(pipe, config)  # the wrapper there before it attaches
    faulty = wrapper._orig_mod.get_submodule(VAE_UPSAMPLER)
    expected = []
    if dtype == torch.float16:  # planted first: the debugger's probes read it
        for _ in range(2):
            with plant_overflow(faulty, fraction=0.61), later:
                call(pipe)
        # read with full probes once per pipeline (dbg's call did): the sentinel at each, a replay at the first, the
        # second named from that replay (the debugger's replay memory: no replay of its own)
        expected = [
            ("overflow_risk", "vae", VAE_UPSAMPLER, "sentinel -> replay with full probes"),
            ("overflow_risk", "vae", VAE_UPSAMPLER, "sentinel -> an earlier call's replay"),
        ]
    with plant_nonfinite(faulty, value=float("nan")), later:
        call(pipe)
    how = "sentinel" if dtype == torch.float16 else "output check"
    bypassed = ("compile_bypassed", "vae", "", None)  # its compiled forward is never called: said once, at attach
    assert found(later) == [
        bypassed,
        *expected,
        ("nonfinite", "vae", VAE_UPSAMPLER, f"{how} -> replay with full probes"),
    ]
    replays = [e["component"] for e in later.record.events if e["type"] == "replay"]
    assert replays == ["vae"] * (2 if dtype == torch.float16 else 1)  # (the first near-max's, the NaN's)
    watched = [a for a in later.report().anomalies if a.component == "vae" and a.kind != "compile_bypassed"]
    assert watched and all(a.details["sd_vae"] for a in watched)  # the fp16-fix advice
    assert dynamo_counts() == (0, 0)  # no graph: the decode ran eagerly throughout
    assert left_as_it_was(wrapper, own) and pipe.vae is wrapper
    dbg.close()
    later.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_unet_replaced_by_its_torch_compile_wrapper_between_two_calls_of_one_attach(dtype, tmp_path):
    """The wrapper's first call compiles the UNet it wraps: the debugger's hooks still on that UNet
    (hooked as the denoiser at attach) were traced into its graph (2 graph breaks, and in fp16 a second
    graph) and stayed there after detach. The replaced UNet is followed as the next call sets its
    schedule, before its first call: no graph break, one graph, the images of the plain compiled call,
    a fault named at its module and step, and the wrapper left as it was."""
    pipe = fresh(dtype)
    unet = pipe.unet
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    dbg.attach()
    try:
        call(pipe)
        pipe.unet = wrapper = torch.compile(unet, backend="aot_eager")
        own = attributes(wrapper)
        watched = call(pipe)  # compiles, watched
    finally:
        dbg.detach()
    assert dynamo_counts() == (0, 1)
    np.testing.assert_array_equal(watched, call(pipe))
    replaced = [e for e in dbg.record.events if e["type"] == "component_replaced"]
    assert [(e["component"], e["while_attached"], e["now"]) for e in replaced] == [("unet", True, "OptimizedModule")]

    with inf_weight(unet.get_submodule(FAULTY)), dbg:
        call(pipe)
    assert dynamo_counts() == (0, 1)  # a weight is a graph input: no recompile
    (error, *_) = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert (error.component, error.module, error.step) == ("unet", FAULTY, 0)
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    assert left_as_it_was(wrapper, own) and pipe.unet is wrapper
    dbg.close()


SECOND_IMAGE_LOUDER = 5.0
"""The second image's starting latents times this: its decoder's ``conv_in`` output is 5.7 times the
first's (41.4 against 7.3 in fp16)."""
CONV_IN_GAIN = 2600.0
"""``decoder.conv_in``'s weight times this: the second slice's output passes fp16's largest value
(Inf), the first's stays below half of it (19,000: no near-overflow either)."""


@pytest.mark.parametrize("how", ["vae.decode = torch.compile(vae.decode)", "pipe.vae = torch.compile(pipe.vae) too"])
def test_a_fault_in_the_second_slice_of_a_compiled_sliced_decode_is_named_at_its_module(how, tmp_path):
    """A sliced decode (``enable_slicing``, two images) calls the decoder once a slice inside the
    user's compiled ``decode``; the debugger sees the decode's output (Inf in the second image) and
    replays the decoder eagerly on the arguments of the slice that made it (its first slice's
    replay, all finite, named nothing: the finding fell back to the whole ``decoder``). Also with the
    decode compiled on the VAE's ``torch.compile`` wrapper (``pipe.vae.decode = torch.compile(
    pipe.vae.decode)`` sets it on the wrapper): its decoder was hooked eagerly inside the compiled
    decode and the fault went unseen. No graph break or graph added; the images are the plain
    compiled call's."""
    pipe = fresh(torch.float16)
    vae = pipe.vae
    vae.enable_slicing()
    size = pipe.unet.config.sample_size

    def two():
        latents = torch.randn(2, 4, size, size, generator=torch.Generator().manual_seed(0)).to(torch.float16)
        latents[1] *= SECOND_IMAGE_LOUDER
        return pipe("a cat", num_inference_steps=1, num_images_per_prompt=2, output_type="np", latents=latents).images

    finite = []  # the naive reference: the eager decoder's conv_in, slice by slice
    with changed_weight(vae.decoder.conv_in, lambda w: w.mul_(CONV_IN_GAIN)):
        with vae.decoder.conv_in.register_forward_hook(lambda m, a, out: finite.append(bool(out.isfinite().all()))):
            two()
    assert finite == [True, False]

    if how.startswith("vae.decode"):
        vae.decode = torch.compile(vae.decode, backend="eager")
    else:
        pipe.vae = torch.compile(vae, backend="eager")
        pipe.vae.decode = torch.compile(pipe.vae.decode, backend="eager")
    plain = two()
    expected = dynamo_counts()
    assert expected == (0, 1)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        watched = two()
    np.testing.assert_array_equal(watched, plain)
    with changed_weight(vae.decoder.conv_in, lambda w: w.mul_(CONV_IN_GAIN)), dbg:
        two()
    assert dynamo_counts() == expected, "the debugger added a graph break or a graph"
    assert found(dbg) == [("nonfinite", "vae", "decoder.conv_in", "output check -> replay with full probes")]
    np.testing.assert_array_equal(two(), plain)
    dbg.close()


def test_compare_compile_side_names_a_change_inside_the_compiled_unet():
    """``diffusion-debug compare --b compile=BACKEND`` puts the denoiser's ``torch.compile`` wrapper on
    the pipeline around side B's call (``jobs.compare``): unchanged, eager against compiled is equal
    within the tolerance (test_compare.py's compiled twin, merged here: one compile for both); a
    weight changed inside it is found at its module and step, made there, with no graph break and
    no second graph, and the eager UNet is put back."""
    from diffusion_debug import compare_pipelines
    from diffusion_debug.jobs.compare import _compiled

    pipe = fresh(torch.float32)
    unet, compile_b = pipe.unet, _compiled("aot_eager")

    c = compare_pipelines(pipe, pipe, b=compile_b, prompt="a cat", num_inference_steps=2, output_type="np", seed=0)
    assert c.first_divergence is None
    assert str(c) == "equal within rtol 1e-05 (float32 against float32): 2 steps compared"
    assert dynamo_counts() == (0, 1) and pipe.unet is unet

    def b(pipe):
        undo = compile_b(pipe)
        changed = changed_weight(unet.get_submodule(FAULTY), lambda w: w.mul_(1.5))
        changed.__enter__()
        return lambda: (changed.__exit__(None, None, None), undo())

    c = compare_pipelines(pipe, pipe, b=b, prompt="a cat", num_inference_steps=2, seed=0)
    d = c.first_divergence
    assert (d.component, d.module, d.step, d.made_here) == ("unet", FAULTY, 0, True)
    assert dynamo_counts() == (0, 1) and pipe.unet is unet


def compile_decoder(vae, how: str) -> None:
    """``vae.decoder.compile()``, or each of its blocks compiled in place (regional: its ``conv_in``,
    ``conv_norm_out`` and ``conv_out`` stay eager, as ``compile_repeated_blocks`` leaves a model's ends)."""
    if how == "vae.decoder.compile()":
        vae.decoder.compile(backend="eager")
    else:
        for block in (*vae.decoder.up_blocks, vae.decoder.mid_block):
            block.compile(backend="eager")


def planted_conv_out(how: str):
    """A fresh tiny fp16 SD whose decoder is compiled ``how`` (:func:`compile_decoder`), and the factor that puts its
    ``conv_out``'s output at 61% of fp16's max (:func:`~diffusion_helpers.scaled`): the naive reference, the eager
    conv_out's abs-max read before anything is compiled."""
    pipe = fresh(torch.float16)
    peaks = []
    with pipe.vae.decoder.conv_out.register_forward_hook(lambda m, a, out: peaks.append(float(out.abs().amax()))):
        one_step(pipe)
    compile_decoder(pipe.vae, how)
    return pipe, 0.61 * torch.finfo(torch.float16).max / peaks[0]


def replays(dbg) -> list[str]:
    return [e["component"] for e in dbg.record.events if e["type"] == "replay"]


@pytest.mark.parametrize("how", ["vae.decoder.compile()", "its blocks compiled in place"])
def test_an_fp16_near_overflow_at_a_compiled_decoders_conv_out_is_named_there_by_one_eager_replay(how, tmp_path):
    """A compiled fp16 VAE decoder has no probe inside (its sentinel would be traced; the end modules' hooks too), so
    a near-max its ``conv_out`` (an end module) makes is seen at the decode's output, from the abs-max measured there
    anyway. It is named at ``decoder.conv_out`` by one eager replay of the kept decode with full probes, as its
    NaN/Inf is (vae37; before: ``vae.decoder`` output, 'its inside is not read', no module named), with the SD VAE's
    upcast advice; the next call's from that replay (the debugger's replay memory; a debugger made per call makes its
    own: one eager decode, on the finding alone, nothing kept with the pipeline). A clean call replays nothing
    (counted). No graph break or graph added, the images are the unwatched compiled twin's. Backend ``eager``:
    aot_eager fails on this tiny fp16 decoder without the debugger, compiled whole or by blocks (torch 2.13 on CPU,
    ``Expected X.is_contiguous(memory_format)`` in its group norm; test_compiled.py)."""
    pipe, factor = planted_conv_out(how)
    conv_out = pipe.vae.decoder.conv_out
    plain = one_step(pipe)
    with scaled(conv_out, factor):  # (its weight and bias: a compiled graph reads them, no recompile)
        twin = one_step(pipe)
    expected = dynamo_counts()
    assert expected[0] == 0 and expected[1] >= 1
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        np.testing.assert_array_equal(one_step(pipe), plain)
    assert replays(dbg) == [], "a clean compiled call was replayed"
    for _ in range(2):
        with scaled(conv_out, factor), dbg:
            np.testing.assert_array_equal(one_step(pipe), twin)
    assert dynamo_counts() == expected, "the debugger added a graph break or a graph"
    np.testing.assert_array_equal(one_step(pipe), plain)  # nothing left behind
    risks = [a for a in dbg.report().anomalies if a.kind == "overflow_risk"]
    assert [(a.component, a.module, a.step, a.details["localized_by"]) for a in risks] == [
        ("vae", "decoder.conv_out", None, REPLAYED),
        ("vae", "decoder.conv_out", None, "output check -> an earlier call's replay"),
    ]
    assert [a.details["run"] for a in risks] == [2, 3]
    for risk in risks:
        assert risk.details["dtype_max_fraction"] == pytest.approx(0.61, abs=1e-3)
        assert risk.message.startswith("vae.decoder.conv_out output reached 61% of the float16 maximum")
        assert risk.message.endswith(f"; {SD_FP16_VAE}.")
    assert replays(dbg) == ["vae"]
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()
    per_call = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / "per_call"), log_level="error"))
    with scaled(conv_out, factor), per_call:  # a debugger made per call: its own replay, on this finding only
        np.testing.assert_array_equal(one_step(pipe), twin)
    risks = [a for a in per_call.report().anomalies if a.kind == "overflow_risk"]
    assert [(a.module, a.details["localized_by"]) for a in risks] == [("decoder.conv_out", REPLAYED)]
    assert replays(per_call) == ["vae"] and dynamo_counts() == expected
    per_call.close()


def test_a_compiled_decoders_near_max_its_eager_replay_does_not_make_is_warned_at_its_output_every_call(tmp_path):
    """A forward hook added to ``conv_out`` after ``vae.decoder.compile()`` (quartering its output) is skipped by the
    compiled code and run by the eager replay: the compiled decode's output is at 61% of fp16's max, the replay's
    conv_out at 15%, so the replay names no module. The compiled output's own warning stands, at ``vae.decoder``, 'its
    inside is not read', in each of two calls (vae37 named nothing, or warned once and then read the values as passed
    in), from one replay (the replay memory: no module named, not replayed again); none on the clean call. Images
    the unwatched compiled twin's, dynamo's counters unchanged."""
    pipe, factor = planted_conv_out("vae.decoder.compile()")
    conv_out = pipe.vae.decoder.conv_out
    plain = one_step(pipe)
    quartered = []
    hook = conv_out.register_forward_hook(lambda m, a, out: quartered.append(float(out.abs().amax()) / 4) or out / 4)
    try:
        with scaled(conv_out, factor):
            twin = one_step(pipe)
            assert quartered == [], "the compiled decode ran the hook added after compiling"
        expected = dynamo_counts()
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
        with dbg:
            np.testing.assert_array_equal(one_step(pipe), plain)
        assert replays(dbg) == []
        for _ in range(2):
            with scaled(conv_out, factor), dbg:
                np.testing.assert_array_equal(one_step(pipe), twin)
        assert dynamo_counts() == expected, "the debugger added a graph break or a graph"
    finally:
        hook.remove()
    assert len(quartered) == 1 and quartered[0] / 65504 == pytest.approx(0.61 / 4, abs=1e-3)  # the replay's
    risks = [a for a in dbg.report().anomalies if a.kind == "overflow_risk"]
    assert [(a.component, a.module, a.details["localized_by"], a.details["run"]) for a in risks] == [
        ("vae", "decoder", COMPILED_OUTPUT, 2),
        ("vae", "decoder", COMPILED_OUTPUT, 3),
    ]
    absmax = risks[0].details["absmax"]
    assert absmax / 65504 == pytest.approx(0.61, abs=1e-3)
    assert [risk.message for risk in risks] == 2 * [
        f"vae.decoder output reached 61% of the float16 maximum (|x|={absmax:.3e}); vae is compiled: its inside is "
        "not read, so the module that made these values is not named, and an uncompiled replay of the call stayed "
        "below that (the compiled code computes otherwise: a hook it skips, a fused rounding); "
        f"{SD_FP16_VAE}."
    ]
    assert replays(dbg) == ["vae"]
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()


def one_step(pipe):
    """A 1-step fp16 call; its ``callback_on_step_end`` takes the debugger's step-end watch off before the decode
    (test_compiled.py's compiled decode: a global pre-hook dynamo would guard on)."""
    generator, same = torch.Generator().manual_seed(0), lambda pipe, step, timestep, kwargs: kwargs
    return pipe("a cat", num_inference_steps=1, output_type="np", generator=generator, callback_on_step_end=same)[0]


@pytest.mark.parametrize("hooked", [False, True], ids=["planted", "hook-after-compile"])
def test_a_compiled_text_encoders_near_max_is_named_by_its_replay_or_else_warned_at_its_output_every_call(
    hooked, tmp_path
):
    """``text_encoder.compile()``, its ``final_layer_norm`` at 61% of fp16's max: named there by one eager replay,
    the next call from it; with a forward hook quartering it added after compiling (skipped by the compiled code, run
    by the replay) the replay names nothing and the compiled output's warning stands at ``text_encoder`` (module
    ``""``), each of two calls, from the same one replay. Images the unwatched compiled twin's."""
    pipe = fresh(torch.float16)
    name = next(n for n, _ in pipe.text_encoder.named_modules() if n.endswith("final_layer_norm"))
    norm, peaks = pipe.text_encoder.get_submodule(name), []
    with norm.register_forward_hook(lambda m, a, out: peaks.append(float(out.abs().amax()))):
        one_step(pipe)
    factor = 0.61 * torch.finfo(torch.float16).max / max(peaks)
    pipe.text_encoder.compile(backend="eager")
    one_step(pipe)  # compiled at its first call: a hook there before it would be traced in
    hook = norm.register_forward_hook(lambda m, a, out: out / 4) if hooked else None
    try:
        with scaled(norm, factor):
            twin = one_step(pipe)
        expected = dynamo_counts()
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
        for _ in range(2):
            with scaled(norm, factor), dbg:
                np.testing.assert_array_equal(one_step(pipe), twin)
        assert dynamo_counts() == expected, "the debugger added a graph break or a graph"
    finally:
        if hook is not None:
            hook.remove()
    risks = [a for a in dbg.report().anomalies if a.kind == "overflow_risk"]
    named = [(name, REPLAYED), (name, "output check -> an earlier call's replay")]
    assert [(a.module, a.details["localized_by"]) for a in risks] == (2 * [("", COMPILED_OUTPUT)] if hooked else named)
    assert [a.details["run"] for a in risks] == [1, 2]
    assert [bool(a.details.get("eager_replay")) for a in risks] == [hooked, hooked]  # "an uncompiled replay ..."
    assert replays(dbg) == ["text_encoder"]
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()
