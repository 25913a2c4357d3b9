"""An fp16 near-overflow that no probe reading names, flagged at a VAE's or text encoder's output (the sentinel
leaves out the single modules at either end of the stack), is named at its module: by the first full read of the
pipeline's component (kept in the pipeline's tree memo, keyed by the site and the dtype it was read in) where that
read saw it, else by ONE replay of the kept call with full probes (DESIGN: a near-overflow output is localised by
a replay). A second debugger of the same pipeline, or one made per call, names it as the first did, with no
replay; images are bitwise equal."""

from __future__ import annotations

import gc

import pytest
import torch
from diffusion_helpers import plant, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components import structure
from diffusion_debug.testing import plant_overflow, tiny_pipeline
from diffusion_debug.testing.features import clip_name

FP16_MAX = float(torch.finfo(torch.float16).max)
CONV_OUT = "decoder.conv_out"
REPLAYED = "output check -> replay with full probes"
REMEMBERED = "output check -> the first full read (memory)"
OUTPUT_CHECK = "output check (the call's output; no probe reading named a module)"


def debugger(pipe, tmp_path, **config) -> DiffusionModelDebugger:
    return DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", **config))


def risks(dbg, component="vae"):
    return [a for a in dbg.report().anomalies if a.kind == "overflow_risk" and a.component == component]


def replays(dbg):
    return [e["component"] for e in dbg.record.events if e["type"] == "replay"]


@pytest.mark.parametrize("value", [60000.0, 65000.0])
def test_a_vae_near_max_at_conv_out_is_named_there_by_a_second_and_a_per_call_debugger_with_no_replay(tmp_path, value):
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    plain = run(pipe, steps=1)
    with plant_overflow(pipe.vae.get_submodule(CONV_OUT), fraction=value / FP16_MAX):
        planted = run(pipe, steps=1)
        first = debugger(pipe, tmp_path / "first")
        with first:  # the pipeline's first read of its fp16 VAE: full probes name it as read
            images = [run(pipe, steps=1)]
        with first:  # its own later call: its sentinel, the output check, the first read's finding
            images.append(run(pipe, steps=1))
        second = debugger(pipe, tmp_path / "second")
        with second:
            images.append(run(pipe, steps=1))
        with debugger(pipe, tmp_path / "per_call") as per_call:
            images.append(run(pipe, steps=1))
    assert all((image == planted).all() for image in images)
    assert not (plain == planted).all()  # (the plant changed the image: the check is not vacuous)
    found = [(a.module, a.details.get("run"), a.details["localized_by"]) for a in risks(first)]
    assert found == [(CONV_OUT, 1, "full probes"), (CONV_OUT, 2, REMEMBERED)]
    for dbg in (second, per_call):
        (risk,) = risks(dbg)
        assert (risk.module, risk.details["localized_by"]) == (CONV_OUT, REMEMBERED)
        assert risk.details["dtype_max_fraction"] == pytest.approx(value / FP16_MAX, abs=2e-3)
        assert "sdxl-vae-fp16-fix" in risk.message
    assert replays(first) == replays(second) == replays(per_call) == []
    for dbg in (first, second, per_call):
        dbg.close()
    del first, second, per_call, dbg
    gc.collect()  # no debugger holds the memo: parked (its entries, strings, kept), revived by the next
    assert structure._SHARED[id(pipe)].parked
    with plant_overflow(pipe.vae.get_submodule(CONV_OUT), fraction=value / FP16_MAX):
        with debugger(pipe, tmp_path / "parked") as parked:
            assert (run(pipe, steps=1) == planted).all()
    assert [(a.module, a.details["localized_by"]) for a in risks(parked)] == [(CONV_OUT, REMEMBERED)]
    assert replays(parked) == []
    parked.close()


@pytest.mark.parametrize("component, module", [("vae", CONV_OUT), ("text_encoder", "final_layer_norm")])
def test_a_near_max_at_an_end_module_the_first_read_did_not_see_is_named_by_one_replay_then_remembered(
    tmp_path, component, module
):
    """Planted after the pipeline's first full read: no memory of it; the output check's replay names it once, and
    a later per-call debugger names it from the memo the replay filled, with no replay of its own."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    with debugger(pipe, tmp_path / "clean") as clean:
        run(pipe, steps=1)
    target = getattr(pipe, component)
    name = clip_name(module) if component == "text_encoder" else module
    with plant_overflow(target.get_submodule(name), fraction=0.61):
        planted = run(pipe, steps=1)
        with debugger(pipe, tmp_path / "replayed") as replayed:
            first = run(pipe, steps=1)
        with debugger(pipe, tmp_path / "remembered") as remembered:
            again = run(pipe, steps=1)
    assert (first == planted).all() and (again == planted).all()
    assert not risks(clean, component)
    (risk,) = risks(replayed, component)
    assert (risk.module, risk.details["localized_by"]) == (name, REPLAYED)
    assert risk.details["dtype_max_fraction"] == pytest.approx(0.61, abs=1e-3)
    assert replays(replayed) == [component]
    (risk,) = risks(remembered, component)
    assert (risk.module, risk.details["localized_by"]) == (name, REMEMBERED)
    assert replays(remembered) == []
    for dbg in (clean, replayed, remembered):
        dbg.close()


def test_a_vae_cast_to_float32_is_not_named_from_its_float16_memory(tmp_path):
    """The memo's entry is keyed by the dtype the component was read in: a pipeline cast to float32 has none (and its
    float32 output is not near its max); cast back to float16, the float16 read's entry names it again."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    with plant_overflow(pipe.vae.get_submodule(CONV_OUT), fraction=0.61):
        with debugger(pipe, tmp_path / "fp16") as fp16:
            run(pipe, steps=1)
        pipe.to(torch.float32)
        with debugger(pipe, tmp_path / "fp32") as fp32:
            run(pipe, steps=1)
        pipe.to(torch.float16)
        with debugger(pipe, tmp_path / "again") as again:
            run(pipe, steps=1)
    assert [(a.module, a.details["localized_by"]) for a in risks(fp16)] == [(CONV_OUT, "full probes")]
    assert fp32._steps.probes.output_named("vae", "decoder") is None
    assert not risks(fp32) and replays(fp32) == []
    assert [(a.module, a.details["localized_by"]) for a in risks(again)] == [(CONV_OUT, REMEMBERED)]
    assert replays(again) == []
    for dbg in (fp16, fp32, again):
        dbg.close()


def test_a_planted_nan_at_conv_out_after_a_remembered_near_max_is_still_named_by_its_replay(tmp_path):
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    with plant_overflow(pipe.vae.get_submodule(CONV_OUT), fraction=0.61):
        with debugger(pipe, tmp_path / "first") as first:
            run(pipe, steps=1)
    handle = plant(pipe.vae.get_submodule(CONV_OUT), 0)
    try:
        with debugger(pipe, tmp_path / "nan") as dbg:
            run(pipe, steps=1)
    finally:
        handle.remove()
    errors = [a for a in dbg.report().anomalies if a.kind == "nonfinite" and a.severity == "error"]
    assert [(a.component, a.module, a.details["localized_by"]) for a in errors] == [
        ("vae", CONV_OUT, "sentinel -> replay with full probes")
    ]
    assert replays(dbg) == ["vae"] and not risks(dbg)
    for d in (first, dbg):
        d.close()


def test_a_text_encoder_near_max_output_no_replay_names_is_not_blamed_on_near_max_inputs(tmp_path):
    """A text encoder's call site has no prefix (its reading's module is ``""``): where no replay names the module
    (here: localisation off), its near-max output is the component's, flagged at its output as
    before, not the user's near-max latents (which it never received)."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    with debugger(pipe, tmp_path / "clean"):
        run(pipe, steps=1)
    shape = pipe.unet.config.sample_size
    latents = torch.full((1, pipe.unet.config.in_channels, shape, shape), 0.7 * FP16_MAX, dtype=torch.float16)
    name = clip_name("final_layer_norm")
    with plant_overflow(pipe.text_encoder.get_submodule(name), fraction=0.61):
        with debugger(pipe, tmp_path / "dbg", localize=False) as dbg:
            run(pipe, steps=1, latents=latents)
    found = [(a.component, a.module, a.details["localized_by"]) for a in risks(dbg, "text_encoder")]
    assert found == [("text_encoder", "", OUTPUT_CHECK)]
    assert not [a for a in dbg.report().anomalies if a.component == "input" and a.kind == "overflow_risk"]
    assert replays(dbg) == []
    dbg.close()


def test_with_probes_off_a_reused_debugger_replays_once_and_says_later_calls_are_named_from_memory(tmp_path):
    """No probe, no full read, no tree-memo entry (``probes="off"``): the first call's output check replays the VAE
    once; the later calls name the module from the debugger's memory of that replay and say so (before: "replay")."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    dbg = debugger(pipe, tmp_path, probes="off")
    with plant_overflow(pipe.vae.get_submodule(CONV_OUT), fraction=0.61):
        for _ in range(3):
            with dbg:
                run(pipe, steps=1)
    found = [(a.module, a.details.get("run"), a.details["localized_by"]) for a in risks(dbg)]
    earlier = "output check -> an earlier call's replay (memory)"
    assert found == [(CONV_OUT, 1, REPLAYED), (CONV_OUT, 2, earlier), (CONV_OUT, 3, earlier)]
    assert replays(dbg) == ["vae"]
    dbg.close()
