"""A half-precision VAE run under an autocast of the other half dtype computes in the autocast's dtype, not its
weights': a bfloat16 VAE under float16 autocast overflows float16's range (the cause is the autocast, and keeping
the VAE in bfloat16 or float32 does not change it), a float16 VAE under bfloat16 autocast computes with float32's
range (no half-precision overflow). The VAE's GroupNorms are kept in float32 here, as CUDA's autocast computes
``group_norm`` in float32 (CPU's autocast leaves its weight in the VAE's dtype, which its kernel refuses)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from diffusion_helpers import BF16_VAE, SD_FP16_VAE, plant, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger

CONV = "decoder.up_blocks.0.resnets.0.conv2"


@contextlib.contextmanager
def vae_in(pipe, dtype):
    """``pipe.vae`` in ``dtype`` (its GroupNorms in float32) while the block runs, float32 after."""
    pipe.vae.to(dtype)
    for module in pipe.vae.modules():
        if isinstance(module, torch.nn.GroupNorm):
            module.float()
    try:
        yield
    finally:
        pipe.vae.to(torch.float32)


def anomalies_of(pipe, tmp_path, weights, autocast, module, make):
    """The anomalies of one autocast call of ``pipe`` whose VAE is in ``weights``, ``vae.module``'s output made by
    ``make`` from the decode's first call on."""
    with vae_in(pipe, weights), plant(pipe.vae.get_submodule(module), 0, make):
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", level="basic"))
        try:
            with dbg, torch.autocast("cpu", dtype=autocast):
                run(pipe, steps=1)
            return dbg.report().anomalies
        finally:
            dbg.close()


OUTSIDE_FP16_AUTOCAST = (
    f"{SD_FP16_VAE}, decoded outside the float16 autocast (which computes a float32 VAE in float16 too)"
)
"""SD 1.5's (no force_upcast read) fp16 VAE advice under float16 autocast."""

FLAT = {
    "bfloat16": "1 decoded image(s) are a single flat colour; vae ran under float16 autocast (its weights are "
    "bfloat16, so their dtype does not change what it computes in): check the latents' scaling factor, the latents "
    "reaching it (the step table) and its weights; if the latents and weights are finite, autocast to bfloat16 "
    "instead (torch.autocast(..., dtype=torch.bfloat16)) or run vae outside autocast.",
    "float16": "1 decoded image(s) are a single flat colour; vae ran under bfloat16 autocast (its weights are "
    "float16), whose range is float32's, so this is no overflow of a narrow dtype: check the latents' scaling factor, "
    "the latents reaching it (the step table) and its weights.",
}


@pytest.mark.parametrize(
    ("weights", "autocast"), [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)], ids=["bf16", "fp16"]
)
def test_a_flat_image_of_a_half_vae_under_another_autocast_names_the_autocast(pipes, tmp_path, weights, autocast):
    """A bfloat16 VAE under float16 autocast decodes in float16: its flat image read "often a black image from an
    fp16 VAE: keep the VAE in float32 (pipe.vae.to(torch.float32) or vae.config.force_upcast=True) or use an
    fp16-fixed VAE", none of which changes what autocast computes in; a float16 VAE under bfloat16 autocast read
    "run the VAE in float32", though it computed with float32's range. Each names the autocast."""
    found = anomalies_of(pipes["sd"], tmp_path, weights, autocast, "decoder", lambda out: out * 0 + 3.0)
    (flat,) = [a for a in found if a.kind == "constant_image"]
    name, under = (str(dtype).removeprefix("torch.") for dtype in (weights, autocast))
    assert (flat.details["vae_dtype"], flat.details["decoded_dtype"], flat.details["vae_autocast"]) == (
        name,
        under,
        under,
    )
    assert flat.message == FLAT[name]


def test_a_nan_of_a_float16_vae_under_bfloat16_autocast_is_not_told_to_upcast_it(pipes, tmp_path):
    """A NaN a float16 VAE's conv made under bfloat16 autocast (computed in bfloat16): it read "keep the VAE in
    float32 (pipe.vae.to(torch.float32) or vae.config.force_upcast=True) or use an fp16-fixed VAE", an fp16
    overflow's advice. It says the autocast, whose range is float32's."""
    found = anomalies_of(pipes["sd"], tmp_path, torch.float16, torch.bfloat16, CONV, lambda out: out * float("nan"))
    (error,) = [a for a in found if a.kind == "nonfinite" and a.severity == "error"]
    assert (error.module, error.details["vae_dtype"], error.details["vae_autocast"]) == (CONV, "float16", "bfloat16")
    assert error.message == (
        f"vae.{CONV} produced NaN/Inf from finite inputs; it ran under bfloat16 autocast (its weights are float16), "
        "whose range is float32's, so this is no overflow of a narrow dtype: check its weights and inputs."
    )


def test_vae_dtype_is_the_weights_dtype_in_a_flat_image_as_in_a_nan(pipes, tmp_path):
    """``vae_dtype`` was the decoded image's dtype in ``constant_image`` (float16, a float32 VAE's under float16
    autocast) and the weights' in ``nonfinite`` (float32): the weights' in both, the image's ``decoded_dtype``."""
    found = anomalies_of(
        pipes["sd"], tmp_path / "flat", torch.float32, torch.float16, "decoder", lambda out: out * 0 + 3.0
    )
    nan = anomalies_of(
        pipes["sd"], tmp_path / "nan", torch.float32, torch.float16, CONV, lambda out: out * float("nan")
    )
    (flat,) = [a for a in found if a.kind == "constant_image"]
    (error,) = [a for a in nan if a.kind == "nonfinite" and a.severity == "error"]
    assert (flat.details["vae_dtype"], flat.details["decoded_dtype"]) == ("float32", "float16")
    assert (error.module, error.details["vae_dtype"], error.details["vae_autocast"]) == (CONV, "float32", "float16")
    assert "decoded_dtype" not in error.details


def test_a_flat_image_whose_vae_weights_are_unknown_keeps_the_decoded_dtype_alone():
    """Without its weights' dtype (no reader of it given), the decoded images' dtype was kept as ``vae_dtype`` (its
    old meaning, the weights' now): it is ``decoded_dtype`` alone, and a float32 decode is still no fp16 overflow."""
    from diffusion_debug.diffusion import checks

    (flat,) = checks.vae_saturation(0.0, [0.0], threshold=0.5, step=None, dtype=torch.float32)
    assert ("vae_dtype" in flat.details, flat.details["decoded_dtype"]) == (False, "float32")
    assert flat.message == (
        "1 decoded image(s) are a single flat colour; vae ran in float32, so this is no half-precision overflow: "
        "check the latents' scaling factor, the latents reaching it (the step table) and its weights."
    )


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn", "float16"])
def test_values_past_float16s_max_in_a_bfloat16_or_fp8_vae_are_no_overflow_risk(tmp_path, storage):
    """bfloat16 holds float32's range: a bfloat16 VAE's conv making 1e6 (past float16's 65504), or an fp8-stored one
    computing in bfloat16 (layerwise casting), is no near-overflow, on the first call (full probes) nor a later one;
    a float16 VAE's 6e4 (92% of its max) is: the next conv's Inf on it is named at that conv (the error)."""
    from diffusion_debug.testing.pipelines import tiny_pipeline

    pipe = tiny_pipeline("sd", dtype=torch.float16 if storage == "float16" else torch.bfloat16)
    if storage == "float8_e4m3fn":
        pipe.vae.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    value = 6e4 if storage == "float16" else 1e6
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    try:
        for _ in range(2):
            with plant(pipe.vae.get_submodule(CONV), 0, lambda out: out * 0 + value), dbg:
                run(pipe, steps=1)
        found = [(a.kind, a.severity, a.module, a.details.get("run")) for a in dbg.report().anomalies]
    finally:
        dbg.close()
    found = [f for f in found if f[0] == "overflow_risk" or f[:2] == ("nonfinite", "error")]
    assert found == ([("nonfinite", "error", CONV, run) for run in (1, 2)] if storage == "float16" else [])


def test_a_flat_image_of_an_upcast_sdxl_vae_under_float16_autocast_names_the_autocast_and_its_float32_weights(
    tmp_path,
):
    """An fp16 SDXL VAE with ``force_upcast`` decodes with float32 weights (the pipeline casts it for the decode and
    back after), under float16 autocast in float16: ``vae_dtype`` is its weights' dtype while it decoded (was the
    image's, float16, which read as an fp16 VAE's), and the message names the autocast, not force_upcast."""
    from diffusion_debug.testing.pipelines import tiny_pipeline

    pipe = tiny_pipeline("sdxl", dtype=torch.float16)
    pipe.vae.register_to_config(force_upcast=True)
    with plant(pipe.vae.decoder, 0, lambda out: out * 0 + 3.0):
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", level="basic"))
        try:
            with dbg, torch.autocast("cpu", dtype=torch.float16):
                run(pipe, steps=1)
            (flat,) = [a for a in dbg.report().anomalies if a.kind == "constant_image"]
        finally:
            dbg.close()
    assert (flat.details["vae_dtype"], flat.details["decoded_dtype"], flat.details["vae_autocast"]) == (
        "float32",
        "float16",
        "float16",
    )
    assert flat.message == (
        "1 decoded image(s) are a single flat colour; vae ran under float16 autocast (its weights are float32, so "
        "neither their dtype nor force_upcast changes what it computes in): check the latents' scaling factor, the "
        "latents reaching it (the step table) and its weights; if the latents and weights are finite, autocast to "
        "bfloat16 instead (torch.autocast(..., dtype=torch.bfloat16)) or run vae outside autocast."
    )
    assert pipe.vae.dtype == torch.float16  # cast back after the decode


def test_an_fp16_vae_under_float16_autocast_is_told_that_upcasting_it_needs_the_autocast_off(pipes, tmp_path):
    """A float16 VAE under float16 autocast: "keep the VAE in float32 (pipe.vae.to(torch.float32) or
    vae.config.force_upcast=True)" alone does not work there (autocast computes a float32 VAE in float16 too): the
    advice says to decode outside that autocast, for its NaN and its flat image alike."""
    pipe = pipes["sd"]
    nan = anomalies_of(pipe, tmp_path / "nan", torch.float16, torch.float16, CONV, lambda out: out * float("nan"))
    flat = anomalies_of(pipe, tmp_path / "flat", torch.float16, torch.float16, "decoder", lambda out: out * 0 + 3.0)
    (error,) = [a for a in nan if a.kind == "nonfinite" and a.severity == "error"]
    (image,) = [a for a in flat if a.kind == "constant_image"]
    advice = OUTSIDE_FP16_AUTOCAST
    assert (error.details["vae_dtype"], error.details["vae_autocast"]) == ("float16", "float16")
    assert error.message == f"vae.{CONV} produced NaN/Inf from finite inputs ({advice})."
    assert (image.details["vae_dtype"], image.details["vae_autocast"]) == ("float16", "float16")
    assert (
        image.message
        == f"1 decoded image(s) are a single flat colour (often a black image from an fp16 VAE: {advice})."
    )


@pytest.mark.parametrize("module", [CONV, "decoder.conv_out"], ids=["nan", "overflow_risk"])
def test_near_max_values_of_an_fp16_vae_under_float16_autocast_say_to_decode_outside_it(tmp_path, module):
    """The values near float16's max that real fp16 SDXL VAEs make: a float16 VAE's conv making 6e4 under float16
    autocast, on which the next conv overflowed (the NaN's origin) or, at the decoder's last conv, nothing did (an
    ``overflow_risk``). Both read "keep the VAE in float32 (... force_upcast=True) or use an fp16-fixed VAE", which
    autocast undoes (it computes a float32 VAE in float16 too): they say to decode outside it, as its NaN does."""
    from diffusion_debug.testing.pipelines import tiny_pipeline

    # (a pipeline of its own: its first call is read with full probes, which name the module)
    found = anomalies_of(
        tiny_pipeline("sd"), tmp_path, torch.float16, torch.float16, module, lambda out: out * 0 + 6e4
    )
    (made,) = [a for a in found if a.module == module and a.kind in ("nonfinite", "overflow_risk")]
    assert (made.kind, made.severity, made.details["vae_autocast"]) == (
        "nonfinite" if module == CONV else "overflow_risk",
        "error" if module == CONV else "warning",
        "float16",
    )
    if module == CONV:
        assert made.message == (
            f"vae.{CONV} made values at 92% of the float16 maximum (|x|=6e+04), and "
            "vae.decoder.up_blocks.0.upsamplers.0.conv, given them, produced NaN/Inf (its arithmetic overflowed on "
            f"them: a norm's variance, a matmul); {OUTSIDE_FP16_AUTOCAST}."
        )
    else:
        assert made.message == (
            f"vae.decoder.conv_out output reached 92% of the float16 maximum (|x|=6e+04); {OUTSIDE_FP16_AUTOCAST}."
        )


def test_a_bfloat16_vae_under_bfloat16_autocast_is_told_bfloat16s_range_not_an_fp16_vaes_fix(pipes, tmp_path):
    """A bfloat16 VAE under bfloat16 autocast: its flat image read "often a black image from an fp16 VAE: run the VAE
    in float32", though it is no fp16 VAE and autocast computes a float32 VAE in bfloat16 too; its NaN said "run the
    VAE in float32" as well. Both say bfloat16's range is float32's: the values, not the dtype, are wrong."""
    pipe = pipes["sd"]
    nan = anomalies_of(pipe, tmp_path / "nan", torch.bfloat16, torch.bfloat16, CONV, lambda out: out * float("nan"))
    flat = anomalies_of(pipe, tmp_path / "flat", torch.bfloat16, torch.bfloat16, "decoder", lambda out: out * 0 + 3.0)
    (error,) = [a for a in nan if a.kind == "nonfinite" and a.severity == "error"]
    (image,) = [a for a in flat if a.kind == "constant_image"]
    ran = (
        "ran under bfloat16 autocast (its weights are bfloat16 too), whose range is float32's, so this is no overflow"
    )
    assert (error.details["vae_dtype"], error.details["vae_autocast"]) == ("bfloat16", "bfloat16")
    assert error.message == (
        f"vae.{CONV} produced NaN/Inf from finite inputs; it {ran} of a narrow dtype: check its weights and inputs."
    )
    assert image.message == (
        f"1 decoded image(s) are a single flat colour; vae {ran} of a narrow dtype: check the latents' scaling "
        "factor, the latents reaching it (the step table) and its weights."
    )


@pytest.mark.parametrize(
    ("component", "sd_vae", "weights", "autocast", "said"),
    [
        ("vae", False, "float32", "float16", "its weights are float32, so their dtype does not change"),
        ("movq", False, "float32", "float16", "its weights are float32, so their dtype does not change"),
        ("vae", True, "bfloat16", "float16", "its weights are bfloat16, so their dtype does not change"),
        ("vae", "upcast", "float32", "float16", "its weights are float32, so neither their dtype nor force_upcast"),
        ("vae", True, "float32", "float16", "its weights are float32, so their dtype does not change"),
        ("vae", True, "bfloat16", None, BF16_VAE.removeprefix("it ")),
        ("vae", "upcast", "bfloat16", None, BF16_VAE.removeprefix("it ")),
    ],
)
def test_force_upcast_and_the_fp16_vae_are_said_only_where_they_apply(component, sd_vae, weights, autocast, said):
    """``force_upcast`` casts only Stable Diffusion's float16 VAE (float32 as it decodes), and only in a pipeline
    that reads it (``sd_vae`` "upcast": ``reads_force_upcast``, SDXL's; SD 1.5's reads none): a Flux or Wan VAE,
    movq, a bfloat16 VAE were told "neither their dtype nor force_upcast changes what it computes in", as was SD
    1.5's float32 VAE; a bfloat16 VAE's flat image opened with "often a black image from an fp16 VAE", and with no
    autocast it and its NaN were told "run the VAE in float32", whose range is bfloat16's."""
    from diffusion_debug.record import make_anomaly

    details = {"flat_images": [0], "image_ranges": [0.0], "vae_role": True, "sd_vae": bool(sd_vae)}
    details |= {"vae_dtype": weights, **({"reads_force_upcast": True} if sd_vae == "upcast" else {})}
    flat = make_anomaly("constant_image", component=component, details={**details, "vae_autocast": autocast})
    nan = make_anomaly(
        "nonfinite",
        component=component,
        module="decoder.conv_out",
        details={"localized_by": "full probes", **details, "vae_autocast": autocast},
    )
    assert said in flat.message
    assert ("force_upcast" in flat.message, "fp16 VAE" in flat.message) == ("nor force_upcast" in said, False)
    if autocast:
        assert said in nan.message and ("force_upcast" in nan.message) == ("nor force_upcast" in said)
