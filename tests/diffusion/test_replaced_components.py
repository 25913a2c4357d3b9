"""A reused debugger follows a component replaced between two watched calls (``pipe.unet = other``,
``pipe.vae.decoder = ...``, ``pipe.register_modules(vae=...)``, a new scheduler): the new module is
hooked and a fault it makes is named at its module and step; the old one is left with no hook of
ours and let go; each change is recorded (event ``component_replaced``); images stay bitwise the
unwatched pipeline's; a reused debugger with nothing replaced lists nothing again."""

from __future__ import annotations

import contextlib
import copy
import gc
import sys
import threading
import weakref

import pytest
import torch
from diffusers import AutoencoderKL, DDIMScheduler, EulerDiscreteScheduler
from diffusion_helpers import run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite, plant_overflow, tiny_pipeline

CONV = "up_blocks.1.resnets.0.conv2"


def debugger(pipe, tmp_path) -> DiffusionModelDebugger:
    """A debugger with one watched call behind it (the first call's full probes)."""
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        run(pipe, steps=2)
    return dbg


def with_nan_weight(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """A copy of ``module`` whose ``name`` conv has one NaN weight (a corrupted checkpoint)."""
    copied = copy.deepcopy(module)
    with torch.no_grad():
        copied.get_submodule(name).weight[0, 0, 0, 0] = float("nan")
    return copied


def hooks(module: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def errors(dbg, run_number: int, kind: str = "nonfinite"):
    return [
        a
        for a in dbg.report().anomalies
        if a.kind == kind and a.severity == "error" and a.details.get("run") == run_number
    ]


def replaced(dbg) -> list[tuple[str, str, str | None, str | None]]:
    return [
        (e["component"], e["change"], e["was"], e["now"])
        for e in dbg.record.events
        if e["type"] == "component_replaced"
    ]


@pytest.mark.usefixtures("only_the_tests_objects")  # its gc.collect() walks only what the test made
def test_a_unet_replaced_by_one_with_a_nan_weight_is_named_at_its_conv_and_step_and_the_old_one_let_go(tmp_path):
    pipe = tiny_pipeline("sd")
    dbg = debugger(pipe, tmp_path)
    old = pipe.unet
    pipe.unet = with_nan_weight(old, CONV)
    with dbg:
        assert hooks(old) == 0 and hooks(pipe.unet) > 0  # the new UNet is the one hooked
        run(pipe, steps=2)
    (error,) = errors(dbg, 2)
    assert (error.component, error.module, error.step) == ("unet", CONV, 0)
    assert error.details["localized_by"] == "output check -> replay with full probes"
    assert replaced(dbg) == [("unet", "replaced", "UNet2DConditionModel", "UNet2DConditionModel")]
    assert [c.module for c in dbg.components if c.name == "unet"] == [pipe.unet]
    assert hooks(old) == 0 and hooks(pipe.unet) == 0
    old = weakref.ref(old)
    gc.collect()
    assert old() is None  # nothing of the debugger's holds the UNet the pipeline let go of
    dbg.close()


def test_a_vae_decoder_replaced_inside_its_vae_is_hooked_and_its_nan_named(tmp_path):
    pipe = tiny_pipeline("sd")
    dbg = debugger(pipe, tmp_path)
    old = pipe.vae.decoder
    pipe.vae.decoder = with_nan_weight(old, CONV)
    with dbg:
        run(pipe, steps=2)
    (error,) = errors(dbg, 2)
    assert (error.component, error.module, error.step) == ("vae", f"decoder.{CONV}", None)
    assert replaced(dbg) == [("vae.decoder", "replaced", "Decoder", "Decoder")]
    assert hooks(old) == 0 and hooks(pipe.vae) == 0
    dbg.close()


def test_an_fp16_vae_registered_in_place_of_another_has_its_near_overflow_named(tmp_path):
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    dbg = debugger(pipe, tmp_path)
    old, vae = pipe.vae, tiny_pipeline("sd", seed=1, dtype=torch.float16).vae  # another fp16 VAE, loaded
    name = "decoder.up_blocks.0.upsamplers.0.conv"
    pipe.register_modules(vae=vae)
    with plant_overflow(vae.get_submodule(name), fraction=0.61), dbg:
        run(pipe, steps=2)
    (risk,) = [a for a in dbg.report().anomalies if a.kind == "overflow_risk" and a.details.get("run") == 2]
    assert (risk.component, risk.module, risk.step) == ("vae", name, None)
    assert risk.details["dtype_max_fraction"] == pytest.approx(0.61, abs=1e-3)
    assert not errors(dbg, 2)
    assert replaced(dbg) == [("vae", "replaced", "AutoencoderKL", "AutoencoderKL")]
    assert hooks(old) == 0 and hooks(vae) == 0
    dbg.close()


class _NaNFinalSigma(EulerDiscreteScheduler):
    """Euler whose last sigma is NaN once stepping begins: its last step makes NaN latents from a
    finite UNet output (the noise it starts from, ``init_noise_sigma``, is finite)."""

    def step(self, *args, **kwargs):
        self.sigmas[-1] = float("nan")
        return super().step(*args, **kwargs)


def test_a_swapped_scheduler_drives_the_step_rows_and_its_nan_is_named_at_the_scheduler(tmp_path):
    pipe = tiny_pipeline("sd")
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config)
    dbg = debugger(pipe, tmp_path)
    ddim = [float(t) for t in pipe.scheduler.timesteps]
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config, timestep_spacing="linspace")
    with dbg:
        run(pipe, steps=2)
    rows = [row for row in dbg.report().steps if row["run"] == 2]
    euler = pipe.scheduler
    assert [row["timestep"] for row in rows] == [float(t) for t in euler.timesteps] != ddim
    assert [row["sigma"] for row in rows] == pytest.approx([float(s) for s in euler.sigmas[:2]])
    pipe.scheduler = _NaNFinalSigma.from_config(euler.config)
    with dbg:
        run(pipe, steps=2)
    (error,) = errors(dbg, 3)
    assert (error.component, error.module, error.step) == ("scheduler", "step", 1)
    assert replaced(dbg) == [
        ("scheduler", "replaced", "DDIMScheduler", "EulerDiscreteScheduler"),
        ("scheduler", "replaced", "EulerDiscreteScheduler", "_NaNFinalSigma"),
    ]
    assert "step" not in vars(euler) and "step" not in vars(pipe.scheduler)  # no wrapper left on either
    dbg.close()


def swap_after_step(at: int, make):
    """A ``callback_on_step_end`` that puts ``make(pipe.scheduler)`` on the pipeline after step ``at``
    (its schedule set as the pipeline's was: the pipeline's loop goes on over its timesteps)."""

    def callback(pipe, i, t, kwargs):
        if i == at:
            old = pipe.scheduler
            new = make(old)
            new.set_timesteps(len(old.timesteps))
            pipe.scheduler = new
        return kwargs

    return callback


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "nan"])
def test_a_scheduler_swapped_inside_the_call_has_its_steps_recorded_and_its_nan_named(tmp_path, fault):
    """Replaced by the user's ``callback_on_step_end`` after step 0 (as a pipeline that swaps
    schedulers between stages does): steps 1 and 2 are the new scheduler's, recorded as the first
    one's were, and a NaN it makes (its last sigma) is named at the scheduler, at its step."""
    pipe = tiny_pipeline("sd")
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config, timestep_spacing="linspace")
    new_class = _NaNFinalSigma if fault else EulerDiscreteScheduler
    make = lambda old: new_class.from_config(old.config)  # noqa: E731
    dbg = debugger(pipe, tmp_path)
    first = pipe.scheduler
    with dbg:
        watched = run(pipe, steps=3, callback_on_step_end=swap_after_step(0, make))
    swapped = pipe.scheduler
    assert type(swapped) is new_class and swapped is not first
    rows = [row for row in dbg.report().steps if row["run"] == 2]
    assert [row["step"] for row in rows] == [0, 1, 2]
    assert [row["timestep"] for row in rows] == [float(t) for t in swapped.timesteps]
    assert [row["sigma"] for row in rows[1:]] == pytest.approx([float(s) for s in swapped.sigmas[1:3]])
    (event,) = [e for e in dbg.record.events if e["type"] == "component_replaced"]
    assert (event["was"], event["now"], event["step"], event["while_attached"]) == (
        "EulerDiscreteScheduler",
        new_class.__name__,
        1,
        True,
    )
    assert "step" not in vars(first) and "step" not in vars(swapped)  # no wrapper left on either
    assert type(swapped).step is new_class.step and EulerDiscreteScheduler.step is vars(EulerDiscreteScheduler)["step"]
    if fault:
        (error,) = errors(dbg, 2)
        assert (error.component, error.module, error.step) == ("scheduler", "step", 2)
    else:
        pipe.scheduler = first  # the unwatched call swaps the same way
        assert watched.tobytes() == run(pipe, steps=3, callback_on_step_end=swap_after_step(0, make)).tobytes()
        assert not [a for a in dbg.report().anomalies if a.severity == "error"]
    with dbg:  # the next attach: the swapped scheduler is the one held, not a change to record again
        run(pipe, steps=1)
    assert len([e for e in dbg.record.events if e["type"] == "component_replaced"]) == 1 + (not fault)
    dbg.close()


def test_a_scheduler_swapped_and_swapped_back_inside_the_call_records_each_step_once(tmp_path):
    """A stage's scheduler for step 1, then the first one again: each step is recorded once (the
    first scheduler's wrapper is not put on twice), each swap is one event at its step."""
    pipe = tiny_pipeline("sd")
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config, timestep_spacing="linspace")
    dbg = debugger(pipe, tmp_path)
    first, stage = pipe.scheduler, swap_after_step(0, lambda old: EulerDiscreteScheduler.from_config(old.config))

    def callback(pipe, i, t, kwargs):
        if i == 1:
            pipe.scheduler = first  # its step index is where the loop is (both schedulers' timesteps alike)
            first._step_index = 2
        return stage(pipe, i, t, kwargs)

    with dbg:
        watched = run(pipe, steps=3, callback_on_step_end=callback)
    rows = [row for row in dbg.report().steps if row["run"] == 2]
    assert [row["step"] for row in rows] == [0, 1, 2]
    events = [(e["was"], e["now"], e["step"]) for e in dbg.record.events if e["type"] == "component_replaced"]
    assert [step for *_, step in events] == [1, 2]
    assert pipe.scheduler is first and "step" not in vars(first)
    first._step_index = None
    assert watched.tobytes() == run(pipe, steps=3, callback_on_step_end=callback).tobytes()
    assert not [a for a in dbg.report().anomalies if a.severity == "error"]
    dbg.close()


def test_clean_replacements_are_quiet_and_the_images_bitwise_the_unwatched_pipeline_s(tmp_path):
    pipe = tiny_pipeline("sd")
    dbg = debugger(pipe, tmp_path)
    other = tiny_pipeline("sd", seed=1)
    pipe.unet, pipe.vae = other.unet, other.vae
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
    with dbg:
        watched = run(pipe, steps=2)
    plain = run(pipe, steps=2)
    assert watched.tobytes() == plain.tobytes()
    assert not [a for a in dbg.report().anomalies if a.severity == "error" or a.kind == "overflow_risk"]
    assert [c for c, *_ in replaced(dbg)] == ["unet", "vae", "scheduler"]
    dbg.close()


def test_a_reused_debugger_with_nothing_replaced_lists_nothing_again(tmp_path):
    pipe = tiny_pipeline("sd")
    dbg = debugger(pipe, tmp_path)
    with dbg:  # the first call set the pipeline's own call attributes: listed again once, found the same
        run(pipe, steps=1)
    held = dbg._held
    with dbg:
        run(pipe, steps=1)
    assert dbg._held is held  # the check at attach found every component where it was
    assert not replaced(dbg)
    dbg.close()


def test_a_modular_pipeline_s_unet_updated_in_place_of_another_is_named_at_its_conv(tmp_path):
    from diffusers.modular_pipelines.stable_diffusion_xl import StableDiffusionXLAutoBlocks

    pipe = StableDiffusionXLAutoBlocks().init_pipeline()
    pipe.update_components(**{k: v for k, v in tiny_pipeline("sdxl").components.items() if v is not None})
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))

    def call():
        with dbg:
            pipe(
                prompt="a cat", num_inference_steps=2, height=32, width=32, generator=torch.Generator().manual_seed(0)
            )

    call()
    old = pipe.unet
    pipe.update_components(unet=with_nan_weight(old, CONV))
    call()
    (error,) = errors(dbg, 2)
    assert (error.component, error.module, error.step) == ("unet", CONV, 0)
    assert replaced(dbg) == [("unet", "replaced", "UNet2DConditionModel", "UNet2DConditionModel")]
    assert hooks(old) == 0 and hooks(pipe.unet) == 0
    dbg.close()


def test_a_scheduler_swapped_between_two_calls_of_one_attach_has_its_schedule_read_as_a_new_attach_would(tmp_path):
    """``with dbg:`` around two calls, the scheduler swapped between them (comparing schedulers):
    the new one is followed from the second call's text encoder on, before the pipeline sets its
    timesteps, so its schedule is read (event ``set_timesteps``) and checked: its leading spacing
    with 3 steps is a ``scheduler_config`` warning in that run, as a debugger attached anew finds."""
    pipe = tiny_pipeline("sd")
    first = EulerDiscreteScheduler.from_config(pipe.scheduler.config, timestep_spacing="trailing")
    leading = DDIMScheduler.from_config(pipe.scheduler.config, timestep_spacing="leading")
    pipe.scheduler = first
    found = []
    for attach_anew in (False, True):
        pipe.scheduler = first
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / str(attach_anew)), log_level="error"))
        with dbg:
            run(pipe, steps=3)
            pipe.scheduler = leading
            if attach_anew:
                dbg.detach()
                dbg.attach()
            run(pipe, steps=3)
        timesteps = [e["first_timestep"] for e in dbg.record.events if e["type"] == "set_timesteps"]
        warned = [(a.kind, a.details.get("rule")) for a in dbg.report().anomalies if a.kind == "scheduler_config"]
        found.append((timesteps, warned, "step" in vars(leading), "set_timesteps" in vars(leading)))
        dbg.close()
    assert found[0] == found[1]
    timesteps, warned, *left = found[0]
    assert len(timesteps) == 2 and len(warned) == 1 and left == [False, False]


def put_unet_after_step(at: int, unet: torch.nn.Module):
    """A ``callback_on_step_end`` that puts ``unet`` on the pipeline after step ``at``."""

    def callback(pipe, i, t, kwargs):
        if i == at:
            pipe.unet = unet
        return kwargs

    return callback


def test_a_unet_swapped_inside_the_call_is_hooked_from_its_first_call_and_its_fault_named_at_its_conv(tmp_path):
    """``pipe.unet = other`` in the user's ``callback_on_step_end`` after step 0: the callback's seam
    (the one-shot global pre-hook) fires at its first call (step 1), hooks it and runs its call
    site's pre-hook there (torch read the UNet's pre-hooks before ours ran), so every step has its
    denoiser call (an Inf from its third call named at its conv, at step 3), the change is recorded
    at step 1, the old UNet is left with no hook of ours, and the next attach lists nothing again.
    The image is bitwise the unwatched pipeline's."""
    pipe = tiny_pipeline("sd")
    old, new = pipe.unet, copy.deepcopy(pipe.unet)
    dbg = debugger(pipe, tmp_path)
    with dbg, plant_nonfinite(new.get_submodule(CONV), from_call=2):
        run(pipe, steps=4, callback_on_step_end=put_unet_after_step(0, new))
        assert hooks(old) == 0 and hooks(new) > 1  # the new UNet is the one hooked (and planted), while attached
    assert hooks(new) == 0
    (error,) = errors(dbg, 2)
    assert (error.component, error.module, error.step) == ("unet", CONV, 3)
    rows = [row for row in dbg.report().steps if row["run"] == 2]
    assert [row["denoiser_calls"] for row in rows] == [1, 1, 1, 1]
    (event,) = [e for e in dbg.record.events if e["type"] == "component_replaced"]
    assert (event["component"], event["step"], event["while_attached"]) == ("unet", 1, True)
    pipe.unet = old
    with dbg:
        clean = run(pipe, steps=3, callback_on_step_end=put_unet_after_step(0, new))
    pipe.unet = old
    assert clean.tobytes() == run(pipe, steps=3, callback_on_step_end=put_unet_after_step(0, new)).tobytes()
    assert len([e for e in dbg.record.events if e["type"] == "component_replaced"]) == 3  # old -> new, new -> old
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()


def test_a_unet_swapped_in_a_callback_that_encodes_a_new_prompt_is_recorded_and_named_at_the_next_step(tmp_path):
    """``pipe.unet = other`` and ``pipe.encode_prompt`` (a prompt switched) in the callback after step 0: the change,
    found as the prompt is encoded, is recorded at step 1, the first step the new UNet runs (it was step None), and
    the NaN of its first call is named at its conv at step 1."""
    pipe = tiny_pipeline("sd")
    new = copy.deepcopy(pipe.unet)

    def callback(pipe, i, t, kwargs):
        if i == 0:
            pipe.unet = new
            embeds, negative = pipe.encode_prompt("a dog", "cpu", 1, True, negative_prompt="")
            kwargs["prompt_embeds"] = torch.cat([negative, embeds])
        return kwargs

    dbg = debugger(pipe, tmp_path)
    with dbg, plant_nonfinite(new.get_submodule(CONV), value=float("nan")):
        run(pipe, steps=3, callback_on_step_end=callback, callback_on_step_end_tensor_inputs=["prompt_embeds"])
    (event,) = [e for e in dbg.record.events if e["type"] == "component_replaced"]
    assert (event["component"], event["step"], event["while_attached"]) == ("unet", 1, True)
    (error,) = errors(dbg, 2)
    assert (error.component, error.module, error.step) == ("unet", CONV, 1)
    dbg.close()


def unknown_module_call(monkeypatch) -> None:
    """The step-end seam as under a torch whose module call it does not know (no ``inner`` frame to
    read a call's kwargs from): a replaced call site's first call is left unhooked, as before it could."""
    from diffusion_debug.diffusion.components import step_end

    monkeypatch.setattr(step_end, "_CALL_INNER", None)


def test_a_nan_from_the_first_call_of_a_unet_swapped_inside_the_call_is_named_at_its_conv(tmp_path):
    """The swapped-in UNet's first call (step 1) is hooked before it runs (its call site's pre-hook
    run by the seam, with the call's kwargs): its NaN is named at its conv at step 1, by the replay of
    that call, as a UNet hooked from the start would be (it was the UNet alone, with no module named
    and the call marked unwatched)."""
    pipe = tiny_pipeline("sd")
    new = copy.deepcopy(pipe.unet)
    dbg = debugger(pipe, tmp_path)
    with dbg, plant_nonfinite(new.get_submodule(CONV), value=float("nan")):
        run(pipe, steps=3, callback_on_step_end=put_unet_after_step(0, new))
    (error,) = errors(dbg, 2)
    assert (error.component, error.module, error.step) == ("unet", CONV, 1)
    assert error.details["localized_by"] == "output check -> replay with full probes"
    assert error.message.startswith(f"unet.{CONV} produced NaN/Inf from finite inputs")
    (event,) = [e for e in dbg.record.events if e["type"] == "component_replaced"]
    assert (event["component"], event["step"], event["while_attached"]) == ("unet", 1, True)
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()


def test_a_nan_from_the_first_call_of_a_unet_swapped_inside_the_call_says_that_call_was_not_watched(
    tmp_path, monkeypatch
):
    """Where the seam cannot run the swapped-in UNet's pre-hooks (:func:`unknown_module_call`), its
    first call (step 1) runs before anything of ours hooks it: its NaN is named at the UNet, at that
    step, and the text says why no module is named (the UNet was replaced during the call, its first
    call unwatched), not that localize is off, nor that the UNet made it from finite inputs (that
    call's inputs were not checked)."""
    unknown_module_call(monkeypatch)
    pipe = tiny_pipeline("sd")
    new = copy.deepcopy(pipe.unet)
    dbg = debugger(pipe, tmp_path)
    with dbg, plant_nonfinite(new.get_submodule(CONV), value=float("nan")):
        run(pipe, steps=3, callback_on_step_end=put_unet_after_step(0, new))
    (error,) = errors(dbg, 2)
    assert (error.component, error.module, error.step) == ("unet", "", 1)
    assert error.details["localized_by"] == (
        "output check (unet was replaced during the call, at step 1: its first call ran before it was hooked, "
        "so no module inside it was watched; its next call's would be localised)"
    )
    assert error.message == (  # not "produced NaN/Inf from finite inputs": its inputs were never seen
        "unet's output held NaN/Inf in its first call after it was replaced during the pipeline's call (step 1): "
        "that call ran before the debugger hooked it, so whether its inputs were finite is not known and no module "
        "inside it is named; its later calls are watched (check unet's dtype and weights)."
    )
    (event,) = [e for e in dbg.record.events if e["type"] == "component_replaced"]
    assert (event["component"], event["step"], event["while_attached"]) == ("unet", 1, True)
    dbg.close()


def put_unet_and_scheduler_after_step(at: int, unet: torch.nn.Module):
    """A ``callback_on_step_end`` that puts ``unet`` and a new Euler scheduler (its schedule set as the
    pipeline's was) on the pipeline after step ``at``, in one go."""

    def callback(pipe, i, t, kwargs):
        if i == at:
            new = EulerDiscreteScheduler.from_config(pipe.scheduler.config)
            new.set_timesteps(len(pipe.scheduler.timesteps))
            pipe.unet, pipe.scheduler = unet, new
        return kwargs

    return callback


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "nan"])
def test_a_unet_and_scheduler_swapped_in_one_callback_are_followed_from_the_unet_s_first_call(tmp_path, fault):
    """Both replaced after step 0: the seam hooks the new UNet at its first call (step 1) and the
    new scheduler is followed from that denoiser call, so every step is recorded and a NaN the new
    UNet makes is named at its conv at step 1; clean, the image is the unwatched pipeline's."""
    pipe = tiny_pipeline("sd")
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config, timestep_spacing="linspace")
    first_unet, first_scheduler, new = pipe.unet, pipe.scheduler, copy.deepcopy(pipe.unet)
    dbg = debugger(pipe, tmp_path)
    with dbg, plant_nonfinite(new.get_submodule(CONV), value=float("nan")) if fault else contextlib.nullcontext():
        watched = run(pipe, steps=3, callback_on_step_end=put_unet_and_scheduler_after_step(0, new))
    events = [(e["component"], e["step"]) for e in dbg.record.events if e["type"] == "component_replaced"]
    assert events == [("unet", 1), ("scheduler", 1)]
    rows = [(row["step"], row["denoiser_calls"]) for row in dbg.report().steps if row["run"] == 2]
    assert rows == [(0, 1), (1, 1), (2, 1)]
    assert hooks(first_unet) == 0 and hooks(new) == 0 and "step" not in vars(pipe.scheduler)
    if fault:
        (error,) = errors(dbg, 2)
        assert (error.component, error.module, error.step) == ("unet", CONV, 1)
    else:
        pipe.unet, pipe.scheduler = first_unet, first_scheduler
        assert (
            watched.tobytes()
            == run(pipe, steps=3, callback_on_step_end=put_unet_and_scheduler_after_step(0, new)).tobytes()
        )
        assert not [a for a in dbg.report().anomalies if a.severity == "error"]
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()


@pytest.mark.parametrize("fault", [False, True], ids=["clean", "nan"])
def test_a_unet_and_scheduler_swapped_in_one_callback_are_recorded_at_the_vae_and_followed_from_the_next_call(
    tmp_path, fault, monkeypatch
):
    """Both replaced after step 0, where the seam cannot hook the UNet before its call
    (:func:`unknown_module_call`): no hook of ours runs in steps 1 and 2 (the new UNet is unhooked,
    the new scheduler's ``step`` unwrapped), so they are not recorded; the VAE's call, the first of
    ours, records both changes at step 1, and a NaN the VAE receives is said to come from the steps
    that ran unwatched (not from the pipeline's own code). The pipeline's next call in the same
    attach is watched throughout: its NaN named at the conv, at step 0."""
    unknown_module_call(monkeypatch)
    pipe = tiny_pipeline("sd")
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config, timestep_spacing="linspace")
    first_unet, first_scheduler, new = pipe.unet, pipe.scheduler, copy.deepcopy(pipe.unet)
    dbg = debugger(pipe, tmp_path)
    with dbg, plant_nonfinite(new.get_submodule(CONV), value=float("nan")) if fault else contextlib.nullcontext():
        watched = run(pipe, steps=3, callback_on_step_end=put_unet_and_scheduler_after_step(0, new))
        again = run(pipe, steps=3)
    events = [
        (e["component"], e["step"], e["while_attached"])
        for e in dbg.record.events
        if e["type"] == "component_replaced"
    ]
    assert events == [("scheduler", 1, True), ("unet", 1, True)]
    rows = [(row["run"], row["step"], row["denoiser_calls"]) for row in dbg.report().steps if row["run"] > 1]
    assert rows == [(2, 0, 1), (3, 0, 1), (3, 1, 1), (3, 2, 1)]
    assert hooks(first_unet) == 0 and hooks(new) == 0 and "step" not in vars(pipe.scheduler)
    if fault:
        (unwatched,) = errors(dbg, 2)
        assert (unwatched.component, unwatched.step, unwatched.details["localized_by"]) == (
            "pipeline",
            1,
            "replaced during the call",
        )
        assert unwatched.message == (
            "vae received NaN/Inf after scheduler and unet were replaced during the call at step 1: their steps ran "
            "unwatched (nothing the debugger hooks ran in the loop after it), so the module that made it is not "
            "known; the pipeline's next call with them is watched."
        )
        (error,) = errors(dbg, 3)
        assert (error.component, error.module, error.step) == ("unet", CONV, 0)
    else:
        pipe.unet, pipe.scheduler = first_unet, first_scheduler
        assert (
            watched.tobytes()
            == run(pipe, steps=3, callback_on_step_end=put_unet_and_scheduler_after_step(0, new)).tobytes()
        )
        assert again.tobytes() == run(pipe, steps=3).tobytes()
        assert not [a for a in dbg.report().anomalies if a.severity == "error"]
    dbg.close()


def put_vae_after_step(at: int, vae: torch.nn.Module):
    """A ``callback_on_step_end`` that puts ``vae`` on the pipeline after step ``at``."""

    def callback(pipe, i, t, kwargs):
        if i == at:
            pipe.vae = vae
        return kwargs

    return callback


@pytest.mark.parametrize("at", [0, 2], ids=["first", "last"])
def test_a_vae_swapped_inside_the_call_is_hooked_before_it_decodes_and_its_nan_named_at_its_conv(tmp_path, at):
    """``pipe.vae = other`` in the callback after step 0 or after the LAST step (2) of 3: the
    callback's seam (a one-shot global pre-hook, armed at each step of a call that passed a callback)
    finds it at the next module call, before the decode (after the last step nothing else of ours
    runs before it: the VAE decoded unwatched and its NaN went unnamed), and hooks it, so its
    decode's NaN is named at its conv, the pipeline's VAE, the change recorded at the step after
    the callback; nothing is left armed after the call, and the image is bitwise the unwatched
    pipeline's when clean."""
    pipe = tiny_pipeline("sd")
    old = pipe.vae
    bad = with_nan_weight(old, f"decoder.{CONV}")
    dbg = debugger(pipe, tmp_path)
    with dbg:
        run(pipe, steps=3, callback_on_step_end=put_vae_after_step(at, bad))
        assert not torch.nn.modules.module._global_forward_pre_hooks  # disarmed at the module call it watched
    (error,) = errors(dbg, 2)
    assert (error.component, error.module, error.step) == ("vae", f"decoder.{CONV}", None)
    assert pipe.vae is bad and error.message.startswith(f"vae.decoder.{CONV} produced NaN/Inf from finite inputs")
    (event,) = [e for e in dbg.record.events if e["type"] == "component_replaced"]
    assert (event["component"], event["step"], event["while_attached"]) == ("vae", at + 1, True)
    assert hooks(old) == 0 and hooks(bad) == 0
    pipe.vae = old
    clean = copy.deepcopy(old)
    with dbg:
        watched = run(pipe, steps=3, callback_on_step_end=put_vae_after_step(at, clean))
    pipe.vae = old
    assert watched.tobytes() == run(pipe, steps=3, callback_on_step_end=put_vae_after_step(at, clean)).tobytes()
    assert not errors(dbg, 3)
    dbg.close()


def test_a_vae_without_post_quant_conv_swapped_after_the_last_step_is_hooked_at_its_decoder_s_call(tmp_path):
    """A Flux-style VAE (``use_post_quant_conv=False``) put on the pipeline in the LAST step's
    callback: the first module its decode calls is the ``decoder``, its call site, whose pre-hooks
    torch read before the seam's global pre-hook hooked it; the seam runs the call site's new
    pre-hook itself (with the call's arguments), so its NaN is named at its conv (it decoded
    unwatched, nothing recorded) and the change recorded at step 3; clean, the image is bitwise the
    unwatched pipeline's."""
    pipe = tiny_pipeline("sd")
    old = pipe.vae
    config = {k: v for k, v in old.config.items() if not k.startswith("_")}
    torch.manual_seed(0)
    flux_style = AutoencoderKL.from_config(config, use_post_quant_conv=False)
    assert flux_style.post_quant_conv is None
    bad = with_nan_weight(flux_style, f"decoder.{CONV}")
    dbg = debugger(pipe, tmp_path)
    with dbg:
        run(pipe, steps=3, callback_on_step_end=put_vae_after_step(2, bad))
        assert not torch.nn.modules.module._global_forward_pre_hooks
    (error,) = errors(dbg, 2)
    assert (error.component, error.module, error.step) == ("vae", f"decoder.{CONV}", None)
    assert error.message.startswith(f"vae.decoder.{CONV} produced NaN/Inf from finite inputs")
    assert replaced(dbg) == [("vae", "replaced", "AutoencoderKL", "AutoencoderKL")]
    assert hooks(old) == 0 and hooks(bad) == 0
    pipe.vae = old
    with dbg:
        watched = run(pipe, steps=3, callback_on_step_end=put_vae_after_step(2, flux_style))
    assert dbg.report().components["vae"]["calls"] >= 1 and pipe.vae is flux_style
    pipe.vae = old
    assert watched.tobytes() == run(pipe, steps=3, callback_on_step_end=put_vae_after_step(2, flux_style)).tobytes()
    assert not errors(dbg, 3)
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()


def test_a_failure_of_the_step_end_watch_is_a_debugger_error_and_the_call_runs_on(tmp_path, monkeypatch):
    """The watch runs inside the user's module call (a global pre-hook): an error of ours there is
    recorded as a ``debugger_error`` at ``component_replaced``, not raised into the pipeline's call,
    whose image is the unwatched call's."""
    from diffusion_debug.diffusion.components import step_end

    def broken(pipe):
        raise RuntimeError("planted")

    pipe = tiny_pipeline("sd")
    old, other = pipe.vae, copy.deepcopy(pipe.vae)
    dbg = debugger(pipe, tmp_path)
    monkeypatch.setattr(step_end, "find_components", broken)
    with dbg:
        watched = run(pipe, steps=2, callback_on_step_end=put_vae_after_step(1, other))
    monkeypatch.undo()
    (error,) = [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    assert (error.details["where"], error.step) == ("component_replaced", 2)
    pipe.vae = old
    assert watched.tobytes() == run(pipe, steps=2, callback_on_step_end=put_vae_after_step(1, other)).tobytes()
    assert not torch.nn.modules.module._global_forward_pre_hooks
    dbg.close()


def test_an_fp16_vae_swapped_inside_the_call_has_its_near_overflow_named(tmp_path):
    """An fp16 VAE put on the pipeline after step 0: its decode's near-overflow is named at its
    module, as one registered between calls is."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    old, vae = pipe.vae, tiny_pipeline("sd", seed=1, dtype=torch.float16).vae
    name = "decoder.up_blocks.0.upsamplers.0.conv"
    dbg = debugger(pipe, tmp_path)
    with plant_overflow(vae.get_submodule(name), fraction=0.61), dbg:
        run(pipe, steps=3, callback_on_step_end=put_vae_after_step(0, vae))
    (risk,) = [a for a in dbg.report().anomalies if a.kind == "overflow_risk" and a.details.get("run") == 2]
    assert (risk.component, risk.module, risk.step) == ("vae", name, None)
    assert risk.details["dtype_max_fraction"] == pytest.approx(0.61, abs=1e-3)
    assert not errors(dbg, 2)
    assert replaced(dbg) == [("vae", "replaced", "AutoencoderKL", "AutoencoderKL")]
    assert hooks(old) == 0 and hooks(vae) == 0
    dbg.close()


def test_a_scheduler_step_evaluated_at_a_pdb_breakpoint_in_the_pipeline_leaves_its_locals_as_they_were(tmp_path):
    """Stopped by pdb at the first ``scheduler.step`` line of the pipeline's ``__call__``, the user
    evaluates that step (``p self.scheduler.step(...)``): the step-end watch reads the call's frame
    there (is a ``callback_on_step_end`` passed?). On Python 3.11 it emptied that frame's locals
    dict, which pdb writes back into the frame after each of its commands: every local of the
    pipeline's call was unbound (``UnboundLocalError: 'self'``). The call now runs on as the same
    pdb session does without the debugger, to the same image."""
    import io
    import pdb

    from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion

    source = pipeline_stable_diffusion.__file__
    with open(source) as lines:
        line = next(n for n, text in enumerate(lines, 1) if "latents = self.scheduler.step(" in text)
    commands = (
        f"b {source}:{line}\nc\n"
        "p self.scheduler.step(noise_pred, t, latents, **extra_step_kwargs, return_dict=False)[0].shape\n"
        f"cl {source}:{line}\nc\n"
    )

    def under_pdb():
        # nosigint: its `c` would leave pdb's SIGINT handler on the process (Ctrl-C of a later test)
        session = pdb.Pdb(stdin=io.StringIO(commands), stdout=io.StringIO(), nosigint=True)
        session.use_rawinput = False
        try:
            return session.runcall(run, pipe, steps=2, callback_on_step_end=put_vae_after_step(9, None))
        finally:
            sys.settrace(None)

    pipe = tiny_pipeline("sd")
    plain = under_pdb()
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        watched = under_pdb()
    assert watched.tobytes() == plain.tobytes()
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    dbg.close()


def test_a_module_called_on_another_thread_between_the_last_step_and_its_callback_leaves_the_watch_armed(tmp_path):
    """A served process: another thread runs a model of its own while this pipeline's last step
    ends (here inside the callback, before it puts a VAE with a NaN weight on the pipeline). That
    thread's module call is not this pipeline's next one: the watch (a global pre-hook) stays armed
    for this thread's, so the new VAE is hooked before it decodes and its NaN named at its conv.
    It fired on the other thread's call and took itself off there, the swap after it unseen: the
    NaN was named at no module."""
    pipe = tiny_pipeline("sd")
    bad = with_nan_weight(pipe.vae, f"decoder.{CONV}")
    other = torch.nn.Linear(2, 2)

    def callback(pipe, i, t, kwargs):
        if i == 2:
            thread = threading.Thread(target=other, args=(torch.ones(1, 2),))
            thread.start()
            thread.join()
            pipe.vae = bad
        return kwargs

    dbg = debugger(pipe, tmp_path)
    with dbg:
        run(pipe, steps=3, callback_on_step_end=callback)
    (error,) = errors(dbg, 2)
    assert (error.component, error.module, error.step) == ("vae", f"decoder.{CONV}", None)
    assert not torch.nn.modules.module._global_forward_pre_hooks
    dbg.close()
