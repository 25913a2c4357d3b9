"""Text encoders under float16 autocast (CPU autocast here, as users run CUDA's): Flux's CLIP and T5, whose
sublayers' projections the sentinel reads (T5's attention returns float32's min in ``position_bias``); an Inf an fp16
T5 block clamps (to ``finfo.max - 1000``) is one ``nonfinite`` error at the module that made it each run, where the
block's replay can run, cannot, or localize is off, and not swallowed as a near-max block's clip. Split from
test_fp16_autocast.py (its helpers: autocast_helpers.py)."""

from __future__ import annotations

import diffusion_helpers as helpers
import numpy as np
import pytest
import torch
from autocast_helpers import FP16_MAX, autocast, cfg, found

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing.features import clip_name


def test_clean_flux_text_encoders_under_fp16_autocast_stay_quiet_with_their_projections_read(tmp_path):
    """Flux's text encoders (a CLIP, a T5 whose attention returns float32's min in ``position_bias``) under float16
    autocast: their sublayers' projections (``out_proj`` and ``fc2``, T5's ``o`` and ``wo``) are read by the
    sentinel from the second run on, and clean runs warn nothing of them; each image is bitwise the unwatched
    one."""
    from diffusion_debug.testing import tiny_pipeline
    from diffusion_debug.testing.flux import FLUX_CALL

    pipe = tiny_pipeline("flux")

    def call():
        with autocast():
            return pipe(**FLUX_CALL[0](), num_inference_steps=1, generator=torch.Generator().manual_seed(0)).images

    plain = call()
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    watched = []
    for _ in range(3):
        with dbg:
            watched.append(call())
            modules = {name: list(probe.module_names) for name, probe in dbg._steps.probes.probes.items()}
    assert [np.array_equal(image, plain) for image in watched] == [True, True, True]
    assert dbg._steps.probes.levels["text_encoder_2"] == "sentinel"
    assert [m for m in modules["text_encoder"] if m.endswith(("out_proj", "fc2"))] == [
        clip_name(f"encoder.layers.{i}.{name}") for i in (0, 1) for name in ("self_attn.out_proj", "mlp.fc2")
    ]
    assert [m for m in modules["text_encoder_2"] if m.endswith((".o", ".wo"))] == [
        "encoder.block.0.layer.0.SelfAttention.o",
        "encoder.block.0.layer.1.DenseReluDense.wo",
    ]
    assert [a for a in dbg.report().anomalies if a.component.startswith("text_encoder")] == []
    dbg.close()


def t5_making_an_inf(**extra):
    """A tiny Flux whose float16 T5 (``text_encoder_2``) under float16 autocast has ``wo`` make an Inf (2x float16's
    max, at each of its calls), which T5's block clamps to ``finfo.max - 1000`` (64504, held in float16 as 64512);
    and its call (with ``extra`` arguments)."""
    from diffusion_debug.testing import tiny_pipeline
    from diffusion_debug.testing.flux import FLUX_CALL

    pipe = tiny_pipeline("flux")
    wo = pipe.text_encoder_2.to(torch.float16).get_submodule(helpers.T5_WO)
    args = {**FLUX_CALL[0](), **extra}
    args.pop("output_type", None)

    def call():
        with autocast():
            pipe(**args, num_inference_steps=1, generator=torch.Generator().manual_seed(0), output_type="latent")

    peaks = []
    handle = wo.register_forward_hook(lambda _m, _a, out: peaks.append(out.abs().max().item()))
    call()
    handle.remove()
    with torch.no_grad():
        wo.weight.mul_(2 * FP16_MAX / min(peaks))
    return pipe, call


T5_CLIP = (
    f"text_encoder_2.{helpers.T5_WO} produced Inf from finite inputs (float16 overflow); text_encoder_2.encoder."
    "block.0 clipped it to 64512, below float16's largest value (65504), so the output stayed finite but carries "
    "that clipped value, not the one computed (check its dtype, inputs and weights; try float32 or bfloat16)."
)
"""The error at T5's ``wo`` whose Inf its block clamped: the value the block clamps to said (it said 65504)."""


def test_an_inf_an_fp16_t5_block_clipped_is_one_error_each_run_with_its_projection_read(tmp_path):
    """An fp16 T5 under float16 autocast whose ``wo`` makes an Inf (2x float16's max): T5's block clamps it to
    64512. From the second run the sentinel reads ``wo`` (its residual projection) and the block in one call: it
    saw the Inf and the near-max block together, and reported a generic NaN/Inf at ``wo`` plus a near-overflow at
    the block. The block's near-max value is the clip's consequence: each run has the one error at ``wo``, with
    the clip said (the value T5 clamps to, not float16's largest), as the first run's full probes found it."""
    pipe, call = t5_making_an_inf()
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    for _ in range(3):
        with dbg:
            call()
    for number in (1, 2, 3):
        assert found(dbg, number) == [("nonfinite", "error", "text_encoder_2", helpers.T5_WO, None)], number
        (error,) = [a for a in dbg.report().anomalies if a.kind == "nonfinite" and a.details.get("run") == number]
        assert error.message == T5_CLIP
        assert (error.details["clipped_in"], error.details["clipped_to"]) == ("encoder.block.0", 64512.0)
    dbg.close()


def test_an_inf_a_sentinel_read_its_t5_block_clipping_is_an_error_where_the_blocks_replay_cannot_run(
    tmp_path, monkeypatch
):
    """The T5 above, its block's replay unable to run (no kept call, a replay OOM: ``Localizer.replay`` gives
    None). From the second run the sentinel read ``wo``'s Inf inside the block at T5's clamp, and the block's replay
    was to name it: without it, each run's finding was the block's near-overflow warning, the Inf lost. The Inf is
    the error at ``wo`` as the sentinel read it, the clip said; no warning."""
    from diffusion_debug.diffusion.localize import Localizer
    from diffusion_debug.diffusion.replay.decide import CLIP_UNREPLAYED

    pipe, call = t5_making_an_inf()
    replays = []
    monkeypatch.setattr(Localizer, "replay", lambda _self, *asked: replays.append(asked[:2]))
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    for _ in range(3):
        with dbg:
            call()
    assert replays == [("text_encoder_2", "encoder.block.0")] * 2  # (runs 2 and 3; run 1 read it fully)
    for number in (2, 3):
        assert found(dbg, number) == [("nonfinite", "error", "text_encoder_2", helpers.T5_WO, None)], number
        (error,) = [a for a in dbg.report().anomalies if a.kind == "nonfinite" and a.details.get("run") == number]
        assert error.message == T5_CLIP
        assert (error.details["localized_by"], error.details["clipped_in"]) == (CLIP_UNREPLAYED, "encoder.block.0")
    dbg.close()


def test_an_inf_a_t5_called_twice_a_call_clipped_is_its_one_error_where_the_blocks_replay_cannot_run(
    tmp_path, monkeypatch
):
    """True CFG (a negative prompt, ``true_cfg_scale`` > 1) calls the Flux's T5 twice a pipeline call, its block's
    replay unable to run. The first call's Inf was the error at ``wo`` as the sentinel read it (the block tried this
    run); at the second the tried block was no longer decided as the clip: its near-max value, the clip's consequence,
    was an ``overflow_risk`` at ``encoder.block.0`` beside the error. One cause, one finding: the error at ``wo``."""
    import inspect

    from diffusers import FluxPipeline

    from diffusion_debug.diffusion.localize import Localizer
    from diffusion_debug.diffusion.replay.decide import CLIP_UNREPLAYED

    if "true_cfg_scale" not in inspect.signature(FluxPipeline.__call__).parameters:
        pytest.skip("FluxPipeline without true_cfg_scale (diffusers < 0.33)")
    pipe, call = t5_making_an_inf(negative_prompt="a dog", true_cfg_scale=2.0)
    replays = []
    monkeypatch.setattr(Localizer, "replay", lambda _self, *asked: replays.append(asked[:2]))
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    for _ in range(2):
        with dbg:
            call()
    assert replays == [("text_encoder_2", "encoder.block.0")]  # run 2's first T5 call (run 1 read it fully)
    assert found(dbg, 2) == [("nonfinite", "error", "text_encoder_2", helpers.T5_WO, None)]
    (error,) = [a for a in dbg.report().anomalies if a.kind == "nonfinite" and a.details.get("run") == 2]
    assert error.message == T5_CLIP
    assert (error.details["localized_by"], error.details["clipped_in"]) == (CLIP_UNREPLAYED, "encoder.block.0")
    dbg.close()


def test_an_inf_inside_a_near_max_block_localised_before_is_an_error_not_swallowed_as_its_clip(tmp_path):
    """An fp16 T5 under float16 autocast whose embeddings and ``wo`` run near float16's max: runs 1-2 localise the
    near-max at ``encoder.block.0.layer.1`` (kept for the debugger's life). Then ``wo`` makes an Inf (2x the max):
    the sentinel reads it inside that near-max block. Decided as the block's clip where no replay of the block would
    run again (localised before), the Inf was swallowed: an overflow warning, no error. Each such run has the error."""
    from diffusion_debug.testing import tiny_pipeline
    from diffusion_debug.testing.flux import FLUX_CALL

    wo_name = helpers.T5_WO
    pipe = tiny_pipeline("flux")
    pipe.text_encoder_2.to(torch.float16)
    args = FLUX_CALL[0]()
    args.pop("output_type", None)

    def call():
        with autocast():
            pipe(**args, num_inference_steps=1, generator=torch.Generator().manual_seed(0), output_type="latent")

    wo_at = helpers.t5_near_max(pipe.text_encoder_2, call)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    for scale in (0.3, 0.3, 2.0, 2.0):
        wo_at(scale)
        with dbg:
            call()
    near = ("overflow_risk", "warning", "text_encoder_2", "encoder.block.0.layer.1", None)
    assert found(dbg, 1) == found(dbg, 2) == [near]
    for number in (3, 4):
        errors = [a for a in found(dbg, number) if a[1] == "error"]
        assert errors == [("nonfinite", "error", "text_encoder_2", wo_name, None)], number
    dbg.close()


def test_an_inf_an_fp16_t5_block_clipped_is_one_error_each_run_with_localize_off(tmp_path):
    """The T5 above with ``localize=False`` (no replay): the sentinel read ``wo``'s Inf inside the block at T5's
    clamp, and each call gave two findings, a generic error at ``wo`` ('produced NaN/Inf from finite inputs') and an
    ``overflow_risk`` warning at ``encoder.block.0`` (its near-max value, the clip's consequence), at every run of the
    default level (from the second; every run at ``basic`` and ``advanced``). One cause, one finding: the error at
    ``wo`` as the sentinel read it, the clip said, as where the block's replay cannot run."""
    from diffusion_debug.diffusion.replay.decide import CLIP_UNLOCALISED

    pipe, call = t5_making_an_inf()
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", localize=False))
    try:
        for _ in range(3):
            with dbg:
                call()
        runs = {number: found(dbg, number) for number in (2, 3)}
        anomalies = dbg.report().anomalies
    finally:
        dbg.close()
    for number in (2, 3):
        assert runs[number] == [("nonfinite", "error", "text_encoder_2", helpers.T5_WO, None)], number
        (error,) = [a for a in anomalies if a.kind == "nonfinite" and a.details.get("run") == number]
        assert error.message == T5_CLIP
        assert (error.details["localized_by"], error.details["clipped_in"]) == (CLIP_UNLOCALISED, "encoder.block.0")
