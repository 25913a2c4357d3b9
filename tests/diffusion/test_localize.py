"""diffusion/localize.py: a block-level overflow is localised by one replay and the place is kept
across runs (until clear_debug_history); debug_timeout caps a run's replays."""

from __future__ import annotations

import importlib

import pytest
import torch
from diffusion_helpers import plant, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_overflow, tiny_pipeline


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def kinds(report, kind):
    return [a for a in report.anomalies if a.kind == kind]


def test_vae_overflow_inside_a_block_is_named_by_default(tmp_path):
    # the VAE's first call is read with full probes: the conv inside the resnet block, whose output
    # the block's next norm hides from the block sentinel of later calls, is named at once, with no replay
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    with plant_overflow(pipe.vae.get_submodule("decoder.up_blocks.0.resnets.0.conv1"), fraction=0.74):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        with dbg:
            run(pipe, steps=2)
    (risk,) = kinds(dbg.report(), "overflow_risk")
    assert (risk.component, risk.module, risk.details["localized_by"]) == (
        "vae",
        "decoder.up_blocks.0.resnets.0.conv1",
        "full probes",
    )
    assert not [e for e in dbg.record.events if e["type"] == "replay"]
    dbg.close()


def test_unet_overflow_is_replayed_once_across_runs(tmp_path):
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    handle = plant_overflow(pipe.unet.get_submodule("up_blocks.1"), fraction=0.7)
    try:
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic"))
        with dbg:
            run(pipe, steps=2)
            run(pipe, steps=2)
    finally:
        handle.remove()
    replays = [e for e in dbg.record.events if e["type"] == "replay"]
    assert [e["component"] for e in replays] == ["unet"]
    risks = [a for a in dbg.report().anomalies if a.kind == "overflow_risk"]
    assert len(risks) == 2 and {a.component for a in risks} == {"unet"}
    assert (
        len({a.module for a in risks}) == 1
        and risks[1].details["localized_by"] == "sentinel -> an earlier call's replay"  # (the one replay: the 1st's)
    )
    dbg.clear_debug_history()  # forgets the localisation: the next run replays again
    handle = plant_overflow(pipe.unet.get_submodule("up_blocks.1"), fraction=0.7)
    try:
        with dbg:
            run(pipe, steps=2)
    finally:
        handle.remove()
    assert [e["type"] for e in dbg.record.events].count("replay") == 1  # the history was cleared too
    dbg.close()


def test_an_unprobed_denoisers_nan_reads_its_kept_arguments_once(pipes, tmp_path, monkeypatch):
    """An fp32 UNet is not probed (its output is checked at the step): its NaN/Inf is named by one
    replay of its kept call, after one look for a NaN/Inf among that call's arguments (a host read
    a tensor). Before, the look ran twice, with the same answer, and the replay came after both."""
    from diffusion_debug.diffusion.localize import Localizer

    looked, look = [], Localizer._nonfinite_arguments

    def counted(self, component, site):
        looked.append(component)
        return look(self, component, site)

    monkeypatch.setattr(Localizer, "_nonfinite_arguments", counted)
    pipe = pipes["sd"]
    leaf = "up_blocks.1.resnets.0.conv2"
    with plant(pipe.unet.get_submodule(leaf), 0):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, log_level="error"))
        with dbg:
            run(pipe, steps=1, output_type="latent")
    (error,) = [a for a in kinds(dbg.report(), "nonfinite") if a.severity == "error"]
    assert (error.component, error.module, error.step) == ("unet", leaf, 0)
    assert error.details["localized_by"] == "output check -> replay with full probes"
    assert looked == ["unet"]
    dbg.close()


@pytest.mark.parametrize(
    "failing, kept",
    [
        ("_nonfinite", ("overflow_risk", "warning", "unet", "up_blocks.1", 0, "sentinel -> replay with full probes")),
        ("_overflow", ("nonfinite", "error", "unet", "conv_out", 0, "sentinel -> replay with full probes")),
    ],
)
def test_a_check_whose_decision_fails_costs_the_call_no_other_check(tmp_path, monkeypatch, failing, kept):
    """One fp16 UNet call with a NaN (made by conv_out) and a near-overflow (up_blocks.1): where deciding
    one check raises (planted in its part of replay.decide), its failure is recorded under that check and
    the other is still named at its module. b9ffb8d's one decide, under the nonfinite guard, lost both
    (the overflow warning, or the NaN error, the headline) and named the overflow's failure nonfinite."""
    decide = importlib.import_module("diffusion_debug.diffusion.replay.decide")  # (.replay is also a function)

    def planted(*args, **kwargs):
        raise RuntimeError("planted")

    monkeypatch.setattr(decide, failing, planted)
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    nan = plant(pipe.unet.conv_out, 0, lambda output: output * float("nan"))
    with nan, plant_overflow(pipe.unet.get_submodule("up_blocks.1"), fraction=0.7):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic", log_level="error"))
        with dbg:
            run(pipe, steps=1, output_type="latent")
    report = dbg.report()
    (error,) = kinds(report, "debugger_error")
    assert error.details["where"] == {"_nonfinite": "nonfinite", "_overflow": "overflow_risk"}[failing]
    assert "RuntimeError: planted" in error.message
    found = [a for a in report.anomalies if a.kind in ("nonfinite", "overflow_risk")]
    assert [(a.kind, a.severity, a.component, a.module, a.step, a.details["localized_by"]) for a in found] == [kept]
    dbg.close()


def test_debug_timeout_caps_the_replays_of_a_run(tmp_path):
    from diffusion_debug.testing import plant_overflow

    pipe = tiny_pipeline("controlnet", dtype=torch.float16)
    handles = [  # the ControlNet runs before the UNet in each step: its replay comes first
        plant_overflow(pipe.controlnet.get_submodule("mid_block.resnets.1"), fraction=0.7),
        plant_overflow(pipe.unet.get_submodule("up_blocks.1"), fraction=0.7),
    ]
    try:
        dbg = DiffusionModelDebugger(
            pipe,
            DebugConfig(output_dir=str(tmp_path), run_name="t", level="basic", debug_timeout=1e-9, log_level="error"),
        )
        with dbg:
            pipe("a cat", image=torch.ones(1, 3, 32, 32), num_inference_steps=2)
    finally:
        for handle in handles:
            handle.remove()
    events = dbg.record.events
    # the first replay starts with nothing spent; after it the budget is gone
    assert [e["component"] for e in events if e["type"] == "replay"] == ["controlnet"]
    assert [e["component"] for e in events if e["type"] == "replay_skipped"][:1] == ["unet"]
    assert {a.component for a in kinds(dbg.report(), "overflow_risk")} == {"controlnet", "unet"}


def _mask_in_the_position_bias(module, args, kwargs, output):
    """T5's first self-attention as transformers 4.47 runs it: the additive attention mask (float16's
    lowest value where the prompt is padded) added into the position bias it returns to every block.
    Newer transformers keep them apart; there this hook adds it (eager attention: an additive mask)."""
    mask, bias = kwargs.get("mask"), output[1]  # transformers 4.47 returns the past key values there
    if mask is None or not mask.is_floating_point() or not isinstance(bias, torch.Tensor) or bias.dim() != 4:
        return None  # no additive mask, or the installed T5 (4.47) returns the bias it added the mask to
    if bias.amin() <= torch.finfo(bias.dtype).min:
        return None  # the installed T5 added it itself
    return (output[0], bias + mask, *output[2:])


def test_t5_position_bias_holding_the_attention_mask_is_no_overflow_and_a_real_one_is_named(tmp_path):
    """PixArt's fp16 T5 with a padded prompt: every block returns the position bias at |x| = 65504
    (the mask), which its block sentinel reads on a later call; the replay shows each module took those
    values in with its inputs (the call's mask argument), so the call is quiet, as with full probes.
    An overflow a module makes in that block is still named at that module."""
    from diffusion_debug.testing.zoo import ZOO_CALLS

    pipe = tiny_pipeline("pixart", dtype=torch.float16)
    encoder = pipe.text_encoder
    if hasattr(encoder, "set_attn_implementation"):  # transformers 5: an additive mask is eager attention's
        encoder.set_attn_implementation("eager")
    attention = encoder.get_submodule("encoder.block.0.layer.0.SelfAttention")
    hook = attention.register_forward_hook(_mask_in_the_position_bias, with_kwargs=True)

    def call():
        kwargs = ZOO_CALLS["pixart"][0]()
        return pipe(**kwargs, num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt")[0]

    try:
        plain = call()
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, log_level="error"))
        with dbg:
            first = call()  # the text encoder's first call: full probes
        with dbg:
            second = call()  # its block sentinel: block 0 reads 100% of float16's max, replayed
        assert torch.equal(plain, first) and torch.equal(plain, second)
        assert kinds(dbg.report(), "overflow_risk") == []
        assert [e["component"] for e in dbg.record.events if e["type"] == "replay"] == ["text_encoder"]
        made = "encoder.block.0.layer.1.DenseReluDense.wo"
        with plant_overflow(encoder.get_submodule(made), fraction=0.9), dbg:
            call()
    finally:
        hook.remove()
    (risk,) = kinds(dbg.report(), "overflow_risk")
    assert (risk.component, risk.module, risk.details["localized_by"]) == (
        "text_encoder",
        made,
        "sentinel -> replay with full probes",
    )
    assert risk.details["dtype_max_fraction"] == pytest.approx(0.9, abs=1e-3)
    dbg.close()
