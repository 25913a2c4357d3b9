"""diffusion/checks.py: overflow risk, prompt truncation, scheduler / dtype rules, VAE saturation,
latent divergence — on values, and through the debugger on tiny pipelines."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusion_helpers import SD_FP16_VAE, SDXL_FP16_VAE, plant, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion import checks, setup_checks
from diffusion_debug.report import write_html
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline

UNET_LEAF = "up_blocks.1.resnets.0.conv2"


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def kinds(report, kind):
    return [a for a in report.anomalies if a.kind == kind]


# -- fp16 and overflow ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp16_sd():
    return tiny_pipeline("sd", dtype=torch.float16)


def test_fp16_pipeline_runs_clean_and_identical(fp16_sd, tmp_path):
    plain = run(fp16_sd, steps=2)
    dbg = DiffusionModelDebugger(fp16_sd, cfg(tmp_path))
    with dbg:
        watched = run(fp16_sd, steps=2)
    assert np.array_equal(plain, watched)
    assert not [a for a in dbg.report().anomalies if a.kind in ("nonfinite", "overflow_risk")]
    assert dbg.report().steps[0]["model_output"]["dtype"] == "float16"


def test_planted_fp16_vae_overflow_is_named_with_vae_advice(fp16_sd, tmp_path):
    name = "decoder.up_blocks.0.upsamplers.0.conv"
    with plant(fp16_sd.vae.get_submodule(name), 0, lambda out: out / out.abs().amax() * 40000):
        dbg = DiffusionModelDebugger(fp16_sd, cfg(tmp_path, level="basic"))
        with dbg:
            run(fp16_sd, steps=2)
    risks = kinds(dbg.report(), "overflow_risk")
    assert [(a.component, a.module) for a in risks] == [("vae", name)]
    assert risks[0].details["absmax"] == pytest.approx(40000, rel=1e-3)
    assert risks[0].message.endswith(f"; {SD_FP16_VAE}.")  # SD 1.5 reads no force_upcast: not named


BF16_ADVICE = (
    "bfloat16 holds float32's range, so float32 gives these values no more room: check {where}'s weights and the "
    "scale of its inputs."
)


def test_a_bf16_vae_near_overflow_is_told_to_check_its_values_not_the_fp16_advice():
    """The overflow advice reads the dtype the module ran in: Stable Diffusion's VAE near bfloat16's
    maximum was told fp16's (force_upcast, the fp16-fixed VAE), which do not apply to a bf16 VAE; nor
    does float32, whose largest value is bfloat16's (before: "run the VAE in float32")."""
    from diffusion_debug.probes import ModuleReading

    reading = ModuleReading("decoder.conv_out", 0, "bfloat16", 1.0, 3.2e38, "bfloat16", "absmax")
    (risk,) = checks.overflow_risk(
        "vae", reading, step=None, timestep=None, fraction=0.5, localized_by="probe", role="vae", sd_vae=True
    )
    assert risk.message == (
        f"vae.decoder.conv_out output reached {risk.details['dtype_max_fraction']:.0%} of the bfloat16 maximum "
        "(|x|=3.2e+38); " + BF16_ADVICE.format(where="vae.decoder.conv_out")
    )


@pytest.mark.parametrize(
    "dtype, absmax, advice",
    [
        ("float16", 6e4, "(|x|=6e+04); run this component in bfloat16 or float32, or upcast this module."),
        ("bfloat16", 3.2e38, "(|x|=3.2e+38); " + BF16_ADVICE.format(where="unet.up_blocks.0.resnets.0.conv2")),
    ],
)
def test_a_denoiser_near_overflow_is_advised_by_the_dtype_it_ran_in(dtype, absmax, advice):
    """fp16: a wider dtype (bf16 or float32) holds the values; bf16: none does (before: "run this component
    in bfloat16 or float32" for a bf16 component already in bfloat16)."""
    from diffusion_debug.probes import ModuleReading

    reading = ModuleReading("up_blocks.0.resnets.0.conv2", 0, dtype, 1.0, absmax, dtype, "absmax")
    (risk,) = checks.overflow_risk(
        "unet", reading, step=3, timestep=None, fraction=0.5, localized_by="sentinel", role="denoiser"
    )
    share = f"{risk.details['dtype_max_fraction']:.0%}"
    assert risk.message == (
        f"unet.up_blocks.0.resnets.0.conv2 output reached {share} of the {dtype} maximum " + advice
    )


def test_the_report_guide_next_to_an_overflow_risk_advises_by_dtype_as_its_message_does():
    """The HTML report shows the kind's "what to do" beside each overflow_risk group: it told a bf16
    component to run in float32 or bfloat16, which its message says gives these values no more room."""
    from diffusion_debug.record import kind_info

    assert kind_info("overflow_risk").action == (
        "In float16: run that component in bfloat16 or float32 (SDXL VAE: force_upcast or the fp16-fix VAE; SD 1.5's "
        "pipeline reads no force_upcast: decode in float32 yourself); under float16 autocast, which computes float32 "
        "weights in float16 too, an upcast helps only with the decode run outside the autocast: autocast to bfloat16 "
        "instead, or run that component outside autocast; in bfloat16, whose range is float32's, no dtype holds "
        "more: check the named module's weights and the scale of its inputs."
    )


def test_a_float32_pipeline_near_overflow_under_fp16_autocast_is_told_to_autocast_to_bfloat16(tmp_path):
    """A float32 UNet run under ``torch.autocast(..., dtype=torch.float16)`` computes in float16: its near-max
    output was told to "run this component in bfloat16 or float32, or upcast this module", though it is float32
    already and its weights' dtype does not change what autocast computes in."""
    pipe = tiny_pipeline("sd")
    assert pipe.unet.dtype == torch.float32
    with plant(pipe.unet.get_submodule(UNET_LEAF), 0, lambda out: out / out.abs().amax() * 60000):
        # full probes: the sentinel reads the block, whose residual add gives float32 under autocast
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic", probes="full"))
        with torch.autocast(device_type="cpu", dtype=torch.float16), dbg:  # (attached under it: probed as fp16)
            run(pipe, steps=2, output_type="latent")
    risks = [a for a in kinds(dbg.report(), "overflow_risk") if a.component == "unet"]
    assert [(a.module, a.details["dtype"], a.details["weights_dtype"]) for a in risks] == [
        (UNET_LEAF, "float16", "float32")
    ]
    share = f"{risks[0].details['dtype_max_fraction']:.0%}"
    assert risks[0].message == (
        f"unet.{UNET_LEAF} output reached {share} of the float16 maximum (|x|=6e+04); it ran under float16 "
        "autocast (its weights are float32): autocast to bfloat16 instead (torch.autocast(..., "
        f"dtype=torch.bfloat16)) or run unet.{UNET_LEAF} outside autocast."
    )


def test_a_module_kept_in_float32_of_an_fp16_pipeline_without_autocast_gets_the_fp16_advice(tmp_path):
    """diffusers' ``_keep_in_fp32_modules`` (Wan's norms, ``FP32LayerNorm``) keep a module's weights in float32
    in a float16 model and cast its output back to float16: no autocast ran, so its near-max output is told
    the float16 advice, not "it ran under float16 autocast" (float32 weights beside a float16 output alone)."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    leaf = pipe.unet.get_submodule(UNET_LEAF).float()  # kept in float32, as _keep_in_fp32_modules does
    handles = [
        leaf.register_forward_pre_hook(lambda module, args: tuple(a.float() for a in args)),
        leaf.register_forward_hook(lambda module, args, out: out.half()),  # (FP32LayerNorm's cast back)
    ]
    try:
        with plant(leaf, 0, lambda out: out / out.abs().amax() * 60000):
            dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic", probes="full"))
            with dbg:
                run(pipe, steps=2, output_type="latent")
    finally:
        for handle in handles:
            handle.remove()
    risks = [a for a in kinds(dbg.report(), "overflow_risk") if a.component == "unet"]
    assert [(a.module, a.details["dtype"], "weights_dtype" in a.details) for a in risks] == [
        (UNET_LEAF, "float16", False)
    ]
    assert risks[0].message.endswith("run this component in bfloat16 or float32, or upcast this module.")


@pytest.mark.parametrize("autocast", [torch.float16, torch.bfloat16])
def test_a_float16_output_of_float32_weights_gets_the_autocast_advice_only_under_float16_autocast(autocast):
    """A float32 module's float16 output is autocast's where autocast computes in float16: "it ran under float16
    autocast ... autocast to bfloat16 instead". Under bfloat16 autocast that float16 came from elsewhere (a module
    kept in float32 that casts back, ``_keep_in_fp32_modules``), and the user autocasts to bfloat16 already: the
    float16 advice holds. Any autocast open counted (bfloat16's was told to autocast to bfloat16)."""
    from diffusion_debug.probes import ModuleReading

    reading = ModuleReading("up_blocks.0.resnets.0.conv2", 0, "float16", 1.0, 6e4, "float16", "absmax")
    with torch.autocast("cpu", dtype=autocast):
        (risk,) = checks.overflow_risk(
            "unet", reading, step=0, timestep=None, fraction=0.5, localized_by="sentinel", weights_dtype="float32"
        )
    fp16 = autocast == torch.float16
    assert ("weights_dtype" in risk.details) is fp16
    assert risk.message.endswith(
        "it ran under float16 autocast (its weights are float32): autocast to bfloat16 instead (torch.autocast(..., "
        "dtype=torch.bfloat16)) or run unet.up_blocks.0.resnets.0.conv2 outside autocast."
        if fp16
        else "run this component in bfloat16 or float32, or upcast this module."
    )


# -- prompts, scheduler, dtype, VAE saturation ----------------------------------------------------


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


def test_an_sdxl_fp16_vae_nan_is_advised_by_the_dtype_of_the_module_that_made_it_not_the_vaes_most(tmp_path):
    """diffusers < 0.36's ``upcast_vae`` (force_upcast) casts the VAE to float32 but puts its
    ``decoder.mid_block`` back in float16: a NaN made there is an fp16 one, given the upcast and
    fp16-fixed-VAE advice (before: read as the float32 VAE's, the generic advice); one made in an
    up block ran in float32 and is told so, not to try float32."""
    pipe = tiny_pipeline("sdxl", dtype=torch.float16)

    def upcast_vae():  # diffusers 0.32-0.35's, with torch 2's attention processor
        pipe.vae.to(dtype=torch.float32)
        for part in (pipe.vae.post_quant_conv, pipe.vae.decoder.conv_in, pipe.vae.decoder.mid_block):
            part.to(torch.float16)

    pipe.upcast_vae = upcast_vae
    up = pipe.vae.decoder.up_blocks[0]  # and its Decoder cast the mid block's output to the up blocks' dtype
    cast = up.register_forward_pre_hook(lambda block, args: (args[0].to(torch.float32), *args[1:]))
    found = {}
    for name in ("decoder.mid_block.resnets.0.conv1", "decoder.up_blocks.0.resnets.0.conv2"):
        with plant(pipe.vae.get_submodule(name), 0, lambda out: out * float("nan")):
            dbg = DiffusionModelDebugger(pipe, cfg(tmp_path / name, level="basic", log_level="error"))
            with dbg:
                run(pipe, steps=1)
        (found[name],) = [a for a in kinds(dbg.report(), "nonfinite") if a.severity == "error"]
    cast.remove()
    mid, up = found.values()
    assert (mid.module, mid.details["vae_dtype"], up.module, up.details["vae_dtype"]) == (
        "decoder.mid_block.resnets.0.conv1",
        "float16",
        "decoder.up_blocks.0.resnets.0.conv2",
        "float32",
    )
    assert (
        mid.message == f"vae.decoder.mid_block.resnets.0.conv1 produced NaN/Inf from finite inputs ({SDXL_FP16_VAE})."
    )
    # the up block ran in float32 (before: "try float32 or bfloat16", to a VAE that ran in float32)
    assert up.message == (
        "vae.decoder.up_blocks.0.resnets.0.conv2 produced NaN/Inf from finite inputs (it ran in float32, so this "
        "is no half-precision overflow: check its weights and inputs)."
    )
    assert pipe.vae.dtype == torch.float16  # the pipeline cast it back after the decode


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


def test_a_sentinels_inf_inside_a_near_max_block_is_decided_as_that_blocks_clip_only_when_every_bad_one_is_inside():
    """A sentinel read a residual projection's Inf and the block around it at float16's clamp (T5's 64512) in one
    call: the block is replayed as a clip (its replay names the Inf), no NaN/Inf localised apart. A NaN (a clip
    keeps it) or an Inf outside the block keep the NaN/Inf's own path; full probes decide the clip as read, and so
    does localising off (no replay to name it: it named the Inf at its leaf beside an overflow warning at the block,
    the clip's consequence, two findings for one cause)."""
    from diffusion_debug.diffusion.replay.decide import CLIP_UNLOCALISED, ReplayMemory, decide
    from diffusion_debug.probes import ModuleReading

    wo = ModuleReading("block.0.ff.wo", 0, "float16", None, float("inf"), "float16")
    block = ModuleReading("block.0", 0, "float16", None, 64512.0, "float16")
    other = ModuleReading("block.1.ff.wo", 0, "float16", None, float("inf"), "float16")
    nan = wo._replace(output_value=float("nan"))

    def plan(readings, full=False, localize=True):
        seen = checks.suspects(readings, 0.5)
        asked = dict(leaf=lambda c, m: m.endswith("wo"), received=lambda c, s: False, unwatched=None, site="")
        made = decide("t5", seen, readings, memory=ReplayMemory(), output_finite=True, full=full, **asked,
                      localize=localize, fraction=0.5)  # fmt: skip
        plan.overflow = made.overflow
        return made.replay, made.source is not None, made.overflow and (made.overflow.replay, made.overflow.clean)

    assert plan([wo, block]) == (None, False, ("block.0", True))
    assert plan([nan, block]) == ("block.0.ff.wo", False, ("block.0", False))
    assert plan([wo, block, other]) == ("block.0.ff.wo", False, ("block.0", False))
    assert plan([wo, block], localize=False) == (None, False, (None, True))  # the clip as read, unreplayed
    clip = plan.overflow.clipped
    assert (clip.producer, clip.block, plan.overflow.how) == (wo, "block.0", CLIP_UNLOCALISED)
    assert plan([wo, block], full=True) == (None, False, None)  # full probes: the clip decided as read
    # localising off, a block near the max but far below it (33000, half of 65504) clipped nothing: it was read
    # as the clip ('clipped it to 33000'), its overflow_risk dropped; the Inf at its leaf and the block's warning
    for value, clipped in ((33000.0, False), (64503.0, False), (64504.0, True), (65504.0, True)):
        near = block._replace(output_value=value)
        assert plan([wo, near], localize=False) == (None, not clipped, (None, True)), value
        made = plan.overflow.clipped
        assert ((made.block, made.value) if made else None) == (("block.0", value) if clipped else None), value


def test_a_sentinels_inf_inside_a_near_max_block_keeps_its_own_path_where_no_replay_reads_the_clip():
    """The clip path is taken only where the block's replay runs now or this run already holds its clip: a block
    localised before (``overflow_where``, kept for the debugger's life), one passed in or tried this run, or a run
    whose ``debug_timeout`` of replays is spent would not replay it, and the Inf was swallowed (an overflow warning,
    no error). There the Inf keeps its own path: its block replayed as a NaN/Inf's; but for a block whose replay was
    tried this run and could not run: the clip as the sentinel read it (its own path warned the block too)."""
    from diffusion_debug.diffusion.replay.decide import CLIP_UNREPLAYED, Clip, ReplayMemory, decide
    from diffusion_debug.probes import ModuleReading

    wo = ModuleReading("block.0.ff.wo", 0, "float16", None, float("inf"), "float16")
    block = ModuleReading("block.0", 0, "float16", None, 64512.0, "float16")
    key = ("t5", "block.0")

    def plan(memory, block=block):
        seen = checks.suspects([wo, block], 0.5)
        asked = dict(leaf=lambda c, m: m.endswith("wo"), received=lambda c, s: False, unwatched=None, site="")
        made = decide("t5", seen, [wo, block], memory=memory, output_finite=True, full=False, **asked,
                      localize=True, fraction=0.5)  # fmt: skip
        return made.replay, made.source is not None, made.overflow and made.overflow.replay

    own = ("block.0.ff.wo", False, None)  # the Inf's replay (its leaf given near-max values); the block's not again
    known = ReplayMemory()
    known.overflow_where[key] = None
    assert plan(known, block._replace(output_value=60000.0)) == own
    assert plan(known) == (None, False, "block.0")  # at the max (T5's 64504, within 1000): replayed once a run
    known.replayed_at_max.add(key)
    assert plan(known) == own
    memory = ReplayMemory()
    memory.passed_in.add(key)
    assert plan(memory)[:2] == own[:2]
    tried = ReplayMemory()  # its replay could not run this run (a second T5 call under true CFG): the clip as read
    tried.tried.add(key)
    made = decide("t5", checks.suspects([wo, block], 0.5), [wo, block], memory=tried, output_finite=True,
                  full=False, leaf=lambda c, m: m.endswith("wo"), received=lambda c, s: False, unwatched=None,
                  site="", localize=True, fraction=0.5)  # fmt: skip
    assert (made.replay, made.source, made.overflow.replay, made.overflow.clipped, made.overflow.how) == (
        None,
        None,
        None,
        Clip(wo, "block.0", 64512.0),
        CLIP_UNREPLAYED,
    )
    spent = ReplayMemory(timeout=1.0)
    spent.seconds = 1.0
    assert plan(spent)[:2] == own[:2]
    clipped = ReplayMemory()  # this run's clip, held: decided as that clip, unreplayed
    clipped.overflow_where[key] = None
    clipped.clipped[key] = (Clip(wo, "block.0", 64512.0), 7)
    made = decide("t5", checks.suspects([wo, block], 0.5), [wo, block], memory=clipped, output_finite=True,
                  full=False, leaf=lambda c, m: m.endswith("wo"), received=lambda c, s: False, unwatched=None,
                  site="", localize=True, fraction=0.5)  # fmt: skip
    assert (made.replay, made.source, made.overflow.clipped, made.overflow.replayed) == (
        None,
        None,
        Clip(wo, "block.0", 64512.0),
        7,
    )


def test_a_sentinels_inf_its_block_was_read_clipping_is_the_finding_where_the_blocks_replay_shows_no_clip():
    """The clip path (a sentinel read ``wo``'s Inf inside ``block.0`` at T5's clamp) replays the block to name the
    Inf. Where that replay could not run (no kept call, a replay OOM) or made no Inf again, the plan was the block's
    plain near-overflow: the Inf the sentinel read was lost (a warning, no error). The plan carries the sentinel's
    reading, and is then the clip as the sentinel read it: ``wo``'s Inf, clipped in ``block.0`` to 64512."""
    from diffusion_debug.diffusion.replay.decide import (
        CLIP_NOT_AGAIN,
        CLIP_UNREPLAYED,
        Clip,
        OverflowReplayed,
        ReplayMemory,
        decide,
    )
    from diffusion_debug.probes import ModuleReading

    wo = ModuleReading("block.0.ff.wo", 0, "float16", None, float("inf"), "float16")
    block = ModuleReading("block.0", 0, "float16", None, 64512.0, "float16")
    made = ModuleReading("block.0.ff", 0, "float16", 1.0, 40000.0, "float16")

    def shown(answer):
        memory = ReplayMemory()
        plan = decide("t5", checks.suspects([wo, block], 0.5), [wo, block], memory=memory, output_finite=True,
                      full=False, leaf=lambda c, m: m.endswith("wo"), received=lambda c, s: False, unwatched=None,
                      site="", localize=True, fraction=0.5).overflow  # fmt: skip
        assert (plan.replay, plan.inf) == ("block.0", wo)
        found = memory.overflow_shown(plan, answer, 0 if answer is None else 9)
        return found.clipped, found.how, found.replayed, found.known

    read = Clip(wo, "block.0", 64512.0)
    assert shown(None) == (read, CLIP_UNREPLAYED, None, None)
    assert shown(OverflowReplayed(made=made)) == (read, CLIP_NOT_AGAIN, 9, None)
    assert shown(OverflowReplayed(passed_in=True)) == (read, CLIP_NOT_AGAIN, 9, None)
    replayed = Clip(wo._replace(input_value=1.0), "block.0", 64512.0)  # the replay's own clip: as it read it
    assert shown(OverflowReplayed(clipped=replayed)) == (replayed, "sentinel -> replay with full probes", 9, None)


@pytest.mark.parametrize(
    "dtype, value, at_max",
    [
        ("float16", 64504.0, True),  # T5's clamp: finfo.max - 1000
        ("float16", 64000.0, False),
        ("bfloat16", 3.0e38, False),
        ("float8_e5m2", 57344.0, True),
        ("float8_e4m3fn", 230.0, False),  # (max 448: the 1000 margin would take every value for at the max)
        ("float8_e4m3fn", 440.0, False),
        ("float8_e4m3fn", 448.0, True),
    ],
)
def test_at_the_max_is_within_a_clamps_margin_only_where_the_dtype_reaches_far_beyond_it(dtype, value, at_max):
    """A near-max block at the max is replayed once a run (a clip's): with fp8 e4m3 every value was 'at the
    max' (448 - 1000 < 0), so each near-max e4m3 block was replayed every run."""
    from diffusion_debug.diffusion.replay.decide import at_dtype_max
    from diffusion_debug.probes import ModuleReading

    assert at_dtype_max(ModuleReading("block.0", 0, dtype, None, value, dtype)) is at_max
