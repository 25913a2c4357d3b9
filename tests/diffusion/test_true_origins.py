"""Origins that are true: ``input`` only for what the user passed, the user's step-end callback
for what it put into the loop, and a debugger that sees only its own pipeline's calls.

Long because FreeInit's passes (two runs of one call) have their origin cases here beside one loop's."""

from __future__ import annotations

import dis
import inspect

import numpy as np
import pytest
import torch
from diffusion_helpers import run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline


def errors(report):
    return [a for a in report.anomalies if a.severity == "error"]


def test_a_nan_the_callback_returned_is_the_callbacks_at_its_step(pipes, tmp_path):
    pipe = pipes["sd"]

    def callback(p, i, t, kwargs):
        if i == 1:  # the end of step 1: the loop's latents become NaN
            return {"latents": torch.full_like(kwargs["latents"], float("nan"))}
        return {}

    with DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path))) as dbg:
        run(pipe, steps=4, callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["latents"])
    (error,) = errors(dbg.report())
    assert (error.component, error.module, error.step) == ("callback", "callback_on_step_end", 1)
    assert "callback_on_step_end passed to the pipeline put NaN/Inf into the loop at the end of step 1" in (
        error.message
    )
    assert error.details["seen_at_step"] == 2
    later = [a for a in dbg.report().anomalies if a.severity == "warning" and a.kind == "nonfinite"]
    assert later and all(a.details["origin"] == error.where() for a in later)
    dbg.close()


def test_without_a_callback_the_loops_own_latents_are_not_taken_for_an_input(pipes, tmp_path):
    """A NaN the loop made after the user's call started (here: a planted step-end write that is
    not a callback) is not the user's input: ``latents`` was not passed."""
    pipe = pipes["sd"]
    calls = {"n": 0}

    def poisoned_step(*args, **kwargs):  # wraps the debugger's wrapper: after the step was recorded
        out = step(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 1:
            out[0][0, 0, 0, 0] = float("nan")  # SD calls step(..., return_dict=False)
        return out

    with DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path))) as dbg:
        step = pipe.scheduler.step  # the debugger's wrapper
        pipe.scheduler.step = poisoned_step  # the pipeline's own code between two steps, as far as it can tell
        try:
            run(pipe, steps=3)
        finally:
            del pipe.scheduler.step  # this test's instance attribute: the class's (watched) method shows again
    (error,) = errors(dbg.report())
    assert (error.component, error.module, error.step) == ("pipeline", "", 1)
    assert "no watched component and no pipeline input made" in error.message
    dbg.close()


def test_a_passed_non_finite_latents_is_the_input(pipes, tmp_path):
    pipe = pipes["sd"]
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    latents[0, 0, 0, 0] = float("inf")
    with DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path))) as dbg:
        run(pipe, steps=2, latents=latents)
    (error,) = errors(dbg.report())
    assert (error.component, error.module) == ("input", "latents")
    dbg.close()


def test_freeinits_second_pass_in_one_call_is_not_an_input_and_follows_the_first_passs_nan(tmp_path):
    """AnimateDiff's FreeInit denoises the call's latents a second time in the same call (a second
    ``set_timesteps``: a second run): a NaN the UNet made in the first pass reaches the second through
    the loop's latents, which the user never passed. The UNet's module stays the one error and the
    headline; the second pass's findings count at it or point at it (it had named ``input latents`` the
    headline)."""
    pipe = tiny_pipeline("animatediff")
    pipe.enable_free_init(num_iters=2, use_fast_sampling=False)

    def call():
        generator = torch.Generator().manual_seed(0)
        kwargs = dict(num_frames=2, height=32, width=32, num_inference_steps=2, output_type="pt")
        return pipe("a cat", generator=generator, **kwargs).frames

    expected = call()
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        assert torch.equal(call(), expected)
    conv = "up_blocks.1.resnets.0.conv2"
    with plant_nonfinite(pipe.unet.get_submodule(conv), from_call=1), dbg:  # the first pass's step 1
        call()
    report = dbg.report()
    assert [(a.component, a.module, a.step, a.details["run"]) for a in errors(report)] == [("unet", conv, 1, 3)]
    assert (report.headline.component, report.headline.module) == ("unet", conv)
    assert (errors(report)[0].details["count"], errors(report)[0].details["last_step"]) == (3, 1)  # + pass 2's
    second = [a for a in report.anomalies if a.kind == "nonfinite" and a.details["run"] == 4]
    assert {a.component for a in second} == {"vae"}  # (the UNet's: counted at the origin, as a later step's)
    assert all(a.details["origin"] == f"unet {conv}, step 1 (t=1)" for a in second)
    assert torch.equal(call(), expected)
    dbg.close()


def test_a_freeinit_calls_runs_share_its_origin_but_the_next_call_of_the_attach_starts_afresh(tmp_path):
    """The runs of one FreeInit call share its arguments and NaN/Inf origin; the call after it (same
    attach) does not: a NaN the UNet makes in the second pass alone is that run's error (the first pass
    left no origin), and NaN ``latents=`` passed to the next call are that call's input, both passes
    (a call counter that did not move between calls folded them under the UNet of the call before)."""
    pipe = tiny_pipeline("animatediff")
    pipe.enable_free_init(num_iters=2, use_fast_sampling=False)
    bad = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    bad[0, 0, 0, 0, 0] = float("nan")

    def call(**kwargs):
        kwargs.update(num_frames=2, height=32, width=32, num_inference_steps=2, output_type="pt")
        return pipe("a cat", generator=torch.Generator().manual_seed(0), **kwargs).frames

    conv = "up_blocks.1.resnets.0.conv2"
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        with plant_nonfinite(pipe.unet.get_submodule(conv), from_call=2):  # the second pass's step 0
            call()
        call(latents=bad)
    report = dbg.report()
    found = [(a.component, a.module, a.step, a.details["run"]) for a in errors(report)]
    assert found == [("unet", conv, 0, 2), ("input", "latents", 0, 3)]
    later = [a.details["origin"] for a in report.anomalies if a.kind == "nonfinite" and a.details["run"] == 4]
    assert later and set(later) == {"input latents, step 0 (t=501)"}
    dbg.close()


def freeinit_pipe():
    """The tiny AnimateDiff with FreeInit's two passes (each a run of its own) and a call of it."""
    pipe = tiny_pipeline("animatediff")
    pipe.enable_free_init(num_iters=2, use_fast_sampling=False)

    def call(**kwargs):
        kwargs.update(num_frames=2, height=32, width=32, num_inference_steps=2, output_type="pt")
        return pipe("a cat", generator=torch.Generator().manual_seed(0), **kwargs).frames

    return pipe, call


@pytest.mark.parametrize("nan_at", [0, 1])
def test_a_nan_the_callback_returns_at_the_end_of_freeinits_first_pass_is_the_callbacks(tmp_path, nan_at):
    """A step-end callback that puts NaN into the latents is named the callback's at the step it ended,
    the first pass's last step too: FreeInit's second pass begins with those latents (its step 0), where
    the callback rule had no step before to blame and named the pipeline's own code. A callback that
    returns nothing leaves the FreeInit call quiet."""
    pipe, call = freeinit_pipe()
    ended = []

    def callback(p, i, t, kwargs):
        ended.append(i)
        if len(ended) == nan_at + 1:  # the first pass's step nan_at (1: its last)
            return {"latents": torch.full_like(kwargs["latents"], float("nan"))}
        return {}

    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        call(callback_on_step_end=lambda p, i, t, kwargs: {}, callback_on_step_end_tensor_inputs=["latents"])
    assert [a.kind for a in dbg.report().anomalies] == ["scheduler_config"]  # (the tiny schedule's 2 steps)
    with dbg:
        call(callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["latents"])
    assert ended == [0, 1, 0, 1]
    report = dbg.report()
    (error,) = errors(report)
    where = ("nonfinite", "callback", "callback_on_step_end", nan_at)
    assert (error.kind, error.component, error.module, error.step) == where
    assert (error.details["run"], error.details["seen_at_step"]) == (3, (nan_at + 1) % 2)  # the first pass's run
    assert report.headline is error
    later = [a for a in report.anomalies if a.kind == "nonfinite" and a is not error]
    assert {a.component for a in later} == {"unet", "vae"}
    assert all(a.severity == "warning" and a.details["origin"] == error.where() for a in later)
    assert error.where() == f"callback callback_on_step_end, step {nan_at}"
    seen = "at step 0 of the next pass;" if nan_at else "at step 1;"  # the second pass's step 0, or the next step
    assert f"into the loop at the end of step {nan_at}: scheduler.step returned finite latents" in error.message
    assert f"and unet received non-finite values {seen}" in error.message
    dbg.close()


def test_freeinits_second_pass_folds_under_the_first_passs_origin_in_by_cause_as_within_one_loop(tmp_path):
    """What the UNet's NaN does in FreeInit's second pass counts at the first pass's origin, as a
    later step's does within one loop (one entry, its count and last step), not as entries of its
    own: by_cause holds the origin, the VAE's decode (after the last pass) and the latents' jump once."""
    pipe, call = freeinit_pipe()
    conv = "up_blocks.1.resnets.0.conv2"
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with plant_nonfinite(pipe.unet.get_submodule(conv), from_call=1), dbg:  # the first pass's step 1 on
        call()
    report = dbg.report()
    found = [
        (a.kind, a.severity, a.component, a.module, a.step, a.details.get("run"), a.details["count"])
        for a in report.by_cause()
    ]
    assert found == [
        ("nonfinite", "error", "unet", conv, 1, 1, 3),  # pass 1's step 1, pass 2's steps 0 and 1
        ("nonfinite", "warning", "vae", "", None, 2, 1),
        ("scheduler_config", "warning", "", "", None, None, 1),
        ("latent_divergence", "warning", "", "", 1, 1, 3),
    ]
    assert report.headline.details["last_step"] == 1
    assert report.by_cause()[1].details["origin"] == f"unet {conv}, step 1 (t=1)"
    dbg.close()


def test_a_freeinit_origins_repeat_in_the_second_pass_says_its_run_beside_its_last_step(tmp_path):
    """A repeat in FreeInit's second pass folds under the first pass's origin with the second pass's step
    number; the entry says that step's run (``last_run``), in summary.json and report.html too: a callback
    that cleans the latents, the UNet's NaN at the first pass's step 1 and again at the second pass's step 0
    read "first at step 1, last at step 0" (backwards, in one run as far as the entry said)."""
    from diffusion_debug.record.run_dir import rebuild_summary
    from diffusion_debug.report.html_anomalies import _repeats

    pipe, call = freeinit_pipe()
    conv, ended = "up_blocks.1.resnets.0.conv2", []

    def nan_at_step_1_and_pass_2s_step_0(module, args, output):
        if len(ended) in (1, 2):  # (the step-end callbacks so far: the step it is)
            return torch.full_like(output, float("nan"))

    def clean(p, i, t, kwargs):
        ended.append(i)
        return {"latents": torch.nan_to_num(kwargs["latents"], nan=0.0)}

    handle = pipe.unet.get_submodule(conv).register_forward_hook(nan_at_step_1_and_pass_2s_step_0)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", probes="full"))
    with dbg:
        call(callback_on_step_end=clean, callback_on_step_end_tensor_inputs=["latents"])
    handle.remove()
    (error,) = errors(report := dbg.report())
    assert (error.module, error.step, error.details["run"]) == (conv, 1, 1)
    assert (error.details["count"], error.details["last_step"], error.details["last_run"]) == (2, 0, 2)
    assert _repeats(error) == " · seen 2 times, last at step 0 of run 2"
    rebuilt = [a["details"] for a in rebuild_summary(report.save())["anomalies"] if a["severity"] == "error"]
    assert [(d["count"], d["last_step"], d["last_run"]) for d in rebuilt] == [(2, 0, 2)]  # (from events.jsonl)
    dbg.close()


def test_each_debugger_sees_only_its_own_pipelines_calls_when_components_are_shared(pipes, tmp_path):
    from diffusers import StableDiffusionImg2ImgPipeline

    t2i = pipes["sd"]
    i2i = StableDiffusionImg2ImgPipeline(**t2i.components)
    i2i.set_progress_bar_config(disable=True)
    image = np.full((1, 64, 64, 3), 0.5, dtype=np.float32)
    plain_t2i = run(t2i, steps=4)
    plain_i2i = run(i2i, steps=4, image=image, strength=0.5)  # 2 denoising steps
    first = DiffusionModelDebugger(t2i, DebugConfig(output_dir=str(tmp_path / "t2i")))
    second = DiffusionModelDebugger(i2i, DebugConfig(output_dir=str(tmp_path / "i2i")))
    with first, second:
        watched_t2i = run(t2i, steps=4)
        watched_i2i = run(i2i, steps=4, image=image, strength=0.5)
    np.testing.assert_array_equal(watched_t2i, plain_t2i)
    np.testing.assert_array_equal(watched_i2i, plain_i2i)
    assert [row["step"] for row in first.report().steps] == [0, 1, 2, 3]
    assert [row["step"] for row in second.report().steps] == [0, 1]
    assert first.report().components["unet"]["calls"] == 4
    assert second.report().components["unet"]["calls"] == 2
    assert first.get_summary()["runs"] == second.get_summary()["runs"] == 1
    first.close()
    second.close()


def test_a_nan_the_vae_encode_makes_before_the_schedule_is_the_runs_one_error_in_every_call(tmp_path):
    # Marigold keeps its empty prompt's embedding after its first call: from then on the VAE's encode of the
    # image is a call's first event, before set_timesteps. A NaN it makes reaches the UNet (concatenated to the
    # noise), which is that NaN's consequence, not the pipeline's own arithmetic; the same on a reused debugger
    from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
    from diffusion_debug.testing.features import kind_missing
    from diffusion_debug.testing.zoo_recent import ZOO_CALLS

    if kind_missing("marigold_depth"):
        pytest.skip(kind_missing("marigold_depth"))
    pipe = tiny_pipeline("marigold_depth")
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with plant_nonfinite(pipe.vae.encoder.conv_in, value=float("nan")), dbg:
        for _ in range(2):
            pipe(**ZOO_CALLS["marigold_depth"][0](), num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    found = [(a.component, a.module, a.details.get("run")) for a in errors(dbg.report())]
    assert found == [("vae", "encoder.conv_in", 1), ("vae", "encoder.conv_in", 2)]
    dbg.close()


def test_a_nan_an_encoder_made_passed_back_by_the_user_at_a_later_call_is_the_encoders(pipes, tmp_path):
    """``pipe.encode_prompt`` (its text encoder making a NaN) under one attach, its embeddings passed to two calls:
    the first is the encoding's run, the second a new run, whose error names the text encoder's module and the run
    that made it, the input as the way it came (before: ``input prompt_embeds``); a clone passed is a new value, the
    user's input."""
    from diffusion_debug.testing import plant_nonfinite

    pipe = pipes["sd"]
    module = next(n for n, _ in pipe.text_encoder.named_modules() if n.endswith("layers.0.mlp.fc1"))
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        with plant_nonfinite(pipe.text_encoder.get_submodule(module), value=float("nan")):
            embeds, negative = pipe.encode_prompt("a cat", "cpu", 1, True, negative_prompt="")
        for passed in ((embeds, negative), (embeds, negative), (embeds.clone(), negative.clone())):
            run(pipe, steps=1, prompt=None, prompt_embeds=passed[0], negative_prompt_embeds=passed[1])
    found = [(a.component, a.module, a.details.get("run"), a.details.get("passed_as")) for a in errors(dbg.report())]
    made = module  # as this transformers names it (CLIP flat in transformers 5, under text_model before)
    assert found == [
        ("text_encoder", made, 1, None),
        ("text_encoder", made, 1, ["prompt_embeds", "negative_prompt_embeds"]),  # run 2's: made in run 1
        ("input", "prompt_embeds", 3, None),  # clones: new values, the user's
    ]
    assert errors(dbg.report())[1].message == (
        f"text_encoder.{made} made NaN/Inf in run 1 (pipe.encode_prompt), and it was passed back to a later call as "
        "prompt_embeds=, negative_prompt_embeds= (first seen by unet); fix text_encoder."
        f"{made} (check its dtype, inputs and weights; try float32 or bfloat16), not the input."
    )
    assert dbg.report().by_cause()[0].details.get("passed_as") is None  # run 1's: the first place it was made
    dbg.close()


def test_a_nan_an_encoder_made_under_fp16_autocast_passed_back_later_is_advised_about_autocast(pipes, tmp_path):
    """The float32 text encoder's NaN made under float16 autocast, its embeddings passed back to a later call: the
    encoding's error advises autocast (its float16 output, float32 weights), and the later call's error, which
    names the same module, said "try float32 or bfloat16" (it is float32, and autocast computed it in float16): it
    advises autocast as the error it points at does."""
    pipe = pipes["sd"]
    made = next(n for n, _ in pipe.text_encoder.named_modules() if n.endswith("layers.0.mlp.fc1"))
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with torch.autocast("cpu", dtype=torch.float16):
        # planted before the debugger's hooks (its first run reads the encoder fully): they read the NaN as returned
        with plant_nonfinite(pipe.text_encoder.get_submodule(made), value=float("nan")), dbg:
            embeds, negative = pipe.encode_prompt("a cat", "cpu", 1, True, negative_prompt="")
        with dbg:  # the encoding's run, then a new one
            for _ in range(2):
                run(pipe, steps=1, prompt=None, prompt_embeds=embeds, negative_prompt_embeds=negative)
    found = [(a.component, a.module, a.details.get("run"), a.details.get("passed_as")) for a in errors(dbg.report())]
    passed_as = ["prompt_embeds", "negative_prompt_embeds"]
    assert found == [("text_encoder", made, 1, None), ("text_encoder", made, 1, passed_as)]  # run 2's: made in run 1
    autocast = (
        "it ran under float16 autocast (its weights are float32): autocast to bfloat16 instead (torch.autocast(..., "
        f"dtype=torch.bfloat16)) or run text_encoder.{made} outside autocast."
    )
    first, passed_back = errors(dbg.report())
    assert first.message == f"text_encoder.{made} produced NaN/Inf from finite inputs; {autocast}"
    assert passed_back.message == (
        f"text_encoder.{made} made NaN/Inf in run 1 (pipe.encode_prompt), and it was passed back to a later call as "
        f"prompt_embeds=, negative_prompt_embeds= (first seen by unet); fix text_encoder.{made}, not the input; "
        + autocast
    )
    dbg.close()


def test_latents_a_call_returned_with_the_unets_nan_passed_to_the_next_call_are_the_unets(pipes, tmp_path):
    """A call's ``output_type="latent"`` latents, made non-finite by the UNet at step 1, passed as ``latents=`` to
    the next call: run 2's error is the UNet's conv at step 1 of run 1, the latents the way it came."""
    from diffusion_debug.testing import plant_nonfinite

    pipe, conv = pipes["sd"], "up_blocks.1.resnets.0.conv2"
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        with plant_nonfinite(pipe.unet.get_submodule(conv), value=float("nan"), from_call=1):
            latents = run(pipe, steps=2, output_type="latent")
        run(pipe, steps=2, latents=latents)
    found = [
        (a.component, a.module, a.step, a.details.get("run"), a.details.get("passed_as")) for a in errors(dbg.report())
    ]
    assert found == [("unet", conv, 1, 1, None), ("unet", conv, 1, 1, ["latents"])]
    assert "(pipe(...)), and it was passed back to a later call as latents=" in errors(dbg.report())[1].message
    dbg.close()


def test_a_nan_calls_latents_and_images_are_let_go_as_it_returns_and_what_it_returned_still_names_the_maker(
    pipes, tmp_path
):
    """A call whose UNet makes a NaN, the debugger left attached: its images and its frame's other tensors (the
    prompt embeddings) are freed once the user lets go of them (before: its ``__call__`` frame, with every local,
    was held until the next run); its last latents, kept by the user's callback and passed back, name the UNet."""
    import gc
    import weakref

    from diffusion_debug.testing import plant_nonfinite

    pipe, conv, seen = pipes["sd"], "up_blocks.1.resnets.0.conv2", {}

    def keep(pipe, step, timestep, tensors):
        seen["latents"], seen["embeds"] = tensors["latents"], weakref.ref(tensors["prompt_embeds"])
        return {}

    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    dbg.attach()
    with plant_nonfinite(pipe.unet.get_submodule(conv), value=float("nan"), from_call=1):
        images = weakref.ref(
            run(
                pipe,
                steps=2,
                output_type="pt",
                callback_on_step_end=keep,
                callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"],
            )
        )
    gc.collect()
    assert (images(), seen["embeds"]()) == (None, None)
    run(pipe, steps=2, latents=seen["latents"])
    found = [(a.component, a.module, a.step, a.details.get("passed_as")) for a in errors(dbg.report())]
    assert found == [("unet", conv, 1, None), ("unet", conv, 1, ["latents"])]
    dbg.close()


def test_what_a_call_returns_after_an_early_maybe_free_model_hooks_still_names_the_maker(pipes, tmp_path):
    """A pipeline that calls ``maybe_free_model_hooks`` before its end (as ``StableDiffusionImageVariationPipeline``
    does before its VAE decode): what it returns is made after that call; passed back to the next call, it is
    still the UNet's NaN, not the user's input."""
    from diffusion_debug.testing import plant_nonfinite

    pipe, conv = pipes["sd"], "up_blocks.1.resnets.0.conv2"
    plain = type(pipe)

    class FreesBeforeItsEnd(plain):
        def __call__(self, *args, **kwargs):
            latents = super().__call__(*args, output_type="latent", **kwargs).images
            self.maybe_free_model_hooks()  # as the image-variation pipeline before its decode
            image = latents * 1  # (its decoded image): made after
            return image

    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    pipe.__class__ = FreesBeforeItsEnd
    try:
        dbg.attach()
        with plant_nonfinite(pipe.unet.get_submodule(conv), value=float("nan"), from_call=1):
            returned = pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    finally:
        pipe.__class__ = plain
    run(pipe, steps=2, latents=returned)
    found = [(a.component, a.module, a.step, a.details.get("passed_as")) for a in errors(dbg.report())]
    dbg.close()
    assert found == [("unet", conv, 1, None), ("unet", conv, 1, ["latents"])]


def test_a_call_that_frees_its_models_twice_lets_go_of_its_latents_as_it_returns_and_still_names_the_maker(
    pipes, tmp_path
):
    """A ``__call__`` that frees its models before its decode and again at its end (as the image-variation pipeline
    does), its UNet making a NaN: read at its last free (before: its frame held until the next run), its latents are
    freed once the user drops what it returned, and what it returned, passed back, still names the UNet."""
    import gc
    import weakref

    from diffusion_debug.testing import plant_nonfinite

    pipe, conv, seen = pipes["sd"], "up_blocks.1.resnets.0.conv2", {}
    plain = type(pipe)

    class FreesTwice(plain):
        def __call__(self, *args, **kwargs):
            latents = super().__call__(*args, output_type="latent", **kwargs).images
            seen["latents"] = weakref.ref(latents)
            self.maybe_free_model_hooks()  # before its decode
            image = latents * 1  # (its decoded image)
            self.maybe_free_model_hooks()
            return (image,)

    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    pipe.__class__ = FreesTwice
    try:
        dbg.attach()
        with plant_nonfinite(pipe.unet.get_submodule(conv), value=float("nan"), from_call=1):
            (returned,) = pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    finally:
        pipe.__class__ = plain
    gc.collect()
    assert seen["latents"]() is None
    run(pipe, steps=2, latents=returned)
    found = [(a.component, a.module, a.step, a.details.get("passed_as")) for a in errors(dbg.report())]
    dbg.close()
    assert found == [("unet", conv, 1, None), ("unet", conv, 1, ["latents"])]


def test_a_call_is_read_as_it_frees_its_models_only_where_it_returns_next():
    """:func:`returns_next` on diffusers' own ``__call__`` code: the pipelines that end as Stable Diffusion's does
    (free, then return a tuple or an output class) are read there; one that frees twice (the image-variation
    pipeline: before its decode and at its end) or computes after freeing is held until it returned."""
    import diffusers

    from diffusion_debug.diffusion.components.made import returns_next

    def code(cls):
        return inspect.unwrap(cls.__call__).__code__

    def frees_then_computes(self, latents):
        self.maybe_free_model_hooks()
        return latents * 1

    def frees_then_returns(self, image, return_dict):
        self.maybe_free_model_hooks()
        if not return_dict:
            return (image,)
        return image

    def denoises_in_a_with_block(self, latents, return_dict):  # 3.12 puts the block's handler after the last return
        with self.progress_bar(total=1):
            latents = [step for step in latents]  # (an inlined comprehension's handler too, on 3.12)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (latents,)
        return ImagePipelineOutput(images=latents)  # noqa: F821

    def frees_at(code):  # the offset of each maybe_free_model_hooks call (the caller's f_lasti as it runs is in it)
        ops = list(dis.get_instructions(code))
        found = [i for i, op in enumerate(ops) if op.argval == "maybe_free_model_hooks"]
        return [next(op.offset for op in ops[i:] if op.opname.startswith("CALL")) for i in found]

    def returns_a_local_a_closure_holds(self, latents, return_dict):  # (Marigold's, before 3.12: LOAD_DEREF)
        scaled = [lambda: latents]
        self.maybe_free_model_hooks()
        if not return_dict:
            return (latents, scaled)
        return ImagePipelineOutput(images=latents)  # noqa: F821

    names = ["StableDiffusionPipeline", "StableDiffusionXLPipeline", "FluxPipeline", "MarigoldDepthPipeline"]
    assert [returns_next(code(getattr(diffusers, name))) for name in names] == [True, True, True, True]
    assert returns_next(returns_a_local_a_closure_holds.__code__) is True
    if hasattr(diffusers, "LTX2ImageToVideoPipeline"):  # its output class's name index past 255: an EXTENDED_ARG first
        assert returns_next(code(diffusers.LTX2ImageToVideoPipeline)) is True
    variation = code(diffusers.StableDiffusionImageVariationPipeline)
    assert returns_next(variation) is False
    assert [returns_next(variation, offset) for offset in frees_at(variation)] == [False, True]  # at its end: read
    assert [returns_next(f.__code__) for f in (frees_then_computes, frees_then_returns)] == [False, True]
    assert returns_next(denoises_in_a_with_block.__code__) is True  # (3.12: the handlers were read as computing)


def test_embeddings_the_user_called_encode_prompt_made_are_let_go_as_it_returns_and_still_name_the_encoder(
    pipes, tmp_path
):
    """``pipe.encode_prompt`` called by the user, its text encoder making a NaN: the embeddings the user drops are
    freed (before: its frame, with every local, held until the next run); the ones kept and passed back to a later
    run name the encoder."""
    import gc
    import weakref

    from diffusion_debug.testing import plant_nonfinite

    pipe = pipes["sd"]
    module = next(n for n, _ in pipe.text_encoder.named_modules() if n.endswith("layers.0.mlp.fc1"))
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        with plant_nonfinite(pipe.text_encoder.get_submodule(module), value=float("nan")):
            embeds, negative = pipe.encode_prompt("a cat", "cpu", 1, True, negative_prompt="")
        dropped = weakref.ref(embeds)
        del embeds
        gc.collect()
        assert dropped() is None
        for _ in range(2):  # the encoding's run, then a run of its own
            run(pipe, steps=1, prompt="a cat", negative_prompt_embeds=negative)
    found = [(a.component, a.module, a.details.get("run"), a.details.get("passed_as")) for a in errors(dbg.report())]
    assert found == [
        ("text_encoder", module, 1, None),
        ("text_encoder", module, 1, ["negative_prompt_embeds"]),
    ]  # run 2
    dbg.close()


def test_a_call_policy_raise_stops_lets_go_of_its_latents_at_the_raise(pipes, tmp_path):
    """Policy ``raise`` at step 1 (the UNet's NaN), the error caught inside ``with dbg:``: the call's latents and
    embeddings are freed at the raise (before: its frame held by the NaN's maker and the busy check until the next
    event of ours); the next call is a run of its own, clean."""
    import gc
    import weakref

    from diffusion_debug import DiffusionDebugError
    from diffusion_debug.testing import plant_nonfinite

    pipe, conv, seen = pipes["sd"], "up_blocks.1.resnets.0.conv2", {}

    def keep(pipe, step, timestep, tensors):
        seen["latents"], seen["embeds"] = weakref.ref(tensors["latents"]), weakref.ref(tensors["prompt_embeds"])
        return {}

    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", policy="raise"))
    with dbg:
        with plant_nonfinite(pipe.unet.get_submodule(conv), value=float("nan"), from_call=1):
            with pytest.raises(DiffusionDebugError):
                run(
                    pipe,
                    steps=2,
                    callback_on_step_end=keep,
                    callback_on_step_end_tensor_inputs=["latents", "prompt_embeds"],
                )
        gc.collect()
        assert (seen["latents"](), seen["embeds"]()) == (None, None)
        run(pipe, steps=1)
    found = [(a.component, a.module, a.step, a.details.get("run")) for a in errors(dbg.report())]
    assert found == [("unet", conv, 1, 1)]
    assert [row.get("run", 1) for row in dbg.report().steps][-1] == 2
    dbg.close()
