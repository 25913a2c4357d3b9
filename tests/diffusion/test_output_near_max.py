"""An fp16 near-overflow at a VAE's or text encoder's end modules (after the call site's last block: the VAE
decoder's ``conv_norm_out`` and ``conv_out``, a CLIP encoder's ``final_layer_norm``) is named at its module by the
sentinel's own reading (it watches them since vae36: no replay, 0 counted). One the sentinel does not read (a run
its pace skips, probes off) is flagged at the call's output and named by ONE replay of the kept call with full
probes (DESIGN: a near-overflow output is localised by a replay): once per debugger (its replay memory); nothing of
a finding is kept with the pipeline, so that the name stays right when the weights or the inputs change. Images
are bitwise equal."""

from __future__ import annotations

import pytest
import torch
from diffusion_helpers import SD_FP16_VAE, plant, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_overflow, tiny_pipeline
from diffusion_debug.testing.features import clip_name

FP16_MAX = float(torch.finfo(torch.float16).max)
CONV_OUT = "decoder.conv_out"
REPLAYED = "output check -> replay with full probes"
SENTINEL = "sentinel"
EARLIER = "output check -> an earlier call's replay"
OUTPUT_CHECK = "output check (the call's output; no probe reading named a module)"


def debugger(pipe, tmp_path, **config) -> DiffusionModelDebugger:
    return DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", **config))


def risks(dbg, component="vae"):
    return [a for a in dbg.report().anomalies if a.kind == "overflow_risk" and a.component == component]


def replays(dbg):
    return [e["component"] for e in dbg.record.events if e["type"] == "replay"]


@pytest.mark.parametrize("value", [60000.0, 65000.0])
def test_a_vae_near_max_at_conv_out_is_named_there_by_the_sentinel_with_no_replay(tmp_path, value):
    """The first full read names it as read; that debugger's later calls, a second debugger and one made per call
    each name it by their sentinel's reading of conv_out, with no replay (vae35: the output check's replay, one per
    debugger; at the max one a run)."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    plain = run(pipe, steps=1)
    with plant_overflow(pipe.vae.get_submodule(CONV_OUT), fraction=value / FP16_MAX):
        planted = run(pipe, steps=1)
        first = debugger(pipe, tmp_path / "first")
        with first:  # the pipeline's first read of its fp16 VAE: full probes name it as read
            images = [run(pipe, steps=1)]
        with first:  # its own later calls: its sentinel, the output check, one replay
            images.append(run(pipe, steps=1))
        with first:
            images.append(run(pipe, steps=1))
        second = debugger(pipe, tmp_path / "second")
        with second:
            images.append(run(pipe, steps=1))
        with debugger(pipe, tmp_path / "per_call") as per_call:
            images.append(run(pipe, steps=1))
    assert all((image == planted).all() for image in images)
    assert not (plain == planted).all()  # (the plant changed the image: the check is not vacuous)
    found = [(a.module, a.details.get("run"), a.details["localized_by"]) for a in risks(first)]
    assert found == [(CONV_OUT, 1, "full probes"), (CONV_OUT, 2, SENTINEL), (CONV_OUT, 3, SENTINEL)]
    for dbg in (second, per_call):
        (risk,) = risks(dbg)
        assert (risk.module, risk.details["localized_by"]) == (CONV_OUT, SENTINEL)
        assert risk.details["dtype_max_fraction"] == pytest.approx(value / FP16_MAX, abs=2e-3)
        assert SD_FP16_VAE in risk.message  # (the advice of its pipeline: SD 1.5 reads no force_upcast)
    assert replays(first) == replays(second) == replays(per_call) == []  # (a leaf read: named as read)
    for dbg in (first, second, per_call):
        dbg.close()


@pytest.mark.parametrize("component, module", [("vae", CONV_OUT), ("text_encoder", "final_layer_norm")])
def test_a_near_max_at_an_end_module_the_first_read_did_not_see_is_named_by_the_sentinel(tmp_path, component, module):
    """Planted after the pipeline's first full read: each later debugger's sentinel names it, no replay (vae35: the
    output check's replay, once per debugger)."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    with debugger(pipe, tmp_path / "clean") as clean:
        run(pipe, steps=1)
    target = getattr(pipe, component)
    name = clip_name(module) if component == "text_encoder" else module
    with plant_overflow(target.get_submodule(name), fraction=0.61):
        planted = run(pipe, steps=1)
        with debugger(pipe, tmp_path / "replayed") as replayed:
            first = run(pipe, steps=1)
        with debugger(pipe, tmp_path / "again") as again_dbg:
            again = run(pipe, steps=1)
    assert (first == planted).all() and (again == planted).all()
    assert not risks(clean, component)
    (risk,) = risks(replayed, component)
    assert (risk.module, risk.details["localized_by"]) == (name, SENTINEL)
    assert risk.details["dtype_max_fraction"] == pytest.approx(0.61, abs=1e-3)
    (risk,) = risks(again_dbg, component)
    assert (risk.module, risk.details["localized_by"]) == (name, SENTINEL)
    assert replays(replayed) == replays(again_dbg) == []
    for dbg in (clean, replayed, again_dbg):
        dbg.close()


def test_a_vae_cast_to_float32_and_back_is_named_again_by_its_sentinel(tmp_path):
    """Cast to float32, its output is not near its max (no finding, no replay); cast back to float16, a new
    debugger's sentinel names it (vae35: the output check's replay)."""
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
    assert not risks(fp32) and replays(fp32) == []
    assert [(a.module, a.details["localized_by"]) for a in risks(again)] == [(CONV_OUT, SENTINEL)]
    assert replays(again) == []
    for dbg in (fp16, fp32, again):
        dbg.close()


def test_a_planted_nan_at_conv_out_after_a_named_near_max_is_still_named_by_its_replay(tmp_path):
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
    (here: localisation off) and no sentinel read it (a debugger's 4th run: its pace reads no group then, not warm),
    its near-max output is the component's, flagged at its output as before, not the user's near-max latents
    (which it never received)."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    with debugger(pipe, tmp_path / "clean"):
        run(pipe, steps=1)
    shape = pipe.unet.config.sample_size
    latents = torch.full((1, pipe.unet.config.in_channels, shape, shape), 0.7 * FP16_MAX, dtype=torch.float16)
    name = clip_name("final_layer_norm")
    dbg = debugger(pipe, tmp_path / "dbg", localize=False)
    for _ in range(3):
        with dbg:
            run(pipe, steps=1)
    with plant_overflow(pipe.text_encoder.get_submodule(name), fraction=0.61), dbg:
        run(pipe, steps=1, latents=latents)
    found = [(a.component, a.module, a.details["localized_by"]) for a in risks(dbg, "text_encoder")]
    assert found == [("text_encoder", "", OUTPUT_CHECK)]
    assert not [a for a in dbg.report().anomalies if a.component == "input" and a.kind == "overflow_risk"]
    assert replays(dbg) == []
    dbg.close()


def test_with_probes_off_a_reused_debugger_replays_once_and_says_later_calls_are_named_by_that_replay(tmp_path):
    """No probe, no full read, no tree-memo entry (``probes="off"``): the first call's output check replays the VAE
    once; the later calls name the module as that replay did and say so (before: "replay")."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    dbg = debugger(pipe, tmp_path, probes="off")
    with plant_overflow(pipe.vae.get_submodule(CONV_OUT), fraction=0.61):
        for _ in range(3):
            with dbg:
                run(pipe, steps=1)
    found = [(a.module, a.details.get("run"), a.details["localized_by"]) for a in risks(dbg)]
    assert found == [(CONV_OUT, 1, REPLAYED), (CONV_OUT, 2, EARLIER), (CONV_OUT, 3, EARLIER)]
    assert replays(dbg) == ["vae"]
    dbg.close()


def rewire(pipe, fraction: float, gain: float = 1.0) -> None:
    """Edit the VAE's weights in place (its tree unchanged, as ``load_state_dict``, ``p.data`` edits or a fused
    LoRA do): ``decoder.conv_norm_out`` scaled so its output reaches ``fraction`` of the fp16 max, ``conv_out``
    passing on ``gain`` times its largest channel: the module that makes the near-max is ``conv_norm_out`` now."""
    decoder, got = pipe.vae.decoder, {}
    hook = decoder.conv_norm_out.register_forward_hook(lambda m, a, o: got.__setitem__("o", o.detach().float()))
    try:
        run(pipe, steps=1)
    finally:
        hook.remove()
    channel, scale = int(got["o"].amax(dim=(0, 2, 3)).argmax()), fraction * FP16_MAX / got["o"].abs().amax().item()
    with torch.no_grad():
        decoder.conv_out.weight.zero_()
        decoder.conv_out.bias.zero_()
        decoder.conv_out.weight[0, channel, 1, 1] = gain
        decoder.conv_norm_out.weight.mul_(scale)
        decoder.conv_norm_out.bias.mul_(scale)


def test_a_near_max_moved_to_conv_norm_out_by_weights_edited_in_place_is_named_at_conv_norm_out(tmp_path):
    """A first debugger named ``conv_out`` (planted); the weights then edited in place make ``conv_norm_out`` the
    maker: a later debugger's sentinel names ``decoder.conv_norm_out`` (the first of the two it reads near the max;
    failed once: a memory kept with the pipeline named ``decoder.conv_out``)."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    with plant_overflow(pipe.vae.get_submodule(CONV_OUT), fraction=0.61):
        with debugger(pipe, tmp_path / "first") as first:
            run(pipe, steps=1)
    rewire(pipe, 0.62)
    with debugger(pipe, tmp_path / "later") as later:
        run(pipe, steps=1)
    assert [(a.module, a.details["localized_by"]) for a in risks(first)] == [(CONV_OUT, "full probes")]
    (risk,) = risks(later)
    assert (risk.module, risk.details["localized_by"]) == ("decoder.conv_norm_out", SENTINEL)
    assert risk.details["dtype_max_fraction"] == pytest.approx(0.62, abs=2e-3)
    assert replays(later) == []
    for dbg in (first, later):
        dbg.close()


def test_a_near_max_that_a_larger_image_moves_to_conv_norm_out_is_named_at_conv_norm_out(tmp_path):
    """At the default size ``conv_out`` makes the near-max (its gain on ``conv_norm_out``'s 47%); at 3x the resolution
    ``conv_norm_out``'s own output reaches 76%: a later debugger's sentinel names it there, at its fraction (failed
    once: a memory of the first read named ``decoder.conv_out`` at 56%)."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    rewire(pipe, 0.47, gain=1.3)
    with debugger(pipe, tmp_path / "first") as first:
        run(pipe, steps=1)
    size = 3 * pipe.unet.config.sample_size * pipe.vae_scale_factor
    with debugger(pipe, tmp_path / "larger") as larger:
        run(pipe, steps=1, height=size, width=size)
    assert [(a.module, a.details["localized_by"]) for a in risks(first)] == [(CONV_OUT, "full probes")]
    (risk,) = risks(larger)
    assert (risk.module, risk.details["localized_by"]) == ("decoder.conv_norm_out", SENTINEL)
    assert risk.details["dtype_max_fraction"] == pytest.approx(0.762, abs=5e-3)
    assert replays(larger) == []
    for dbg in (first, larger):
        dbg.close()


@pytest.mark.parametrize("component, module, read", [("vae", CONV_OUT, 6), ("text_encoder", "final_layer_norm", 7)])
def test_a_near_max_on_runs_the_sentinel_does_not_read_is_still_named_by_one_replay(tmp_path, component, module, read):
    """The replay path stays for the runs the sentinel's pace skips: after a reused debugger's first 3 runs, the
    VAE decode's group reads runs 6, 10... and the encoders' 7, 11... (``SENTINEL_PHASES``), so at the 4th run the
    output check flags the near-max at the end module and one replay names it, the later runs not read name it
    from that replay (said so), and the first run its group reads names it by the sentinel as read."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    name = clip_name(module) if component == "text_encoder" else module
    dbg = debugger(pipe, tmp_path)
    for _ in range(3):
        with dbg:
            run(pipe, steps=1)
    with plant_overflow(getattr(pipe, component).get_submodule(name), fraction=0.61):
        for _ in range(4, read + 1):
            with dbg:
                run(pipe, steps=1)
    found = [(a.module, a.details.get("run"), a.details["localized_by"]) for a in risks(dbg, component)]
    earlier = [(name, later, EARLIER) for later in range(5, read)]
    assert found == [(name, 4, REPLAYED), *earlier, (name, read, SENTINEL)]
    assert replays(dbg) == [component]
    dbg.close()


@pytest.mark.parametrize("module", ["encoder.conv_out", "encoder.conv_norm_out"])
def test_an_img2img_vae_encoders_near_max_at_an_end_module_is_named_there_by_the_sentinel(tmp_path, module):
    """An img2img call encodes its image: the VAE's ``encode`` site watches its encoder's end modules as the decode's
    (vae36; ``test_op_count``'s img2img pins their hooks, 0 ops): a near-max planted at one of them after the first
    call is named there by the sentinel's reading, no replay, with the SD VAE's upcast advice; not at the decoder it
    flows into. Images bitwise equal to the planted unwatched call's."""
    from diffusion_debug.testing.zoo import ZOO_CALLS

    pipe = tiny_pipeline("img2img", dtype=torch.float16)
    call = ZOO_CALLS["img2img"][0]()
    prompt = call.pop("prompt")
    dbg = debugger(pipe, tmp_path)
    with dbg:  # the first read: full probes
        run(pipe, steps=1, prompt=prompt, **call)
    with plant_overflow(pipe.vae.get_submodule(module), fraction=0.61):
        planted = run(pipe, steps=1, prompt=prompt, **call)
        with dbg:
            watched = run(pipe, steps=1, prompt=prompt, **call)
    assert (watched == planted).all()
    found = [(a.module, a.step, a.details["localized_by"], a.details["run"]) for a in risks(dbg)]
    assert found == [(module, None, SENTINEL, 2)]
    (risk,) = risks(dbg)
    assert risk.details["dtype_max_fraction"] == pytest.approx(0.61, abs=1e-3)
    assert risk.message.startswith(f"vae.{module} output reached 61% of the float16 maximum")
    assert risk.message.endswith(f"; {SD_FP16_VAE}.")
    assert replays(dbg) == []
    dbg.close()
