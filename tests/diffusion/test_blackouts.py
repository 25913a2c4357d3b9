"""Black images that are not NaN: a safety-checker blackout and a constant decoded image are
anomalies of their own kinds (the latents and the VAE output were finite)."""

from __future__ import annotations

import torch
from diffusion_helpers import plant, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.blackouts import flagged_images
from diffusion_debug.record import kind_info


def test_a_safety_checker_blackout_is_an_anomaly_and_the_wrapper_goes_on_detach(pipes, tmp_path):
    pipe = pipes["sd"]

    def flagging_checker(image, device, dtype):  # what a safety checker does to a flagged image
        return torch.zeros_like(torch.as_tensor(image)), [True]

    pipe.run_safety_checker = flagging_checker  # the instance attribute the debugger wraps
    try:
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path)))
        with dbg:
            assert pipe.run_safety_checker is not flagging_checker
            run(pipe, steps=2)
        assert pipe.run_safety_checker is flagging_checker  # detach put the user's attribute back
        (blackout,) = [a for a in dbg.report().anomalies if a.kind == "safety_blackout"]
        assert blackout.severity == "warning" and blackout.component == "safety_checker"
        assert blackout.details["flagged_images"] == [0]
        assert "replaced them with black images" in blackout.message
        assert not [a for a in dbg.report().anomalies if a.kind in ("nonfinite", "constant_image")]
        run(pipe, steps=1)  # detached: not seen
        assert len([a for a in dbg.report().anomalies if a.kind == "safety_blackout"]) == 1
        dbg.close()
    finally:
        del pipe.run_safety_checker
    assert kind_info("safety_blackout").severity == "warning"


def test_no_safety_checker_no_anomaly(pipes, tmp_path):
    pipe = pipes["sd"]
    assert pipe.safety_checker is None  # run_safety_checker returns (image, None)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path)))
    with dbg:
        run(pipe, steps=2)
    assert not [a for a in dbg.report().anomalies if a.kind in ("safety_blackout", "constant_image")]
    assert "run_safety_checker" not in vars(pipe)
    dbg.close()
    assert flagged_images(None) == [] and flagged_images(torch.tensor([False, True])) == [1]


def test_a_constant_decoded_image_is_an_anomaly(pipes, tmp_path):
    pipe = pipes["sd"]
    with plant(pipe.vae.decoder, 0, lambda out: torch.zeros_like(out)):  # finite, but one flat colour
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path)))
        with dbg:
            run(pipe, steps=2)
    (constant,) = [a for a in dbg.report().anomalies if a.kind == "constant_image"]
    assert constant.component == "vae" and constant.details["flat_images"] == [0]
    assert not [a for a in dbg.report().anomalies if a.kind in ("nonfinite", "vae_saturation")]
    dbg.close()
