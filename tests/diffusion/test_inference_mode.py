"""``with torch.inference_mode():`` around the call behaves as ``no_grad``: no warning on a clean
run, the same image, the same origin for a planted fault."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from diffusion_helpers import run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite

UNET_LEAF = "up_blocks.1.resnets.0.conv2"
VAE_LEAF = "decoder.up_blocks.0.resnets.0.conv2"


def watched(pipe, tmp_path, mode, plant=None):
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), level="basic"))
    handle = plant(pipe) if plant else contextlib.nullcontext()
    with handle, dbg, mode():
        images = run(pipe, steps=2)
    anomalies = [(a.kind, a.severity, a.component, a.module, a.step) for a in dbg.report().anomalies]
    dbg.close()
    return images, anomalies


@pytest.mark.parametrize("where", [None, "unet", "vae"])
def test_inference_mode_gives_what_no_grad_gives(pipes, tmp_path, where):
    pipe = pipes["sd"]
    plant = None
    if where == "unet":
        plant = lambda p: plant_nonfinite(p.unet.get_submodule(UNET_LEAF), from_call=1)  # noqa: E731
    elif where == "vae":
        plant = lambda p: plant_nonfinite(p.vae.get_submodule(VAE_LEAF))  # noqa: E731
    images, expected = watched(pipe, tmp_path / "no_grad", torch.no_grad, plant)
    inference_images, found = watched(pipe, tmp_path / "inference", torch.inference_mode, plant)
    np.testing.assert_array_equal(inference_images, images)
    assert found == expected
    assert not [a for a in found if a[0] == "debugger_error"]
    if where is None:
        assert {kind for kind, *_ in found} <= {"scheduler_config"}
    else:
        errors = [a for a in found if a[1] == "error"]
        assert errors[0][2:4] == (where, UNET_LEAF if where == "unet" else VAE_LEAF)


def test_the_last_step_of_a_call_with_no_decode_is_read_before_the_call_returns(pipes, tmp_path):
    # output_type="latent": no component call follows the loop, so the step read late used to wait
    # for the next call or report(), holding its tensors, and replayed outside the call's inference_mode
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), level="basic"))
    with plant_nonfinite(pipe.unet.get_submodule(UNET_LEAF), from_call=1), dbg, torch.inference_mode():
        run(pipe, steps=2, output_type="latent")
        pending, recorded = dbg._steps.pending, [a for a in dbg.record.anomalies if a.kind == "nonfinite"]
    assert pending is None
    assert [(a.severity, a.component, a.module, a.step) for a in recorded] == [("error", "unet", UNET_LEAF, 1)]
    assert not [a for a in dbg.record.anomalies if a.kind == "debugger_error"]
    dbg.close()
