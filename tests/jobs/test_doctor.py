"""Tests for diffusion_debug.jobs.doctor: a planted fp16 overflow in the VAE is found and named."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diffusion_debug.jobs.doctor import ComponentCheck, DoctorRun, doctor_table, recommend, run_doctor
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import SAME_NOISE_IN_HALF

pytestmark = [
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning"),
    pytest.mark.xdist_group("doctor"),  # one worker under -n 2: the module's `doctor` (three runs) is made once
]

VAE_MODULE = "decoder.up_blocks.0.resnets.0.conv2"


def _load(dtype: str):
    pipe = tiny_pipeline("sd", dtype=getattr(torch, dtype))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _plant_fp16_overflow(pipe):
    """The same fault in every dtype: one VAE decoder activation reaches |x| = 1e5. Only the
    dtype's range decides what happens: above float16's max (65504), inside float32's and
    bfloat16's. (``plant_overflow`` scales to a share of each dtype's own max, so it cannot
    plant a fault that only float16 suffers.)"""

    def hook(_module, _args, output):
        return (output.float() * (1e5 / output.detach().abs().amax().float())).to(output.dtype)

    return pipe.vae.get_submodule(VAE_MODULE).register_forward_hook(hook)


@pytest.fixture(scope="module")
def doctor(tmp_path_factory):
    return run_doctor(_load, tmp_path_factory.mktemp("doctor"), steps=2, plant=_plant_fp16_overflow)


def _runs(result):
    return {run["label"]: run for run in result["runs"]}


def test_float32_is_the_finite_reference(doctor):
    reference = _runs(doctor)["float32"]
    assert reference["status"] == "ok" and reference["image_finite"] is True
    assert reference["psnr_db"] == math.inf
    assert all(check["finite"] for check in reference["components"].values())
    assert set(reference["components"]) == {"unet", "vae", "text_encoder"}
    assert reference["components"]["vae"]["max_abs"] == pytest.approx(1e5, rel=1e-3)


def test_float16_names_the_vae_module_that_overflows(doctor):
    fp16 = _runs(doctor)["float16"]
    vae = fp16["components"]["vae"]
    assert vae["finite"] is False
    assert vae["first_nonfinite"] == VAE_MODULE
    assert fp16["components"]["unet"]["finite"] is True
    assert fp16["image_finite"] is False and fp16["psnr_db"] is None


@pytest.mark.skipif(
    not SAME_NOISE_IN_HALF, reason="this torch draws other noise in bfloat16: the PSNR would measure the noise"
)
def test_bfloat16_has_the_range_and_loses_some_precision(doctor):
    bf16 = _runs(doctor)["bfloat16"]
    assert bf16["components"]["vae"]["finite"] is True
    assert bf16["components"]["vae"]["range_fraction"] < 1e-30
    assert 20 < bf16["psnr_db"] < math.inf


def test_the_recommendation_keeps_the_vae_out_of_float16(doctor):
    text = doctor["recommendation"]
    assert "unet float16" in text
    assert "vae bfloat16" in text
    assert f"float16: non-finite at {VAE_MODULE}" in text
    assert "fp16-fix VAE" not in text  # (SD 1.5's VAE, scaling factor 0.18215: the SDXL fix is another latent space)


def test_the_fp16_fixed_vae_is_recommended_for_sdxls_vae_only():
    """Keyed on the VAE being SDXL's (scaling factor 0.13025): SD 1.5's (0.18215) and SD x4 upscale's (0.08333) are
    other latent spaces; a Wan or QwenImage VAE (or Flux's 16-channel AutoencoderKL) has no fp16-fixed version."""
    from diffusers import AutoencoderKL

    from diffusion_debug.jobs.doctor import sdxl_vae

    tiny = dict(block_out_channels=(8,), norm_num_groups=8, latent_channels=4)
    factors = {0.13025: True, 0.18215: False, 0.08333: False}
    assert {f: sdxl_vae(AutoencoderKL(scaling_factor=f, **tiny)) for f in factors} == factors
    fp32 = ComponentCheck(True, None, 1e5, 3.4e38, 0.1)
    runs = [DoctorRun("float32", components={"vae": fp32}), DoctorRun("float16", components={})]
    for sdxl, advice in ((True, "; or the fp16-fix VAE"), (False, "")):
        runs[1].components["vae"] = ComponentCheck(False, "decoder.conv_out", None, 65504.0, 0.1, sdxl_vae=sdxl)
        assert recommend(runs) == f"vae float32 (float16: non-finite at decoder.conv_out{advice})"


def test_doctor_json_is_strict_and_holds_the_result(doctor):
    def refuse(name):
        raise ValueError(name)

    path = f"{doctor['run_dir']}/doctor.json"
    saved = json.loads(open(path).read(), parse_constant=refuse)
    assert saved["recommendation"] == doctor["recommendation"]
    assert saved["runs"][0]["psnr_db"] == "inf"
    # each dtype's debugger run sits inside the doctor directory, with its own report
    for run in doctor["runs"]:
        assert (run["run_dir"] + "/report.html").startswith(doctor["run_dir"])


def test_the_table_has_one_block_per_dtype(doctor):
    lines = doctor_table(doctor).splitlines()
    assert lines[0].split()[:3] == ["run", "component", "finite"]
    starts = [line.split()[0] for line in lines[2:] if not line.startswith(" ")]
    assert starts == ["float32", "float16", "bfloat16"]
    vae_fp16 = next(line for line in lines if "NO" in line and "vae" in line)
    assert VAE_MODULE in vae_fp16
    # not the share of its largest finite value, which would read as far from the maximum
    assert "NaN/Inf" in vae_fp16 and "%" not in vae_fp16


def test_an_unknown_dtype_is_refused_before_any_run(tmp_path):
    with pytest.raises(ValueError, match="float8"):
        run_doctor(_load, tmp_path, dtypes=("float8",))
    assert list(tmp_path.iterdir()) == []


def test_compile_times_a_warm_call_and_says_so_as_it_goes(tmp_path):
    torch._dynamo.reset()
    lines = []
    result = run_doctor(
        _load, tmp_path, dtypes=("float32",), compile=True, backend="aot_eager", progress=lines.append, steps=2
    )
    plain, compiled = _runs(result)["float32"], _runs(result)["float32+compile"]
    assert lines == ["doctor: float32", "doctor: float32+compile (compiling, then one watched call)"]
    assert compiled["status"] == "ok" and compiled["compile_s"] > compiled["time_s"]
    assert plain["compile_s"] is None
    assert compiled["psnr_db"] == math.inf  # the same image as the eager float32 call
    assert compiled["components"]["unet"]["finite"] and compiled["components"]["unet"]["max_abs"] is None
    assert f"(compile {compiled['compile_s']:.1f} s)" in doctor_table(result)
