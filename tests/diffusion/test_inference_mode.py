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
