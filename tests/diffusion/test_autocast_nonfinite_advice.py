"""The advice of a ``nonfinite`` error a float32 module made under ``torch.autocast``: about autocast only for a
float16 overflow (its weights finite: bfloat16 autocast or no autocast avoids it); a NaN weight's NaN, or any NaN/Inf
under bfloat16 autocast, keeps the generic advice (its inputs and weights), and a float32 VAE keeps its own."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from diffusion_helpers import run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion import checks

TO_OUT = "up_blocks.1.attentions.1.transformer_blocks.0.attn1.to_out.0"
GENERIC = "check its dtype, inputs and weights; try float32 or bfloat16"


@contextlib.contextmanager
def nan_weight(module):
    """One NaN in ``module``'s weight while the block runs, put back after."""
    flat = module.weight.view(-1)
    kept = flat[0].item()
    with torch.no_grad():
        flat[0] = math.nan
    try:
        yield
    finally:
        with torch.no_grad():
            flat[0] = kept


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_a_nan_weight_of_a_float32_module_under_autocast_keeps_the_generic_advice(pipes, tmp_path, autocast_dtype):
    """A NaN in a float32 ``to_out``'s weight under autocast: under bfloat16 autocast its message read "it ran
    under float16 autocast ... autocast to bfloat16 instead", under float16 autocast the same: neither fixes a NaN
    weight, and "check its ... weights" was gone. It reads as without autocast."""
    pipe = pipes["sd"]
    with nan_weight(pipe.unet.get_submodule(TO_OUT)):
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
        try:
            with torch.autocast("cpu", dtype=autocast_dtype), dbg:
                run(pipe, steps=2, output_type="latent")
            errors = [a for a in dbg.report().anomalies if a.severity == "error"]
        finally:
            dbg.close()
    (error,) = errors
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "unet", TO_OUT, 0)
    assert "weights_dtype" not in error.details
    assert error.message == f"unet.{TO_OUT} produced NaN/Inf from finite inputs ({GENERIC})."


VAE_FP16 = (
    "it ran under float16 autocast (its weights are float32, so their dtype does not change what it computes in): "
    "check its weights and inputs; if they are finite, autocast to bfloat16 instead "
    "(torch.autocast(..., dtype=torch.bfloat16)) or run vae outside autocast"
)
VAE_BF16 = (
    "it ran under bfloat16 autocast (its weights are float32), whose range is float32's, so this is no overflow of "
    "a narrow dtype: check its weights and inputs"
)
"""A float32 VAE's advice under autocast where no float16 overflow of its module was read (a NaN weight); SD 1.5's
pipeline reads no ``force_upcast``, so its float32 weights are not said to be that flag's doing."""


@pytest.mark.parametrize("autocast_dtype", [torch.float16, torch.bfloat16])
def test_a_nan_weight_of_a_float32_vae_under_autocast_is_not_told_it_ran_in_float32(pipes, tmp_path, autocast_dtype):
    """A NaN in a float32 VAE's ``decoder.conv_in`` weight under autocast: its advice read "it ran in float32, so this
    is no half-precision overflow", false under autocast (it computed in float16, or bfloat16). It says the autocast
    it ran under, and what to check."""
    pipe = pipes["sd"]
    with nan_weight(pipe.vae.get_submodule("decoder.conv_in")):
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
        try:
            with torch.autocast("cpu", dtype=autocast_dtype), dbg:
                run(pipe, steps=1)
            errors = [a for a in dbg.report().anomalies if a.severity == "error"]
        finally:
            dbg.close()
    (error,) = errors
    assert (error.kind, error.component, error.module) == ("nonfinite", "vae", "decoder.conv_in")
    advised = VAE_FP16 if autocast_dtype == torch.float16 else VAE_BF16
    assert error.message == f"vae.decoder.conv_in produced NaN/Inf from finite inputs; {advised}."


def advice(read_as, role="", weights="float32", **details):
    """The message and ``weights_dtype`` of the error at ``m`` (``weights``) under autocast to ``read_as``."""
    with torch.autocast("cpu", dtype=getattr(torch, read_as)):
        (anomaly,) = checks.nonfinite(
            "vae" if role else "unet", "m", step=0, timestep=None, localized_by="full probes", role=role,
            dtype=weights, read_as=read_as, details=details, autocast=read_as,
        )  # fmt: skip
    return anomaly.message, anomaly.details.get("weights_dtype")


def test_only_a_float16_inf_of_a_float32_module_is_advised_about_autocast():
    """``read_as``: the dtype the output was read in (its weights finite): float16 from float32 weights is autocast's;
    bfloat16 autocast's NaN/Inf is no float16 overflow, and a float32 VAE's advice stays."""
    ac = (
        "it ran under float16 autocast (its weights are float32): autocast to bfloat16 instead "
        "(torch.autocast(..., dtype=torch.bfloat16)) or run unet.m outside autocast"
    )
    assert advice("float16") == (f"unet.m produced NaN/Inf from finite inputs; {ac}.", "float32")
    assert advice("bfloat16") == (f"unet.m produced NaN/Inf from finite inputs ({GENERIC}).", None)
    assert advice("bfloat16", role="vae") == (f"vae.m produced NaN/Inf from finite inputs; {VAE_BF16}.", None)
    clip = {"clipped_in": "b", "dtype": "bfloat16", "dtype_max": 3.4e38, "clipped_to": None}
    assert advice("bfloat16", **clip) == (
        "unet.m produced Inf from finite inputs (bfloat16 overflow); unet.b clipped it to bfloat16's largest value "
        f"(3.4e+38), so the output stayed finite but carries that clipped value, not the one computed ({GENERIC}).",
        None,
    )


def test_an_inf_given_with_its_inputs_inside_a_clipping_block_is_not_carried_as_made_from_finite_inputs():
    """The sentinel read T5's ``wo`` Inf with Inf INPUTS inside its block at the clamp: the plan carried it
    (``Overflow.inf``) whatever its inputs, and a replay unable to run made it the error "wo produced Inf from finite
    inputs". Carried only where the first NaN/Inf is the producer (its inputs finite or not read)."""
    from diffusion_debug.diffusion.replay.decide import ReplayMemory, decide
    from diffusion_debug.probes import ModuleReading as R

    wo = R("encoder.block.0.layer.1.DenseReluDense.wo", 0, "float16", math.inf, math.inf, "float16")
    block = R("encoder.block.0", 0, "float16", 100.0, 64512.0, "float16")

    def plan(reading):
        readings = [reading, block]
        return decide("te", checks.suspects(readings, 0.9), readings, memory=ReplayMemory(), output_finite=True,
                      full=False, leaf=lambda c, m: False, received=lambda c, s: True, unwatched=None, localize=True,
                      site="", fraction=0.9).overflow  # fmt: skip

    given = plan(wo)
    assert (given.replay, given.inf) == ("encoder.block.0", None)
    assert ReplayMemory().overflow_shown(given, None, 0).clipped is None
    made = wo._replace(input_value=1.0)
    assert plan(made).inf == made


def test_a_nan_weight_stored_in_float8_is_named_at_its_module(tmp_path):
    """diffusers' layerwise casting stores a UNet's weights in float8 (computing in float32): ``isfinite`` is not
    implemented for float8, and the check of the module's weights (whether autocast advice fits) raised inside the
    error's making: a debugger_error, and the NaN named at ``unet`` with no module one step late. No autocast here:
    the weights are read only for a float16 output under autocast, and a weight it cannot read is no evidence."""
    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd")
    if not hasattr(pipe.unet, "enable_layerwise_casting"):
        pytest.skip("diffusers without layerwise casting")
    with torch.no_grad():
        pipe.unet.get_submodule(TO_OUT).weight[0, 0] = math.nan
    pipe.unet.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    try:
        with dbg:
            run(pipe, steps=2, output_type="latent")
        found = [(a.severity, a.kind, a.component, a.module, a.step) for a in dbg.report().anomalies]
    finally:
        dbg.close()
    assert ("error", "nonfinite", "unet", TO_OUT, 0) in found
    assert not [f for f in found if f[1] == "debugger_error"]


def test_weights_it_cannot_read_count_as_not_finite():
    """Meta (accelerate's sequential offload between calls) and float8 weights: no answer, so no autocast advice,
    never an exception inside an error's making."""
    from diffusion_debug.diffusion.components.computes_in import weights_finite

    with torch.device("meta"):
        meta = torch.nn.Linear(2, 2)
    fp8 = torch.nn.Linear(2, 2).to(torch.float8_e4m3fn)
    assert (weights_finite(meta, ""), weights_finite(fp8, ""), weights_finite(torch.nn.Linear(2, 2), "")) == (
        False,
        False,
        True,
    )
