"""float32 pipelines run under ``torch.autocast(..., dtype=torch.float16)`` (CPU autocast here, as users run
CUDA's): their matmuls compute in float16 and can overflow though every weight is float32. The default probes
follow the autocast state as each run begins, not as the debugger attached; a float32 residual stream autocast
leaves (CLIP's layers) is not read against float16's largest value (only norms take it); and the advice for
values near it is about autocast, not the weights' dtype.

Each fault is planted by scaling a module's weights so that its float16 output under autocast reaches a
share of 65504 and stays finite. Devices and replays under autocast: test_fp16_autocast_replays.py; text
encoders (Flux's CLIP and T5, a T5 block's clamped Inf): test_fp16_autocast_t5.py; DiTs: test_fp16_autocast_dit.py."""

from __future__ import annotations

import diffusion_helpers as helpers
import numpy as np
import pytest
import torch
from autocast_helpers import FP16_MAX, REPLAYED, UNET_ATTENTION_OUT, autocast, cfg, found, near_max, to_out_inf
from diffusion_helpers import run, scaled

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing.features import clip_name

FC1, FC2 = clip_name("encoder.layers.0.mlp.fc1"), clip_name("encoder.layers.0.mlp.fc2")


def _under_autocast_np(pipe):
    with autocast():
        return run(pipe, steps=2)


def test_a_debugger_attached_before_fp16_autocast_warns_a_float32_unets_near_max_at_its_module_and_step(
    pipes, tmp_path
):
    """Attached outside the user's ``with torch.autocast(...)``, the float32 UNet was probed as float32 (its
    output checked, no sentinel: float32 has room), and its float16 matmul at 90% of the max inside autocast
    was never warned. The probes are decided again as the run begins, under autocast: the block's sentinel,
    the replay names the Linear at step 0 (later steps fold into it)."""
    pipe = pipes["sd"]
    with near_max(pipe, "unet", UNET_ATTENTION_OUT, 0.9):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        with dbg, autocast():
            run(pipe, steps=3, output_type="latent")
    assert found(dbg) == [("overflow_risk", "warning", "unet", UNET_ATTENTION_OUT, 0)]
    (risk,) = [a for a in dbg.report().anomalies if a.kind == "overflow_risk"]
    details = risk.details
    assert (details["localized_by"], details["dtype"], details["weights_dtype"]) == (REPLAYED, "float16", "float32")
    assert details["dtype_max_fraction"] == pytest.approx(0.9, abs=0.06)
    assert risk.message == (
        f"unet.{UNET_ATTENTION_OUT} output reached {details['dtype_max_fraction']:.0%} of the float16 maximum "
        f"(|x|={details['absmax']:.4g}); it ran under float16 autocast (its weights are float32): autocast to "
        f"bfloat16 instead (torch.autocast(..., dtype=torch.bfloat16)) or run unet.{UNET_ATTENTION_OUT} outside "
        "autocast."
    )
    dbg.close()


def test_a_large_float32_stream_no_float16_op_takes_stays_quiet_under_fp16_autocast(pipes, tmp_path):
    """A CLIP layer's residual stream stays float32 under autocast (float32 embeddings plus float16 matmuls) and
    goes only to layer norms, which autocast runs in float32: every matmul takes it normalised. Its embeddings
    scaled so that the stream reaches 60% of float16's max change no float16 value, so the run stays quiet (read
    against float16's max, the stream was warned at the last layer: a false overflow_risk on a clean run)."""
    pipe = pipes["sd"]
    embeddings = pipe.text_encoder.get_submodule(clip_name("embeddings"))
    layers = pipe.text_encoder.get_submodule(clip_name("encoder.layers"))
    last = layers[len(layers) - 1]
    peaks = []
    handle = embeddings.register_forward_hook(lambda _m, _a, out: peaks.append(out.abs().max().item()))
    with autocast():
        run(pipe, steps=1, output_type="latent")
    handle.remove()
    saved = [p.detach().clone() for p in embeddings.parameters()]
    by = 0.6 * FP16_MAX / max(peaks)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    try:
        with torch.no_grad():
            for p in embeddings.parameters():
                p.mul_(by)
        with autocast(), dbg:  # (attached under it: its first run reads the text encoder fully)
            run(pipe, steps=2, output_type="latent")
        peaks.clear()
        handle = last.register_forward_hook(lambda _m, _a, out: peaks.append(out[0].abs().max().item()))
        with autocast(), dbg:
            run(pipe, steps=2, output_type="latent")
        handle.remove()
    finally:
        with torch.no_grad():
            for p, kept in zip(embeddings.parameters(), saved):
                p.copy_(kept)
    assert max(peaks) == pytest.approx(0.6 * FP16_MAX, rel=0.1)  # the stream the sentinel saw, float32
    assert found(dbg) == []
    dbg.close()


def test_a_nan_made_from_near_max_values_under_fp16_autocast_advises_autocast_at_their_maker(tmp_path):
    """``fc1`` at 90% of float16's max under autocast, and ``fc2``, given them, overflows: the error is at
    ``fc1``, whose advice was 'run this component in bfloat16 or float32, or upcast this module' (it is float32
    already); it is now about autocast, as an ``overflow_risk``'s is. A pipeline of its own: its first run reads
    the text encoder with full probes (the session's shared one had been read so by an earlier test, and this test
    passed in its file and failed alone), its second with the sentinel. Under full probes the negative prompt's
    call (CFG) was given the prompt's call's output reading first (read after the call's end was marked): a second
    error, 'text_encoder produced NaN/Inf ... in its own forward', which became the run's origin."""
    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd")
    fc2 = pipe.text_encoder.get_submodule(FC2)
    with near_max(pipe, "text_encoder", FC1, 0.9), scaled(fc2, 10.0):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        for _ in range(2):
            with dbg, autocast():
                run(pipe, steps=2, output_type="latent")
    errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert [(a.kind, a.component, a.module, a.step, a.details["run"]) for a in errors] == [
        ("nonfinite", "text_encoder", FC1, None, 1),
        ("nonfinite", "text_encoder", FC1, None, 2),
    ]
    assert [a.details["localized_by"] for a in errors] == ["full probes", REPLAYED]
    (unet,) = [a for a in dbg.report().anomalies if a.component == "unet" and a.details.get("run") == 1]
    assert unet.details["origin"] == f"text_encoder {FC1}"
    error = errors[0]
    details = error.details
    assert (details["overflowed_in"], details["dtype"], details["weights_dtype"]) == (FC2, "float16", "float32")
    assert error.message == (
        f"text_encoder.{FC1} made values at {details['near_max']:.0%} of the float16 maximum "
        f"(|x|={details['absmax']:.4g}), and text_encoder.{FC2}, given them, produced NaN/Inf (its arithmetic "
        "overflowed on them: a norm's variance, a matmul); it ran under float16 autocast (its weights are float32): "
        f"autocast to bfloat16 instead (torch.autocast(..., dtype=torch.bfloat16)) or run text_encoder.{FC1} "
        "outside autocast."
    )
    dbg.close()


def test_an_inf_a_float32_module_makes_under_fp16_autocast_advises_autocast_not_its_dtype(pipes, tmp_path):
    """``to_out`` at 4x float16's max under autocast (its weights float32) makes an Inf at step 0 from inputs well
    below the max: the error's advice was "try float32 or bfloat16" (it is float32 already, and the dtype its
    weights are in does not change what autocast computes in); it is about autocast, as an ``overflow_risk``'s is."""
    with to_out_inf(pipes["sd"], tmp_path) as (_, error):
        pass
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "unet", UNET_ATTENTION_OUT, 0)
    assert (error.details["localized_by"], error.details["weights_dtype"]) == (REPLAYED, "float32")
    assert error.message == (
        f"unet.{UNET_ATTENTION_OUT} produced NaN/Inf from finite inputs; it ran under float16 autocast (its weights "
        "are float32): autocast to bfloat16 instead (torch.autocast(..., dtype=torch.bfloat16)) or run "
        f"unet.{UNET_ATTENTION_OUT} outside autocast."
    )


def test_clean_runs_in_and_out_of_fp16_autocast_are_quiet_and_bitwise_equal_under_one_attach(pipes, tmp_path):
    """One attach, runs under autocast and out of it in turn (the probes decided again at each change): each
    image is bitwise the unwatched one, and nothing is warned."""
    pipe = pipes["sd"]
    plain_autocast = _under_autocast_np(pipe)
    plain = run(pipe, steps=2)
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        watched = [_under_autocast_np(pipe), run(pipe, steps=2), _under_autocast_np(pipe)]
    assert [np.array_equal(image, expected) for image, expected in zip(watched, [plain_autocast, plain] * 2)] == [
        True,
        True,
        True,
    ]
    assert found(dbg) == []
    assert helpers.pipeline_hooks(pipe) == 0
    dbg.close()


def test_a_near_max_made_inside_a_float32_stream_under_fp16_autocast_is_warned_after_the_first_read(pipes, tmp_path):
    """``fc2`` at 60% of float16's max under autocast (weights float32): its float16 output is added to the CLIP
    layer's float32 stream, whose float32 outputs the sentinel does not read against float16's max. The full
    read of the first run warns it; a later run's sentinel read nothing float16 of the layers and did not. It
    reads each sublayer's float16 residual projection (``out_proj``, ``fc2``): the second run warns it too."""
    pipe = pipes["sd"]
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with autocast(), dbg:
        run(pipe, steps=1, output_type="latent")  # the text encoder read fully, clean
    with near_max(pipe, "text_encoder", FC2, 0.6, steps=1):
        with autocast(), dbg:
            run(pipe, steps=1, output_type="latent")
    assert dbg._steps.probes.levels["text_encoder"] == "sentinel"
    assert found(dbg, 1) == []
    assert found(dbg, 2) == [("overflow_risk", "warning", "text_encoder", FC2, None)]
    dbg.close()


FLAT_UNDER_AUTOCAST = {
    "float16": "1 decoded image(s) are a single flat colour; vae ran under float16 autocast (its weights are "
    "float32, so their dtype does not change what it computes in): check the latents' scaling factor, the latents "
    "reaching it (the step table) and its weights; if the latents and weights are finite, autocast to bfloat16 "
    "instead (torch.autocast(..., dtype=torch.bfloat16)) or run vae outside autocast.",
    "bfloat16": "1 decoded image(s) are a single flat colour; vae ran under bfloat16 autocast (its weights are "
    "float32), whose range is float32's, so this is no overflow of a narrow dtype: check the latents' scaling "
    "factor, the latents reaching it (the step table) and its weights.",
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_flat_image_a_float32_vae_decoded_under_autocast_names_the_autocast_not_its_dtype(pipes, tmp_path, dtype):
    """A float32 VAE decodes in the autocast's dtype: its flat image was read as an fp16 VAE's ('often a black image
    from an fp16 VAE: keep the VAE in float32 (pipe.vae.to(torch.float32) or vae.config.force_upcast=True) ...', and
    under bfloat16 autocast 'run the VAE in float32'), advice it already follows. The message names the autocast."""
    pipe = pipes["sd"]
    with helpers.plant(pipe.vae.decoder, 0, lambda out: out * 0 + 3.0):
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", level="basic"))
        try:
            with dbg, torch.autocast("cpu", dtype=dtype):
                run(pipe, steps=2)
            anomalies = dbg.report().anomalies
        finally:
            dbg.close()  # (the shared pipeline unhooked, whatever failed)
    (flat,) = [a for a in anomalies if a.kind == "constant_image"]
    name = str(dtype).removeprefix("torch.")
    assert (flat.details["vae_dtype"], flat.details["decoded_dtype"], flat.details["vae_autocast"]) == (
        "float32",
        name,
        name,
    )
    assert flat.message == FLAT_UNDER_AUTOCAST[name]
