"""Policies, overflow risk, prompt truncation, scheduler / dtype rules, VAE saturation,
internal errors, and coexistence with diffusers' and accelerate's own hooks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusion_helpers import plant, run

from diffusion_debug import DebugConfig, DiffusionDebugError, DiffusionModelDebugger
from diffusion_debug.diffusion import checks
from diffusion_debug.record import load_json
from diffusion_debug.testing import tiny_pipeline

UNET_LEAF = "up_blocks.1.resnets.0.conv2"


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def kinds(report, kind):
    return [a for a in report.anomalies if a.kind == kind]


# -- policies ----------------------------------------------------------------------------------


def test_policy_raise_saves_and_raises_with_the_anomaly(pipes, tmp_path):
    pipe = pipes["sd"]
    with plant(pipe.unet.get_submodule(UNET_LEAF), 1):
        with pytest.raises(DiffusionDebugError) as info:
            with DiffusionModelDebugger(pipe, cfg(tmp_path, policy="raise")):
                run(pipe, steps=4)
    error = info.value
    assert error.anomaly.kind == "nonfinite" and error.anomaly.module == UNET_LEAF and error.anomaly.step == 1
    summary = load_json(error.run_dir / "summary.json")
    assert [s["step"] for s in summary["steps"]] == [0, 1]
    assert "scheduler" not in vars(pipe.scheduler) and "step" not in vars(pipe.scheduler)


def test_policy_stop_ends_the_loop_early(pipes, tmp_path):
    pipe = pipes["sd"]
    with plant(pipe.unet.get_submodule(UNET_LEAF), 1):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, policy="stop"))
        with dbg:
            run(pipe, steps=4)
    assert [row["step"] for row in dbg.report().steps] == [0, 1]
    assert pipe._interrupt is False  # restored at detach
    assert len(run(pipe, steps=2)) == 1  # the next run is a full, plain run


def test_policy_warn_warns(pipes, tmp_path):
    pipe = pipes["sd"]
    with plant(pipe.unet.get_submodule(UNET_LEAF), 0):
        with pytest.warns(RuntimeWarning, match=f"nonfinite at unet {UNET_LEAF}, step 0"):
            with DiffusionModelDebugger(pipe, cfg(tmp_path, policy="warn", level="basic")):
                run(pipe, steps=2)


# -- internal errors ---------------------------------------------------------------------------


def test_internal_error_is_recorded_and_the_run_goes_on(pipes, tmp_path, monkeypatch):
    pipe = pipes["sd"]
    plain = run(pipe, steps=2)

    def broken(*args, **kwargs):
        raise RuntimeError("measurement exploded")

    monkeypatch.setattr(checks, "latent_divergence", broken)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        watched = run(pipe, steps=2)
    assert np.array_equal(plain, watched)
    (error,) = kinds(dbg.report(), "debugger_error")
    assert error.severity == "warning" and error.details["where"] == "latent_divergence"
    assert error.details["count"] == 2 and "measurement exploded" in error.message
    with pytest.raises(RuntimeError, match="measurement exploded"):
        with DiffusionModelDebugger(pipe, cfg(tmp_path, strict=True)):
            run(pipe, steps=2)
    assert "step" not in vars(pipe.scheduler)


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
    assert "float32" in risks[0].message and "sdxl-vae-fp16-fix" in risks[0].message


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
    assert checks.scheduler_config(good, num_inference_steps=4, first_timestep=999) == []


def test_dtype_mismatch_fp16_sdxl_vae_without_upcast():
    pipe = tiny_pipeline("sdxl", dtype=torch.float16)
    pipe.vae.register_to_config(force_upcast=False)
    found = checks.dtype_mismatch(pipe, {"unet": "float16", "vae": "float16", "text_encoder": "bfloat16"}, "unet")
    assert [a.component for a in found] == ["vae", "unet"]
    assert "force_upcast" in found[0].message


def test_vae_saturation_and_flat_images(pipes, tmp_path):
    pipe = pipes["sd"]
    with plant(pipe.vae.decoder, 0, lambda out: out * 0 + 3.0):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
        with dbg:
            run(pipe, steps=2)
    found = {("flat_images" in a.details): a for a in kinds(dbg.report(), "vae_saturation")}
    assert found[False].details["outside_fraction"] == 1.0
    assert found[True].details["flat_images"] == [0]


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


# -- coexistence with diffusers and accelerate hooks ----------------------------------------------


def test_attention_slicing_and_accelerate_hooks(tmp_path):
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    class CountingHook(ModelHook):
        def __init__(self):
            self.calls = 0

        def pre_forward(self, module, *args, **kwargs):
            self.calls += 1
            return args, kwargs

    pipe = tiny_pipeline("sd")
    pipe.enable_attention_slicing()
    hook = CountingHook()
    add_hook_to_module(pipe.unet, hook)
    plain = run(pipe, steps=2)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        watched = run(pipe, steps=2)
    assert np.array_equal(plain, watched)
    assert hook.calls == 4 and hasattr(pipe.unet, "_hf_hook")
    assert dbg.report().components["unet"]["calls"] == 2 and dbg.report().components["unet"]["offload_hooks"]
    with plant(pipe.unet.get_submodule(UNET_LEAF), 1):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
        with dbg:
            run(pipe, steps=2)
    (anomaly,) = [a for a in kinds(dbg.report(), "nonfinite") if a.severity == "error"]
    assert (anomaly.module, anomaly.step) == (UNET_LEAF, 1)
    remove_hook_from_module(pipe.unet)
    assert np.array_equal(run(pipe, steps=2), plain)


def test_accelerate_cpu_offload(tmp_path):
    from accelerate import cpu_offload

    pipe = tiny_pipeline("sd")
    plain = run(pipe, steps=2)
    cpu_offload(pipe.unet, execution_device="cpu")
    offloaded = run(pipe, steps=2)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        watched = run(pipe, steps=2)
    assert np.array_equal(offloaded, watched)  # the contract: same objects, with and without us
    # cpu_offload re-materialises the weights at other addresses; MKL/oneDNN kernels chosen by
    # alignment can differ by ~1e-6 there, so offloaded vs plain is a numerics question
    np.testing.assert_allclose(offloaded, plain, rtol=0, atol=1e-4)
    assert len(dbg.report().steps) == 2


def test_debug_timeout_caps_the_replays_of_a_run(tmp_path):
    from diffusion_debug.testing import plant_overflow

    pipe = tiny_pipeline("sd", dtype=torch.float16)
    handles = [
        plant_overflow(pipe.unet.get_submodule("up_blocks.1"), fraction=0.7),
        plant_overflow(pipe.vae.get_submodule("decoder.up_blocks.0"), fraction=0.7),
    ]
    try:
        dbg = DiffusionModelDebugger(
            pipe,
            DebugConfig(output_dir=str(tmp_path), run_name="t", level="basic", debug_timeout=1e-9, log_level="error"),
        )
        with dbg:
            run(pipe, steps=2)
    finally:
        for handle in handles:
            handle.remove()
    events = dbg.record.events
    # the first replay starts with nothing spent; after it the budget is gone
    assert [e["component"] for e in events if e["type"] == "replay"] == ["unet"]
    assert [e["component"] for e in events if e["type"] == "replay_skipped"] == ["vae"]
    assert {a.component for a in kinds(dbg.report(), "overflow_risk")} == {"unet", "vae"}
