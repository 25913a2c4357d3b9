"""Component roles as a registry: Kandinsky's ``movq`` gets the VAE's checks, and a role added
in a few lines gets that role's behaviour."""

from __future__ import annotations

import pytest
import torch
from diffusion_helpers import plant

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion import checks
from diffusion_debug.diffusion.components import roles
from diffusion_debug.diffusion.components.inventory import Component, call_phase, call_sites, is_loop_role, role_of
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.zoo import ZOO_CALLS


@pytest.fixture(scope="module")
def kandinsky():
    return tiny_pipeline("kandinsky_decoder")


def watched(pipe, tmp_path, **kwargs):
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", **kwargs))
    with dbg:
        pipe(**ZOO_CALLS["kandinsky_decoder"][0](), num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    return dbg.report()


def test_movq_nonfinite_gets_the_vae_advice(kandinsky, tmp_path):
    with plant_nonfinite(kandinsky.movq.get_submodule("decoder.conv_in")):
        report = watched(kandinsky, tmp_path, level="basic")
    (origin,) = [a for a in report.anomalies if a.kind == "nonfinite" and a.severity == "error"]
    assert origin.component == "movq"
    # the VAE's role, found for movq; its advice is for a half-precision VAE: a float32 movq is not told to
    # keep to float32 (before: "keep movq in float32 (pipe.movq.to(torch.float32))")
    assert (origin.details["vae_role"], origin.details["vae_dtype"]) == (True, "float32")
    assert origin.message == (
        "movq.decoder.conv_in produced NaN/Inf from finite inputs (it ran in float32, so this is no half-precision "
        "overflow: check its weights and inputs)."
    )


def test_movq_decoded_images_get_the_vae_saturation_check(kandinsky, tmp_path):
    with plant(kandinsky.movq.decoder, 0, lambda out: out * 0 + 3.0):
        report = watched(kandinsky, tmp_path, level="basic")
    found = [(a.kind, a.component) for a in report.anomalies if a.kind in ("vae_saturation", "constant_image")]
    assert found == [("constant_image", "movq"), ("vae_saturation", "movq")]


class Upscaler(torch.nn.Module):
    """A custom component: no diffusers or transformers class name to recognise."""

    def __init__(self):
        super().__init__()
        self.encoder, self.decoder = torch.nn.Conv2d(3, 3, 1), torch.nn.Conv2d(3, 3, 1)


def test_a_role_registered_in_a_few_lines_gets_its_behaviour(monkeypatch):
    monkeypatch.setattr(roles, "_REGISTRY", dict(roles._REGISTRY))  # the test's role stays in the test
    assert role_of("upscaler", Upscaler()) == "other"
    roles.register_role(
        roles.Role("upscaler", call_phase="upscale", checks=("vae",), matches=lambda n, m: isinstance(m, Upscaler))
    )
    component = Component("upscaler", role_of("upscaler", Upscaler()), Upscaler())
    assert component.role == "upscaler" and roles.roles()[-2:] == ("upscaler", "other")
    assert call_phase("upscaler", "") == "upscale" and not is_loop_role("upscaler")
    assert [s.prefix for s in call_sites(component)] == ["encoder", "decoder"]  # the VAE's halves
    common = {"step": None, "timestep": None, "localized_by": "sentinel"}
    vae_advice = "keep upscaler in float32 (pipe.upscaler.to(torch.float32))"
    assert vae_advice in checks.nonfinite("upscaler", "decoder", role="upscaler", **common)[0].message
    assert vae_advice not in checks.nonfinite("upscaler", "decoder", role="other", **common)[0].message
