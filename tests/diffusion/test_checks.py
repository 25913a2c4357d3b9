"""diffusion/checks.py: prompt truncation, scheduler / dtype rules, VAE saturation, latent divergence — on values,
and through the debugger on tiny pipelines (the overflow checks: test_checks_overflow.py)."""

from __future__ import annotations

import pytest
import torch
from diffusion_helpers import SDXL_FP16_VAE, plant, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion import checks, setup_checks
from diffusion_debug.report import write_html
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline

UNET_LEAF = "up_blocks.1.resnets.0.conv2"


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def kinds(report, kind):
    return [a for a in report.anomalies if a.kind == kind]


def test_long_prompt_is_reported_truncated(pipes, tmp_path):
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
    with dbg:
        run(pipe, steps=2, prompt=" ".join(["photo"] * 100), negative_prompt="blurry")
    (anomaly,) = kinds(dbg.report(), "prompt_truncated")
    # 100 words + BOS + EOS = 102 tokens; 77 kept (BOS, 75 words, EOS): 25 words dropped
    assert anomaly.component == "text_encoder" and anomaly.details["dropped_tokens"] == 25
    assert anomaly.details["dropped_text"] == " ".join(["photo"] * 25)
    assert anomaly.details["prompt_role"] == "prompt"


@pytest.mark.parametrize("make", ["clip", "t5"])
def test_a_prompt_left_untokenized_could_not_have_been_truncated(make):
    """The truncation check skips tokenizing a prompt of at most (max_length - special tokens) / 2
    UTF-8 bytes: the bound holds for byte-level BPE and unigram tokenizers on words they know,
    words they spell out, other scripts and emoji."""
    from diffusion_debug.testing.text_encoders import WORDS, clip_tokenizer, t5_tokenizer

    tokenizer = clip_tokenizer() if make == "clip" else t5_tokenizer(WORDS)
    texts = ["", "a", "a photo of a cat", "zxqv wvut", "ÄÖÜ ß çà", "猫の写真", "🐱🐱 🚀", " ".join(WORDS), "a  b\tc\n"]
    texts += [text * 3 for text in texts]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
        assert len(ids) <= 2 * len(text.encode("utf-8")) + tokenizer.num_special_tokens_to_add(), text
        budget = len(ids) - 1  # one token too many: the bound must never call this text safe
        assert not setup_checks.fits_for_sure(tokenizer, text, budget)
        if setup_checks.fits_for_sure(tokenizer, text, 77):
            assert setup_checks.count_dropped_tokens(tokenizer, text, 77) == (0, "")
    assert setup_checks.count_dropped_tokens(tokenizer, "photo " * 60, 16)[0] > 0


def test_scheduler_config_rules(tmp_path):
    from diffusers import DDIMScheduler

    pipe = tiny_pipeline("sd")
    pipe.scheduler = DDIMScheduler.from_config(
        pipe.scheduler.config, rescale_betas_zero_snr=True, prediction_type="epsilon", timestep_spacing="leading"
    )
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
    with dbg:
        run(pipe, steps=2)
    rules = sorted(a.details["rule"] for a in kinds(dbg.report(), "scheduler_config"))
    assert rules == ["leading_spacing_few_steps", "zero_snr_epsilon", "zero_snr_spacing"]
    good = DDIMScheduler.from_config(
        pipe.scheduler.config, rescale_betas_zero_snr=True, prediction_type="v_prediction", timestep_spacing="trailing"
    )
    assert setup_checks.scheduler_config(good, num_inference_steps=4, first_timestep=999) == []


def test_a_reused_debugger_checks_the_setup_again_at_the_attach_after_what_the_checks_read_changed(tmp_path):
    """The static checks are skipped at an attach where nothing they read changed since a quiet
    pass (issue 45); the scheduler's config changed in place, a new scheduler and new component
    dtypes are each found at the next attach, by the rule or check they trip."""
    from diffusers import DDIMScheduler

    pipe = tiny_pipeline("sd")
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))

    def attach():
        with dbg:
            pass
        found = dbg.report().anomalies
        return [(a.kind, a.details.get("rule") or a.details.get("half_dtypes")) for a in found]

    assert attach() == [] and attach() == []
    pipe.scheduler.register_to_config(
        rescale_betas_zero_snr=True, prediction_type="epsilon", timestep_spacing="trailing"
    )
    assert attach() == [("scheduler_config", "zero_snr_epsilon")]
    pipe.scheduler = DDIMScheduler.from_config(
        pipe.scheduler.config, rescale_betas_zero_snr=True, prediction_type="v_prediction", timestep_spacing="leading"
    )
    assert attach()[1:] == [("scheduler_config", "zero_snr_spacing")]
    pipe.scheduler = DDIMScheduler.from_config(pipe.scheduler.config, rescale_betas_zero_snr=False)
    assert len(attach()) == 2  # quiet again
    pipe.unet.to(torch.float16)
    pipe.text_encoder.to(torch.bfloat16)
    assert attach()[2:] == [("dtype_mismatch", {"unet": "float16", "text_encoder": "bfloat16"})]
    dbg.close()


def test_a_leading_start_cut_by_a_step_count_that_does_not_divide_the_schedule_is_not_told_more_steps():
    """300 leading steps start at t=898 (299 x 3 + 1): more steps is no fix (333 start at 997, 350 at 700)."""
    from diffusers import DDIMScheduler

    leading = DDIMScheduler(timestep_spacing="leading", steps_offset=1)
    leading.set_timesteps(300)
    first = float(leading.timesteps[0])
    (anomaly,) = setup_checks.scheduler_config(leading, num_inference_steps=300, first_timestep=first)
    assert anomaly.message == (
        "With 300 steps and timestep_spacing='leading' the first step is t=898 of 1000, so sampling starts from a "
        "partly denoised level and images look washed out; set timestep_spacing='trailing' or a step count that "
        "divides 1000."
    )


def test_one_leading_step_is_said_in_the_singular():
    from diffusers import DDIMScheduler

    leading = DDIMScheduler(timestep_spacing="leading", steps_offset=1)
    (anomaly,) = setup_checks.scheduler_config(leading, num_inference_steps=1, first_timestep=1)
    assert anomaly.message == (
        "With 1 step and timestep_spacing='leading' the first step is t=1 of 1000, so sampling starts from a partly "
        "denoised level and images look washed out; set timestep_spacing='trailing' or use more steps."
    )


def test_dtype_mismatch_fp16_sdxl_vae_without_upcast():
    pipe = tiny_pipeline("sdxl", dtype=torch.float16)
    pipe.vae.register_to_config(force_upcast=False)
    found = setup_checks.dtype_mismatch(
        pipe, {"unet": "float16", "vae": "float16", "text_encoder": "bfloat16"}, "unet"
    )
    assert [a.component for a in found] == ["vae", "unet"]
    assert found[0].details["reads_force_upcast"] is True  # StableDiffusionXLPipeline.__call__ reads it
    assert found[0].message == (
        "The SDXL VAE is float16 with force_upcast=False, and the stock SDXL VAE overflows in float16 (black or NaN "
        f"images); {SDXL_FP16_VAE}."
    )


def test_vae_saturation_and_flat_images(pipes, tmp_path):
    pipe = pipes["sd"]
    with plant(pipe.vae.decoder, 0, lambda out: out * 0 + 3.0):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
        with dbg:
            run(pipe, steps=2)
    (saturated,) = kinds(dbg.report(), "vae_saturation")
    assert saturated.details["outside_fraction"] == 1.0
    (constant,) = kinds(dbg.report(), "constant_image")  # a flat image that is not NaN has its own kind
    assert constant.details["flat_images"] == [0] and constant.severity == "warning"
    # a float32 decode: no fp16 advice (before: "often a black image from an fp16 VAE: keep the VAE in float32...")
    assert constant.details["vae_dtype"] == "float32"
    assert constant.message == (
        "1 decoded image(s) are a single flat colour; vae ran in float32, so this is no half-precision "
        "overflow: check the latents' scaling factor, the latents reaching it (the step table) and its weights."
    )


def test_a_nan_image_is_not_called_saturated_it_points_at_the_nan_origin(pipes, tmp_path):
    # every decoded pixel is NaN because the UNet produced an Inf: that is the UNet's error and a
    # vae warning pointing at it, not a saturation that blames the latent scaling or the VAE dtype
    pipe = pipes["sd"]
    with plant_nonfinite(pipe.unet.get_submodule(UNET_LEAF)):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
        with dbg:
            run(pipe, steps=2)
    report = dbg.report()
    assert not kinds(report, "vae_saturation") and not kinds(report, "constant_image")
    origin, *passed_on = kinds(report, "nonfinite")
    assert (origin.severity, origin.component, origin.module, origin.step) == ("error", "unet", UNET_LEAF, 0)
    assert [(a.severity, a.component) for a in passed_on] == [("warning", "vae")]
    assert f"unet {UNET_LEAF}, step 0" in passed_on[0].message


def test_the_same_fault_in_two_pipeline_runs_is_two_anomalies_each_naming_its_run(pipes, tmp_path):
    pipe = pipes["sd"]
    with plant_nonfinite(pipe.unet.get_submodule(UNET_LEAF)):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
        with dbg:
            run(pipe, steps=2)
            run(pipe, steps=2)
    origins = [a for a in kinds(dbg.report(), "nonfinite") if a.severity == "error"]
    assert [(a.module, a.step, a.details["run"]) for a in origins] == [(UNET_LEAF, 0, 1), (UNET_LEAF, 0, 2)]
    page = write_html(dbg.report().save(html=False)).read_text(encoding="utf-8")
    assert "repeated 2 times, in pipeline runs 1–2, at step 0<" in page


def test_latent_divergence_check_values():
    from diffusion_debug.stats import tensor_stats

    assert checks.expected_latent_std(14.6, 14.6) == pytest.approx((1 + 14.6**2) ** 0.5)
    assert checks.expected_latent_std(0.5, 1.0) == 1.0
    big = tensor_stats(torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)) * 50)
    (a,) = checks.latent_divergence(big, expected_std=1.0, tolerance=4.0, step=3, timestep=10.0)
    assert a.severity == "warning" and a.details["std"] == pytest.approx(big.std)
    nan = tensor_stats(torch.tensor([1.0, float("nan")]))
    (b,) = checks.latent_divergence(nan, expected_std=1.0, tolerance=4.0, step=0, timestep=None)
    assert b.severity == "error" and b.details["nan"] == 1


@pytest.mark.parametrize(
    "make",
    [
        # StableVideoDiffusion's scheduler: Karras sigmas, continuous timesteps, "leading" spacing
        lambda d: d.EulerDiscreteScheduler(
            num_train_timesteps=1000,
            beta_schedule="scaled_linear",
            beta_start=0.00085,
            beta_end=0.012,
            prediction_type="v_prediction",
            timestep_spacing="leading",
            timestep_type="continuous",
            use_karras_sigmas=True,
            steps_offset=1,
            interpolation_type="linear",
            sigma_max=700.0,
            sigma_min=0.002,
        ),
        lambda d: d.EulerDiscreteScheduler(use_karras_sigmas=True, timestep_spacing="leading", steps_offset=0),
        lambda d: d.EDMEulerScheduler(),
        lambda d: d.FlowMatchEulerDiscreteScheduler(shift=3.0),
        lambda d: d.DPMSolverMultistepScheduler(use_karras_sigmas=True, timestep_spacing="leading"),
    ],
)
def test_no_scheduler_warning_on_a_correct_continuous_schedule(make):
    import diffusers

    scheduler = make(diffusers)
    scheduler.set_timesteps(4)
    first = float(scheduler.timesteps[0])
    assert setup_checks.scheduler_config(scheduler, num_inference_steps=4, first_timestep=first) == []


def test_discrete_scheduler_warnings_are_kept():
    from diffusers import DDIMScheduler

    rules = {
        a.details["rule"]
        for a in setup_checks.scheduler_config(
            DDIMScheduler(rescale_betas_zero_snr=True, prediction_type="epsilon", timestep_spacing="leading"),
            num_inference_steps=2,
            first_timestep=500.0,
            last_timestep=0.0,
            family="Stable Diffusion",
        )
    }
    assert rules == {"zero_snr_epsilon", "zero_snr_spacing", "steps_offset", "leading_spacing_few_steps"}


def test_suspects_of_quiet_readings_are_found_in_one_pass_as_the_full_reading_finds_them():
    """A naive reference: the three searches run on every reading set, against the one-pass answer
    for readings that are all finite and below the threshold."""
    import itertools
    import random

    from diffusion_debug.probes import ModuleReading

    values = [None, 0.0, 1.0, -3.0, 32000.0, -40000.0, 70000.0, float("inf"), float("-inf"), float("nan")]
    rng = random.Random(0)
    for _ in range(400):
        readings = [
            ModuleReading(f"m{i}", 0, dtype, rng.choice(values), rng.choice(values), dtype)
            for i, dtype in zip(
                range(rng.randint(0, 4)), itertools.cycle(rng.sample(["float16", "bfloat16", "float32"], 3))
            )
        ]
        for fraction in (0.5, 0.61, 1.0):
            naive = checks.Suspects(
                checks.first_nonfinite(readings),
                checks.find_producer(readings),
                checks.overflow_producer(readings, fraction),
            )
            assert checks.suspects(readings, fraction) == naive, (readings, fraction)


def test_a_tokenizers_special_tokens_are_counted_once_and_forgotten_with_it():
    """A slow tokenizer (transformers 4's ``CLIPTokenizer``) counts its special tokens by building an
    input: 23 Python calls at every watched call on the floor stack (233 against 210 a 1-step call).
    The count is asked once per tokenizer, and not held past the tokenizer's life."""
    import gc
    import weakref

    class Counting:
        asked = 0

        def num_special_tokens_to_add(self):
            Counting.asked += 1
            return 2

    tokenizer = Counting()
    verdicts = [setup_checks.fits_for_sure(tokenizer, "a photo of a cat", n) for n in (77, 34, 33, 77)]
    assert verdicts == [True, True, False, True] and Counting.asked == 1
    gone = weakref.ref(tokenizer)
    del tokenizer
    gc.collect()
    assert gone() is None
    assert setup_checks.fits_for_sure(Counting(), "a cat", 77) and Counting.asked == 2
