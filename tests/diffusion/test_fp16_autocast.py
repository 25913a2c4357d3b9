"""float32 pipelines run under ``torch.autocast(..., dtype=torch.float16)`` (CPU autocast here, as users run
CUDA's): their matmuls compute in float16 and can overflow though every weight is float32. The default probes
follow the autocast state as each run begins, not as the debugger attached; a float32 residual stream autocast
leaves (CLIP's layers) is not read against float16's largest value (only norms take it); and the advice for
values near it is about autocast, not the weights' dtype.

Each fault is planted by scaling a module's weights so that its float16 output under autocast reaches a
share of 65504 and stays finite."""

from __future__ import annotations

import contextlib

import diffusion_helpers as helpers
import numpy as np
import pytest
import torch
from diffusion_helpers import run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing.features import clip_name

UNET_ATTENTION_OUT = "up_blocks.1.attentions.1.transformer_blocks.0.attn1.to_out.0"
FC1, FC2 = clip_name("encoder.layers.0.mlp.fc1"), clip_name("encoder.layers.0.mlp.fc2")
REPLAYED = "sentinel -> replay with full probes"
FP16_MAX = torch.finfo(torch.float16).max


def autocast():
    return torch.autocast("cpu", dtype=torch.float16)


def cfg(tmp_path) -> DebugConfig:
    return DebugConfig(output_dir=str(tmp_path), log_level="error")


def found(dbg, run_number=None):
    """``(kind, severity, component, module, step)`` of every anomaly but the tiny pipeline's static scheduler
    warning (3 'leading' steps), of the debugger's ``run_number``-th run where given."""
    return [
        (a.kind, a.severity, a.component, a.module, a.step)
        for a in dbg.report().anomalies
        if a.kind != "scheduler_config" and (run_number is None or a.details.get("run") == run_number)
    ]


def peak_under_autocast(pipe, module, steps) -> float:
    """The largest |output| of ``module`` in a clean autocast call of ``pipe`` (its planted scale is found from it)."""
    peaks = []
    handle = module.register_forward_hook(lambda _m, _a, out: peaks.append(out.abs().max().item()))
    try:
        with autocast():
            run(pipe, steps=steps, output_type="latent")
    finally:
        handle.remove()
    return max(peaks)


@contextlib.contextmanager
def scaled(module, by: float):
    """``module``'s weight and bias multiplied by ``by`` while the block runs, put back after."""
    saved = [p.detach().clone() for p in (module.weight, module.bias)]
    with torch.no_grad():
        module.weight.mul_(by)
        module.bias.mul_(by)
    try:
        yield
    finally:
        with torch.no_grad():
            module.weight.copy_(saved[0])
            module.bias.copy_(saved[1])


def near_max(pipe, component, name, fraction, steps=3):
    """``component.name`` scaled so that its float16 output under autocast peaks at ``fraction`` of 65504."""
    module = getattr(pipe, component).get_submodule(name)
    return scaled(module, fraction * FP16_MAX / peak_under_autocast(pipe, module, steps))


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
    pipe = pipes["sd"]
    with near_max(pipe, "unet", UNET_ATTENTION_OUT, 4.0):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        with dbg, autocast():
            run(pipe, steps=2, output_type="latent")
    (error,) = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "unet", UNET_ATTENTION_OUT, 0)
    assert (error.details["localized_by"], error.details["weights_dtype"]) == (REPLAYED, "float32")
    assert error.message == (
        f"unet.{UNET_ATTENTION_OUT} produced NaN/Inf from finite inputs; it ran under float16 autocast (its weights "
        "are float32): autocast to bfloat16 instead (torch.autocast(..., dtype=torch.bfloat16)) or run "
        f"unet.{UNET_ATTENTION_OUT} outside autocast."
    )
    dbg.close()


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


def _under_autocast_np(pipe):
    with autocast():
        return run(pipe, steps=2)


def _cuda_autocast_only(monkeypatch):
    """The autocast queries answer as under ``torch.autocast("cuda", dtype=torch.float16)`` alone (this machine
    has no CUDA): the CPU's autocast is off."""
    import importlib

    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device_type="cuda": device_type == "cuda")
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: torch.float16)
    for name in ("component_probes", "autocast"):
        try:
            module = importlib.import_module(f"diffusion_debug.diffusion.components.{name}")
        except ImportError:  # (before the autocast module)
            continue
        monkeypatch.setattr(module, "ANY_AUTOCAST", lambda: True)


def test_cuda_fp16_autocast_leaves_components_on_the_cpu_probed_as_float32(tmp_path, monkeypatch):
    """Autocast is per device type: CUDA's leaves a component on the CPU (a text encoder kept there) computing in
    float32, with no overflow to watch. It was probed as under autocast (the first device type found open was
    taken for every component): full probes and sentinels on an fp32 pipeline that cannot overflow. Under the
    CPU's own float16 autocast they are probed as float16 ones; under its bfloat16 one, as float32 ones."""
    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd")
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with torch.autocast("cpu", dtype=torch.float16), dbg:
        assert dbg._steps.probes.levels == {"unet": "sentinel", "text_encoder": "full", "vae": "full"}
    with torch.autocast("cpu", dtype=torch.bfloat16), dbg:
        assert dbg._steps.probes.levels == {"unet": "output", "text_encoder": "output", "vae": "output"}
    with monkeypatch.context() as patched:
        _cuda_autocast_only(patched)
        with dbg:
            assert dbg._steps.probes.levels == {"unet": "output", "text_encoder": "output", "vae": "output"}
    dbg.close()


def test_a_component_offloaded_to_the_cpu_between_calls_is_answered_for_its_execution_device():
    """``enable_model_cpu_offload`` keeps a component's weights on the CPU until its call moves them to the GPU: its
    autocast is its execution device's (accelerate's hook names it), not the CPU's where the weights wait."""
    from accelerate.hooks import CpuOffload, add_hook_to_module

    from diffusion_debug.diffusion.components.autocast import autocast_dtype, execution_device_type

    offloaded, kept = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    add_hook_to_module(offloaded, CpuOffload(execution_device="cuda"))
    state = (("cuda", torch.float16),)
    assert [execution_device_type(offloaded), execution_device_type(kept)] == ["cuda", "cpu"]
    assert [autocast_dtype(state, execution_device_type(m)) for m in (offloaded, kept)] == [torch.float16, None]
    assert execution_device_type(torch.nn.Linear(2, 2, device="meta")) == "?"


def test_why_replays_an_fp16_autocast_overflow_under_the_autocast_it_ran_in(pipes, tmp_path):
    """``to_out`` overflowing float16 under autocast at step 0 (its weights float32): ``report.why()`` runs after
    the user's ``with torch.autocast(...)`` has closed, and replayed the call in float32, so its "as it was" row
    was finite ("does not reproduce") and no module was named. The run's autocast is kept with its calls and
    entered again: the row is non-finite, the producer the Linear; so is the bundle's own replay, and its
    meta.json says the autocast. Running outside autocast, or autocasting to bfloat16, makes it finite."""
    from diffusion_debug.diffusion import replay

    pipe = pipes["sd"]
    with near_max(pipe, "unet", UNET_ATTENTION_OUT, 4.0):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        with dbg, autocast():
            run(pipe, steps=2, output_type="latent")
        (error,) = [a for a in dbg.report().anomalies if a.severity == "error"]
        result = dbg.report().why()
        replayed = replay(dbg.report().save() / error.details["bundle"], pipe.unet)
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "unet", UNET_ATTENTION_OUT, 0)
    assert (result.component, result.module, result.step) == ("unet", UNET_ATTENTION_OUT, 0)
    assert (result.baseline.factor, result.baseline.finite) == ("as it was", False)
    assert (replayed["module"], replayed["output_finite"]) == (UNET_ATTENTION_OUT, False)
    assert replayed["meta"]["autocast"] == [["cpu", "float16"]]
    rows = {r.factor: r.finite for r in result.replays}
    assert (rows["autocast to bfloat16"], rows["outside autocast"]) == (True, True)
    assert result.fix == "autocast to bfloat16"
    dbg.close()


def test_why_under_the_users_bfloat16_autocast_replays_as_it_ran_and_in_bfloat16_each_in_its_own_dtype(
    pipes, tmp_path
):
    """The test above with ``why()`` asked while the user's bfloat16 autocast is on without a region: the row as it
    ran (float16) left its casts in the user's cache, and the bfloat16 row read them ('mat1 and mat2 must have the
    same dtype'): no row finite, no fix. Each row casts for itself; the user's autocast is as it was."""
    pipe = pipes["sd"]
    with near_max(pipe, "unet", UNET_ATTENTION_OUT, 4.0):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        try:
            with dbg, autocast():
                run(pipe, steps=2, output_type="latent")
            with users_bfloat16_autocast("no-region"):
                result = dbg.report().why()
                still = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
        finally:
            dbg.close()
    assert (result.baseline.factor, result.baseline.finite, result.baseline.error) == ("as it was", False, "")
    rows = {r.factor: (r.finite, r.error) for r in result.replays}
    assert (rows["autocast to bfloat16"], rows["outside autocast"]) == ((True, ""), (True, ""))
    assert result.fix == "autocast to bfloat16"
    assert still == (True, torch.bfloat16)


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


def test_a_component_moved_to_the_autocast_device_under_one_open_attach_is_probed_as_under_it(tmp_path):
    """A text encoder computing on another device (an accelerate hook naming CUDA: this machine has none) is left
    unprobed under the CPU's float16 autocast; moved to the CPU while one attach stays open (the same autocast,
    the same dtypes), it computes under that autocast from the next run. Its probe level was kept as the attach
    decided it (only the autocast state was compared): it is read again as the next attach would."""
    import types

    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd")
    pipe.text_encoder._hf_hook = types.SimpleNamespace(execution_device="cuda")
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    levels = []  # as each call of the text encoder begins
    probes = dbg._steps.probes
    hook = pipe.text_encoder.register_forward_pre_hook(lambda *_: levels.append(probes.levels["text_encoder"]))
    with autocast(), dbg:
        run(pipe, steps=1, output_type="latent")
        del pipe.text_encoder._hf_hook  # computes on the CPU now
        run(pipe, steps=1, output_type="latent")
        run(pipe, steps=1, output_type="latent")
    hook.remove()
    assert levels == ["output", "output", "full", "full", "sentinel", "sentinel"]  # (prompt, negative prompt)
    assert found(dbg) == []
    dbg.close()


def test_why_and_a_bundles_replay_of_a_call_made_outside_autocast_run_outside_the_callers_autocast(tmp_path):
    """An fp16 UNet whose ``to_out`` overflows, run with no autocast: ``report.why()`` and the bundle's replay asked
    inside the caller's own ``with torch.autocast("cpu", dtype=torch.bfloat16)`` ran the call under it (the
    recorded state, none, entered nothing): the "as it was" row raised a mixed dtype error. They replay as the call
    ran, outside autocast: the row is the same non-finite one, the Linear named, inside the caller's autocast or
    not."""
    from diffusion_debug.diffusion import replay
    from diffusion_debug.testing import tiny_pipeline

    pipe = tiny_pipeline("sd", dtype=torch.float16)
    linear = pipe.unet.get_submodule(UNET_ATTENTION_OUT)
    peaks = []
    handle = linear.register_forward_hook(lambda _m, _a, out: peaks.append(out.abs().max().item()))
    run(pipe, steps=2, output_type="latent")
    handle.remove()
    with torch.no_grad():
        linear.weight.mul_(4 * FP16_MAX / max(peaks))
        linear.bias.mul_(4 * FP16_MAX / max(peaks))
    dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
    with dbg:
        run(pipe, steps=2, output_type="latent")
    (error,) = [a for a in dbg.report().anomalies if a.severity == "error"]
    bundle = dbg.report().save() / error.details["bundle"]
    answers = []
    for inside in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16) if inside else contextlib.nullcontext():
            result = dbg.report().why()
            replayed = replay(bundle, pipe.unet)
        row = (result.baseline.factor, result.baseline.finite, result.baseline.error)
        answers.append((row, result.module, replayed["module"], replayed["output_finite"], replayed["note"]))
    assert answers == [(("as it was", False, ""), UNET_ATTENTION_OUT, UNET_ATTENTION_OUT, False, "")] * 2
    dbg.close()


def test_a_bundle_saved_under_cuda_autocast_replayed_on_the_cpu_says_it_ran_outside_it(pipes, tmp_path):
    """A bundle whose call ran under CUDA's float16 autocast, replayed with the model on the CPU: CUDA's autocast
    does not reach it (torch warned that CUDA is not available where it has none). The replay runs outside
    autocast, and its note says so; no warning."""
    import json
    import warnings

    from diffusion_debug.diffusion import replay

    pipe = pipes["sd"]
    with near_max(pipe, "unet", UNET_ATTENTION_OUT, 4.0):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        with dbg, autocast():
            run(pipe, steps=2, output_type="latent")
        (error,) = [a for a in dbg.report().anomalies if a.severity == "error"]
        bundle = dbg.report().save() / error.details["bundle"]
        meta = json.loads((bundle / "meta.json").read_text())
        (bundle / "meta.json").write_text(json.dumps({**meta, "autocast": [["cuda", "float16"]]}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            replayed = replay(bundle, pipe.unet)
    assert (replayed["module"], replayed["output_finite"]) == (None, True)
    assert replayed["note"] == (
        "the call ran under cuda float16 autocast, which does not reach cpu, where the model is: replayed outside it"
    )
    assert [str(w.message) for w in caught if "autocast" in str(w.message).lower()] == []
    dbg.close()


@pytest.mark.parametrize(
    "state, outside",
    [((("cpu", torch.bfloat16),), False), ((("cpu", None),), False), ((), True)],
    ids=["replayed-under-it", "replayed-outside-it", "why-outside"],
)
def test_a_replay_keeps_the_weight_cache_of_an_autocast_turned_on_without_a_region(state, outside):
    """``torch.set_autocast_enabled`` turns autocast on with no region (nesting count 0), and its cache of cast
    weights lives on from call to call: a replay's region (:func:`autocast_as`, under the call's autocast, outside
    it, or ``why()``'s outside every one) left at count 0 cleared it, and the user's next call cast its weight and
    bias again (3 ``_to_copy`` where it made 1). The cache is the user's: the next call casts what it did."""
    from diffusion_debug.diffusion.components.autocast import autocast_as
    from diffusion_debug.op_count import count_aten_ops

    linear, x = torch.nn.Linear(4, 4), torch.ones(2, 4)
    torch.set_autocast_enabled("cpu", True)
    try:
        torch.set_autocast_dtype("cpu", torch.bfloat16)
        linear(x)
        with count_aten_ops() as warm:
            linear(x)
        with autocast_as(state, outside=outside):
            replayed = linear(x).dtype
        with count_aten_ops() as after:
            linear(x)
        still = torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    finally:
        torch.set_autocast_enabled("cpu", False)
        torch.clear_autocast_cache()
    assert replayed == (torch.bfloat16 if state and state[0][1] else torch.float32)
    assert dict(warm.counts) == dict(after.counts) == {"aten._to_copy.default": 1, "aten.addmm.default": 1}
    assert still == (True, torch.bfloat16)


@contextlib.contextmanager
def users_bfloat16_autocast(caller):
    """The user's bfloat16 autocast, as ``caller`` turned it on: ``no-region`` (``torch.set_autocast_enabled``,
    nesting count 0), ``region`` (``with torch.autocast``) or ``disabled-inside`` (a region with a disabled one
    inside it: the replay runs in the inner one, the user's next call in the outer). Yields ``replaying``, the
    context a replay runs in; its cache cleared after."""
    with contextlib.ExitStack() as stack:
        stack.callback(torch.clear_autocast_cache)
        if caller == "no-region":
            torch.set_autocast_enabled("cpu", True)
            stack.callback(torch.set_autocast_enabled, "cpu", False)
            torch.set_autocast_dtype("cpu", torch.bfloat16)
        else:
            stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
        if caller == "disabled-inside":
            yield lambda: torch.autocast("cpu", enabled=False)
        else:
            yield contextlib.nullcontext


@pytest.mark.parametrize("caller", ["no-region", "region", "disabled-inside"])
def test_a_replay_in_another_dtype_than_the_users_autocast_neither_reads_nor_writes_its_weight_cache(caller):
    """The cache of cast weights is keyed by the weight alone: a replay under float16 autocast read the user's
    bfloat16 casts ('mat1 and mat2 must have the same dtype, but got Half and BFloat16'), and where it ran first
    its float16 casts, left in the cache, raised in the user's next bfloat16 call. The replay casts for itself;
    the user's next call casts what it did before (nothing: its cache kept)."""
    from diffusion_debug.diffusion.components.autocast import autocast_as
    from diffusion_debug.op_count import count_aten_ops

    linear, x = torch.nn.Linear(4, 4), torch.ones(2, 4)
    fresh = torch.nn.Linear(4, 4)  # replayed first: its float16 casts in no cache of the user's
    with users_bfloat16_autocast(caller) as replaying:
        linear(x)
        with count_aten_ops() as warm:
            linear(x)
        with replaying(), autocast_as((("cpu", torch.float16),)):
            replayed = linear(x).dtype, fresh(x).dtype
        with count_aten_ops() as after:
            next_call = linear(x).dtype, fresh(x).dtype
    assert replayed == (torch.float16, torch.float16)
    assert next_call == (torch.bfloat16, torch.bfloat16)
    assert dict(warm.counts) == {"aten._to_copy.default": 1, "aten.addmm.default": 1}
    assert dict(after.counts) == {"aten._to_copy.default": 4, "aten.addmm.default": 2}  # fresh's 3 casts, its first


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
