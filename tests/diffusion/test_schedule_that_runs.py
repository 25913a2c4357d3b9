"""Schedule checks read the schedule that runs: img2img's ``strength`` cuts the schedule that
``set_timesteps`` made, and starting partly denoised is then the point, not a mistake; custom
timesteps were not picked by ``timestep_spacing``; the ``steps_offset`` rule fires only for a model family it knows."""

from __future__ import annotations

import pytest
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion import setup_checks
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.zoo import ZOO_CALLS


@pytest.fixture(scope="module")
def img2img():
    return tiny_pipeline("img2img")


def scheduler_warnings(pipe, tmp_path, **call):
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tmp_path, log_level="error"))
    with dbg:
        pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="latent")
    dbg.close()
    report = dbg.report()
    return [
        (a.details["rule"], a.details.get("first_timestep")) for a in report.anomalies if a.kind == "scheduler_config"
    ]


def test_img2img_with_strength_gets_no_warning_about_a_timestep_that_never_ran(img2img, tmp_path):
    img2img.scheduler.set_timesteps(2)
    assert img2img.scheduler.timesteps.tolist() == [501, 1]  # leading spacing; strength 0.8 keeps only t=1
    call = {**ZOO_CALLS["img2img"][0](), "strength": 0.8}
    assert scheduler_warnings(img2img, tmp_path, **call) == []


def test_img2img_at_full_strength_is_warned_at_the_timestep_that_ran(img2img, tmp_path):
    call = {**ZOO_CALLS["img2img"][0](), "strength": 1.0}  # the whole schedule runs, from t=501
    assert scheduler_warnings(img2img, tmp_path, **call) == [("leading_spacing_few_steps", 501.0)]


def test_custom_timesteps_are_not_judged_by_their_spacing(tmp_path):
    from diffusers import EulerDiscreteScheduler

    pipe = tiny_pipeline("sd")
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)  # takes custom timesteps
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tmp_path, log_level="error"))
    with dbg:
        pipe("a cat", timesteps=[501, 1], generator=torch.Generator().manual_seed(0), output_type="latent")
    dbg.close()
    assert [a for a in dbg.report().anomalies if a.kind == "scheduler_config"] == []


def test_steps_offset_advice_names_the_family_it_was_made_for_and_others_get_none():
    from diffusers import DDIMScheduler

    scheduler = DDIMScheduler(steps_offset=0)
    scheduler.set_timesteps(2)
    assert scheduler.timesteps.tolist() == [500, 0]
    assert setup_checks.schedule_end(scheduler) == 0.0

    def advice(pipe_class):
        pipe = type(pipe_class, (), {})()
        family = setup_checks.trained_family(pipe)
        (found,) = [
            a.message
            for a in setup_checks.scheduler_config(scheduler, last_timestep=0.0, family=family)
            if a.details["rule"] == "steps_offset"
        ]
        return found

    assert advice("StableDiffusionImg2ImgPipeline") == (
        "DDIMScheduler has timestep_spacing='leading' with steps_offset=0, so the last step lands on t=0 "
        "instead of t=1 as Stable Diffusion was trained; set steps_offset=1."
    )
    for other in ("PixArtAlphaPipeline", "CogVideoXPipeline", "IFPipeline"):  # trained otherwise, or unknown
        family = setup_checks.trained_family(type(other, (), {})())
        assert setup_checks.scheduler_config(scheduler, last_timestep=0.0, family=family) == []


def test_stock_deepfloyd_if_ends_at_t0_as_its_own_scheduler_says_and_gets_no_steps_offset_warning(tmp_path):
    """IF stage I ships a ``leading`` DDPM schedule with ``steps_offset=0``: its schedule ends at t=0
    as the model was made to, so a stock run is not told to set ``steps_offset=1``."""
    from diffusion_debug.testing.zoo_more import CALLS

    pipe = tiny_pipeline("deepfloyd_if")
    assert (pipe.scheduler.config.timestep_spacing, pipe.scheduler.config.steps_offset) == ("leading", 0)
    ran = []
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tmp_path, log_level="error"))
    with dbg:
        pipe(
            **CALLS["deepfloyd_if"][0](),
            num_inference_steps=20,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
            callback=lambda i, t, latents: ran.append(int(t)),  # IF has the older callback only
        )
    dbg.close()
    assert ran[-1] == 0 and len(ran) == 20
    assert [a.details for a in dbg.report().anomalies if a.kind == "scheduler_config"] == []


def test_a_scheduler_that_ignores_steps_offset_is_judged_by_the_schedule_that_runs(tmp_path):
    """LCMScheduler's default config says ``leading`` with ``steps_offset=0``, but its schedule never
    reads ``steps_offset``: 2 steps run at t=999 and t=499, nowhere near t=0. DDIM with the same
    setting ends at t=0 and is warned, once per debugger."""
    from diffusers import DDIMScheduler, LCMScheduler

    pipe = tiny_pipeline("sd")
    ran = []
    pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config, steps_offset=0)
    assert (pipe.scheduler.config.timestep_spacing, pipe.scheduler.config.steps_offset) == ("leading", 0)
    call = {"prompt": "a cat", "callback_on_step_end": lambda p, i, t, kw: ran.append(int(t)) or {}}
    assert scheduler_warnings(pipe, tmp_path / "lcm", **call) == []
    assert ran == [999, 499]

    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, steps_offset=0)
    ran.clear()
    assert scheduler_warnings(pipe, tmp_path / "ddim", **call) == [
        ("steps_offset", None),
        ("leading_spacing_few_steps", 500.0),
    ]
    assert ran == [500, 0]


def test_a_schedule_no_step_followed_whose_init_noise_sigma_is_no_number_is_recorded_not_raised(tmp_path):
    """``set_timesteps`` with no step after it (the user's own, here) leaves its schedule to be read
    when the record is next flushed (``report()``, a VAE call, the call's end, detach): a scheduler's
    ``init_noise_sigma`` that is no number fails that read, which is the debugger's, recorded as a
    ``debugger_error``, never raised into the user's code."""
    pipe = tiny_pipeline("sd")
    pipe.scheduler.init_noise_sigma = "one"
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tmp_path, log_level="error"))
    with dbg:
        pipe.scheduler.set_timesteps(2)
        report = dbg.report()  # flushes: the schedule read here
    assert [(a.kind, a.details["where"]) for a in report.anomalies] == [("debugger_error", "set_timesteps")]
    assert pipe.scheduler.timesteps.tolist() == [501, 1] and pipe.scheduler.init_noise_sigma == "one"
    dbg.close()
