"""diffusion/checks.py's overflow checks: values near or past their dtype's max, the advice each dtype (and
autocast) gets, a sentinel's Inf inside a near-max block, the clamp margin — on values, and through the debugger on
tiny pipelines (the setup, prompt, scheduler and image checks: test_checks.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusion_helpers import SD_FP16_VAE, SDXL_FP16_VAE, plant, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion import checks
from diffusion_debug.testing import tiny_pipeline

UNET_LEAF = "up_blocks.1.resnets.0.conv2"


def cfg(tmp_path, **kwargs):
    return DebugConfig(output_dir=str(tmp_path), **kwargs)


def kinds(report, kind):
    return [a for a in report.anomalies if a.kind == kind]


@pytest.fixture(scope="module")
def fp16_sd():
    return tiny_pipeline("sd", dtype=torch.float16)


def test_fp16_pipeline_runs_clean_and_identical(fp16_sd, tmp_path):
    plain = run(fp16_sd, steps=2)
    dbg = DiffusionModelDebugger(fp16_sd, cfg(tmp_path))
    with dbg:
        watched = run(fp16_sd, steps=2)
    assert np.array_equal(plain, watched)
    assert not [a for a in dbg.report().anomalies if a.kind in ("nonfinite", "overflow_risk")]
    assert dbg.report().steps[0]["model_output"]["dtype"] == "float16"


def test_planted_fp16_vae_overflow_is_named_with_vae_advice(fp16_sd, tmp_path):
    name = "decoder.up_blocks.0.upsamplers.0.conv"
    with plant(fp16_sd.vae.get_submodule(name), 0, lambda out: out / out.abs().amax() * 40000):
        dbg = DiffusionModelDebugger(fp16_sd, cfg(tmp_path, level="basic"))
        with dbg:
            run(fp16_sd, steps=2)
    risks = kinds(dbg.report(), "overflow_risk")
    assert [(a.component, a.module) for a in risks] == [("vae", name)]
    assert risks[0].details["absmax"] == pytest.approx(40000, rel=1e-3)
    assert risks[0].message.endswith(f"; {SD_FP16_VAE}.")  # SD 1.5 reads no force_upcast: not named


BF16_ADVICE = (
    "bfloat16 holds float32's range, so float32 gives these values no more room: check {where}'s weights and the "
    "scale of its inputs."
)


def test_a_bf16_vae_near_overflow_is_told_to_check_its_values_not_the_fp16_advice():
    """The overflow advice reads the dtype the module ran in: Stable Diffusion's VAE near bfloat16's
    maximum was told fp16's (force_upcast, the fp16-fixed VAE), which do not apply to a bf16 VAE; nor
    does float32, whose largest value is bfloat16's (before: "run the VAE in float32")."""
    from diffusion_debug.probes import ModuleReading

    reading = ModuleReading("decoder.conv_out", 0, "bfloat16", 1.0, 3.2e38, "bfloat16", "absmax")
    (risk,) = checks.overflow_risk(
        "vae", reading, step=None, timestep=None, fraction=0.5, localized_by="probe", role="vae", sd_vae=True
    )
    assert risk.message == (
        f"vae.decoder.conv_out output reached {risk.details['dtype_max_fraction']:.0%} of the bfloat16 maximum "
        "(|x|=3.2e+38); " + BF16_ADVICE.format(where="vae.decoder.conv_out")
    )


@pytest.mark.parametrize(
    "dtype, absmax, advice",
    [
        ("float16", 6e4, "(|x|=6e+04); run this component in bfloat16 or float32, or upcast this module."),
        ("bfloat16", 3.2e38, "(|x|=3.2e+38); " + BF16_ADVICE.format(where="unet.up_blocks.0.resnets.0.conv2")),
    ],
)
def test_a_denoiser_near_overflow_is_advised_by_the_dtype_it_ran_in(dtype, absmax, advice):
    """fp16: a wider dtype (bf16 or float32) holds the values; bf16: none does (before: "run this component
    in bfloat16 or float32" for a bf16 component already in bfloat16)."""
    from diffusion_debug.probes import ModuleReading

    reading = ModuleReading("up_blocks.0.resnets.0.conv2", 0, dtype, 1.0, absmax, dtype, "absmax")
    (risk,) = checks.overflow_risk(
        "unet", reading, step=3, timestep=None, fraction=0.5, localized_by="sentinel", role="denoiser"
    )
    share = f"{risk.details['dtype_max_fraction']:.0%}"
    assert risk.message == (
        f"unet.up_blocks.0.resnets.0.conv2 output reached {share} of the {dtype} maximum " + advice
    )


def test_the_report_guide_next_to_an_overflow_risk_advises_by_dtype_as_its_message_does():
    """The HTML report shows the kind's "what to do" beside each overflow_risk group: it told a bf16
    component to run in float32 or bfloat16, which its message says gives these values no more room."""
    from diffusion_debug.record import kind_info

    assert kind_info("overflow_risk").action == (
        "In float16: run that component in bfloat16 or float32; a VAE as the message says for its pipeline's call "
        "(force_upcast where the call reads it, SDXL's; SDXL's VAE: the fp16-fix VAE; otherwise "
        'pipe.vae.to(torch.float32), or where the call hands the VAE its latents uncast, its output_type="latent" '
        "decoded in float32); under float16 autocast, which computes float32 weights in float16 too, an upcast helps "
        "only with the decode run outside the autocast: autocast to bfloat16 instead, or run that component outside "
        "autocast; in bfloat16, whose range is float32's, no dtype holds more: check the named module's weights and "
        "the scale of its inputs."
    )


def test_a_float32_pipeline_near_overflow_under_fp16_autocast_is_told_to_autocast_to_bfloat16(tmp_path):
    """A float32 UNet run under ``torch.autocast(..., dtype=torch.float16)`` computes in float16: its near-max
    output was told to "run this component in bfloat16 or float32, or upcast this module", though it is float32
    already and its weights' dtype does not change what autocast computes in."""
    pipe = tiny_pipeline("sd")
    assert pipe.unet.dtype == torch.float32
    with plant(pipe.unet.get_submodule(UNET_LEAF), 0, lambda out: out / out.abs().amax() * 60000):
        # full probes: the sentinel reads the block, whose residual add gives float32 under autocast
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic", probes="full"))
        with torch.autocast(device_type="cpu", dtype=torch.float16), dbg:  # (attached under it: probed as fp16)
            run(pipe, steps=2, output_type="latent")
    risks = [a for a in kinds(dbg.report(), "overflow_risk") if a.component == "unet"]
    assert [(a.module, a.details["dtype"], a.details["weights_dtype"]) for a in risks] == [
        (UNET_LEAF, "float16", "float32")
    ]
    share = f"{risks[0].details['dtype_max_fraction']:.0%}"
    assert risks[0].message == (
        f"unet.{UNET_LEAF} output reached {share} of the float16 maximum (|x|=6e+04); it ran under float16 "
        "autocast (its weights are float32): autocast to bfloat16 instead (torch.autocast(..., "
        f"dtype=torch.bfloat16)) or run unet.{UNET_LEAF} outside autocast."
    )


def test_a_module_kept_in_float32_of_an_fp16_pipeline_without_autocast_gets_the_fp16_advice(tmp_path):
    """diffusers' ``_keep_in_fp32_modules`` (Wan's norms, ``FP32LayerNorm``) keep a module's weights in float32
    in a float16 model and cast its output back to float16: no autocast ran, so its near-max output is told
    the float16 advice, not "it ran under float16 autocast" (float32 weights beside a float16 output alone)."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    leaf = pipe.unet.get_submodule(UNET_LEAF).float()  # kept in float32, as _keep_in_fp32_modules does
    handles = [
        leaf.register_forward_pre_hook(lambda module, args: tuple(a.float() for a in args)),
        leaf.register_forward_hook(lambda module, args, out: out.half()),  # (FP32LayerNorm's cast back)
    ]
    try:
        with plant(leaf, 0, lambda out: out / out.abs().amax() * 60000):
            dbg = DiffusionModelDebugger(pipe, cfg(tmp_path, level="basic", probes="full"))
            with dbg:
                run(pipe, steps=2, output_type="latent")
    finally:
        for handle in handles:
            handle.remove()
    risks = [a for a in kinds(dbg.report(), "overflow_risk") if a.component == "unet"]
    assert [(a.module, a.details["dtype"], "weights_dtype" in a.details) for a in risks] == [
        (UNET_LEAF, "float16", False)
    ]
    assert risks[0].message.endswith("run this component in bfloat16 or float32, or upcast this module.")


@pytest.mark.parametrize("autocast", [torch.float16, torch.bfloat16])
def test_a_float16_output_of_float32_weights_gets_the_autocast_advice_only_under_float16_autocast(autocast):
    """A float32 module's float16 output is autocast's where autocast computes in float16: "it ran under float16
    autocast ... autocast to bfloat16 instead". Under bfloat16 autocast that float16 came from elsewhere (a module
    kept in float32 that casts back, ``_keep_in_fp32_modules``), and the user autocasts to bfloat16 already: the
    float16 advice holds. Any autocast open counted (bfloat16's was told to autocast to bfloat16)."""
    from diffusion_debug.probes import ModuleReading

    reading = ModuleReading("up_blocks.0.resnets.0.conv2", 0, "float16", 1.0, 6e4, "float16", "absmax")
    with torch.autocast("cpu", dtype=autocast):
        (risk,) = checks.overflow_risk(
            "unet", reading, step=0, timestep=None, fraction=0.5, localized_by="sentinel", weights_dtype="float32"
        )
    fp16 = autocast == torch.float16
    assert ("weights_dtype" in risk.details) is fp16
    assert risk.message.endswith(
        "it ran under float16 autocast (its weights are float32): autocast to bfloat16 instead (torch.autocast(..., "
        "dtype=torch.bfloat16)) or run unet.up_blocks.0.resnets.0.conv2 outside autocast."
        if fp16
        else "run this component in bfloat16 or float32, or upcast this module."
    )


def test_an_sdxl_fp16_vae_nan_is_advised_by_the_dtype_of_the_module_that_made_it_not_the_vaes_most(tmp_path):
    """diffusers < 0.36's ``upcast_vae`` (force_upcast) casts the VAE to float32 but puts its
    ``decoder.mid_block`` back in float16: a NaN made there is an fp16 one, given the upcast and
    fp16-fixed-VAE advice (before: read as the float32 VAE's, the generic advice); one made in an
    up block ran in float32 and is told so, not to try float32."""
    pipe = tiny_pipeline("sdxl", dtype=torch.float16)

    def upcast_vae():  # diffusers 0.32-0.35's, with torch 2's attention processor
        pipe.vae.to(dtype=torch.float32)
        for part in (pipe.vae.post_quant_conv, pipe.vae.decoder.conv_in, pipe.vae.decoder.mid_block):
            part.to(torch.float16)

    pipe.upcast_vae = upcast_vae
    up = pipe.vae.decoder.up_blocks[0]  # and its Decoder cast the mid block's output to the up blocks' dtype
    cast = up.register_forward_pre_hook(lambda block, args: (args[0].to(torch.float32), *args[1:]))
    found = {}
    for name in ("decoder.mid_block.resnets.0.conv1", "decoder.up_blocks.0.resnets.0.conv2"):
        with plant(pipe.vae.get_submodule(name), 0, lambda out: out * float("nan")):
            dbg = DiffusionModelDebugger(pipe, cfg(tmp_path / name, level="basic", log_level="error"))
            with dbg:
                run(pipe, steps=1)
        (found[name],) = [a for a in kinds(dbg.report(), "nonfinite") if a.severity == "error"]
    cast.remove()
    mid, up = found.values()
    assert (mid.module, mid.details["vae_dtype"], up.module, up.details["vae_dtype"]) == (
        "decoder.mid_block.resnets.0.conv1",
        "float16",
        "decoder.up_blocks.0.resnets.0.conv2",
        "float32",
    )
    assert (
        mid.message == f"vae.decoder.mid_block.resnets.0.conv1 produced NaN/Inf from finite inputs ({SDXL_FP16_VAE})."
    )
    # the up block ran in float32 (before: "try float32 or bfloat16", to a VAE that ran in float32)
    assert up.message == (
        "vae.decoder.up_blocks.0.resnets.0.conv2 produced NaN/Inf from finite inputs (it ran in float32, so this "
        "is no half-precision overflow: check its weights and inputs)."
    )
    assert pipe.vae.dtype == torch.float16  # the pipeline cast it back after the decode


def test_a_sentinels_inf_inside_a_near_max_block_is_decided_as_that_blocks_clip_only_when_every_bad_one_is_inside():
    """A sentinel read a residual projection's Inf and the block around it at float16's clamp (T5's 64512) in one
    call: the block is replayed as a clip (its replay names the Inf), no NaN/Inf localised apart. A NaN (a clip
    keeps it) or an Inf outside the block keep the NaN/Inf's own path; full probes decide the clip as read, and so
    does localising off (no replay to name it: it named the Inf at its leaf beside an overflow warning at the block,
    the clip's consequence, two findings for one cause)."""
    from diffusion_debug.diffusion.replay.decide import CLIP_UNLOCALISED, ReplayMemory, decide
    from diffusion_debug.probes import ModuleReading

    wo = ModuleReading("block.0.ff.wo", 0, "float16", None, float("inf"), "float16")
    block = ModuleReading("block.0", 0, "float16", None, 64512.0, "float16")
    other = ModuleReading("block.1.ff.wo", 0, "float16", None, float("inf"), "float16")
    nan = wo._replace(output_value=float("nan"))

    def plan(readings, full=False, localize=True):
        seen = checks.suspects(readings, 0.5)
        asked = dict(leaf=lambda c, m: m.endswith("wo"), received=lambda c, s: False, unwatched=None, site="")
        made = decide("t5", seen, readings, memory=ReplayMemory(), output_finite=True, full=full, **asked,
                      localize=localize, fraction=0.5)  # fmt: skip
        plan.overflow = made.overflow
        return made.replay, made.source is not None, made.overflow and (made.overflow.replay, made.overflow.clean)

    assert plan([wo, block]) == (None, False, ("block.0", True))
    assert plan([nan, block]) == ("block.0.ff.wo", False, ("block.0", False))
    assert plan([wo, block, other]) == ("block.0.ff.wo", False, ("block.0", False))
    assert plan([wo, block], localize=False) == (None, False, (None, True))  # the clip as read, unreplayed
    clip = plan.overflow.clipped
    assert (clip.producer, clip.block, plan.overflow.how) == (wo, "block.0", CLIP_UNLOCALISED)
    assert plan([wo, block], full=True) == (None, False, None)  # full probes: the clip decided as read
    # localising off, a block near the max but far below it (33000, half of 65504) clipped nothing: it was read
    # as the clip ('clipped it to 33000'), its overflow_risk dropped; the Inf at its leaf and the block's warning
    for value, clipped in ((33000.0, False), (64503.0, False), (64504.0, True), (65504.0, True)):
        near = block._replace(output_value=value)
        assert plan([wo, near], localize=False) == (None, not clipped, (None, True)), value
        made = plan.overflow.clipped
        assert ((made.block, made.value) if made else None) == (("block.0", value) if clipped else None), value


def test_a_sentinels_inf_inside_a_near_max_block_keeps_its_own_path_where_no_replay_reads_the_clip():
    """The clip path is taken only where the block's replay runs now or this run already holds its clip: a block
    localised before (``overflow_where``, kept for the debugger's life), one passed in or tried this run, or a run
    whose ``debug_timeout`` of replays is spent would not replay it, and the Inf was swallowed (an overflow warning,
    no error). There the Inf keeps its own path: its block replayed as a NaN/Inf's; but for a block whose replay was
    tried this run and could not run: the clip as the sentinel read it (its own path warned the block too)."""
    from diffusion_debug.diffusion.replay.decide import CLIP_UNREPLAYED, Clip, ReplayMemory, decide
    from diffusion_debug.probes import ModuleReading

    wo = ModuleReading("block.0.ff.wo", 0, "float16", None, float("inf"), "float16")
    block = ModuleReading("block.0", 0, "float16", None, 64512.0, "float16")
    key = ("t5", "block.0")

    def plan(memory, block=block):
        seen = checks.suspects([wo, block], 0.5)
        asked = dict(leaf=lambda c, m: m.endswith("wo"), received=lambda c, s: False, unwatched=None, site="")
        made = decide("t5", seen, [wo, block], memory=memory, output_finite=True, full=False, **asked,
                      localize=True, fraction=0.5)  # fmt: skip
        return made.replay, made.source is not None, made.overflow and made.overflow.replay

    own = ("block.0.ff.wo", False, None)  # the Inf's replay (its leaf given near-max values); the block's not again
    known = ReplayMemory()
    known.overflow_where[key] = None
    assert plan(known, block._replace(output_value=60000.0)) == own
    assert plan(known) == (None, False, "block.0")  # at the max (T5's 64504, within 1000): replayed once a run
    known.replayed_at_max.add(key)
    assert plan(known) == own
    memory = ReplayMemory()
    memory.passed_in.add(key)
    assert plan(memory)[:2] == own[:2]
    tried = ReplayMemory()  # its replay could not run this run (a second T5 call under true CFG): the clip as read
    tried.tried.add(key)
    made = decide("t5", checks.suspects([wo, block], 0.5), [wo, block], memory=tried, output_finite=True,
                  full=False, leaf=lambda c, m: m.endswith("wo"), received=lambda c, s: False, unwatched=None,
                  site="", localize=True, fraction=0.5)  # fmt: skip
    assert (made.replay, made.source, made.overflow.replay, made.overflow.clipped, made.overflow.how) == (
        None,
        None,
        None,
        Clip(wo, "block.0", 64512.0),
        CLIP_UNREPLAYED,
    )
    spent = ReplayMemory(timeout=1.0)
    spent.seconds = 1.0
    assert plan(spent)[:2] == own[:2]
    clipped = ReplayMemory()  # this run's clip, held: decided as that clip, unreplayed
    clipped.overflow_where[key] = None
    clipped.clipped[key] = (Clip(wo, "block.0", 64512.0), 7)
    made = decide("t5", checks.suspects([wo, block], 0.5), [wo, block], memory=clipped, output_finite=True,
                  full=False, leaf=lambda c, m: m.endswith("wo"), received=lambda c, s: False, unwatched=None,
                  site="", localize=True, fraction=0.5)  # fmt: skip
    assert (made.replay, made.source, made.overflow.clipped, made.overflow.replayed) == (
        None,
        None,
        Clip(wo, "block.0", 64512.0),
        7,
    )


def test_a_sentinels_inf_its_block_was_read_clipping_is_the_finding_where_the_blocks_replay_shows_no_clip():
    """The clip path (a sentinel read ``wo``'s Inf inside ``block.0`` at T5's clamp) replays the block to name the
    Inf. Where that replay could not run (no kept call, a replay OOM) or made no Inf again, the plan was the block's
    plain near-overflow: the Inf the sentinel read was lost (a warning, no error). The plan carries the sentinel's
    reading, and is then the clip as the sentinel read it: ``wo``'s Inf, clipped in ``block.0`` to 64512."""
    from diffusion_debug.diffusion.replay.decide import (
        CLIP_NOT_AGAIN,
        CLIP_UNREPLAYED,
        Clip,
        OverflowReplayed,
        ReplayMemory,
        decide,
    )
    from diffusion_debug.probes import ModuleReading

    wo = ModuleReading("block.0.ff.wo", 0, "float16", None, float("inf"), "float16")
    block = ModuleReading("block.0", 0, "float16", None, 64512.0, "float16")
    made = ModuleReading("block.0.ff", 0, "float16", 1.0, 40000.0, "float16")

    def shown(answer):
        memory = ReplayMemory()
        plan = decide("t5", checks.suspects([wo, block], 0.5), [wo, block], memory=memory, output_finite=True,
                      full=False, leaf=lambda c, m: m.endswith("wo"), received=lambda c, s: False, unwatched=None,
                      site="", localize=True, fraction=0.5).overflow  # fmt: skip
        assert (plan.replay, plan.inf) == ("block.0", wo)
        found = memory.overflow_shown(plan, answer, 0 if answer is None else 9)
        return found.clipped, found.how, found.replayed, found.known

    read = Clip(wo, "block.0", 64512.0)
    assert shown(None) == (read, CLIP_UNREPLAYED, None, None)
    assert shown(OverflowReplayed(made=made)) == (read, CLIP_NOT_AGAIN, 9, None)
    assert shown(OverflowReplayed(passed_in=True)) == (read, CLIP_NOT_AGAIN, 9, None)
    replayed = Clip(wo._replace(input_value=1.0), "block.0", 64512.0)  # the replay's own clip: as it read it
    assert shown(OverflowReplayed(clipped=replayed)) == (replayed, "sentinel -> replay with full probes", 9, None)


def test_a_compiled_components_replay_that_shows_its_near_max_passed_in_names_no_module_and_is_not_made_again():
    """An output check's replay of a compiled decoder (``decoder``, its output at 61% of fp16's max) in which every
    near-max module took the values in with its inputs: for an eager call, values passed in (skipped this run, replayed
    again each run); for a compiled one, whose eager replay is not the values it computed, no module named: kept for
    the debugger's life as such (the output's own warning, every call), nothing marked passed in, no replay again."""
    from diffusion_debug.diffusion.replay.decide import (
        Overflow,
        OverflowReplayed,
        ReplayMemory,
        decide,
        overflow_replayed,
    )
    from diffusion_debug.probes import ModuleReading

    near = 0.61 * 65504
    given = [ModuleReading("decoder.conv_in", 0, "float16", near, near, "float16"),
             ModuleReading("decoder", 0, "float16", near, near, "float16")]  # fmt: skip
    assert overflow_replayed(given, "decoder", 0.5, True) == OverflowReplayed(passed_in=True)
    assert overflow_replayed(given, "decoder", 0.5, True, compiled=True) == OverflowReplayed()
    output, key = ModuleReading("decoder", 0, "float16", None, near, signal="absmax"), ("vae", "decoder")
    memory = ReplayMemory()
    plan = memory.overflow_shown(Overflow(output, key, replay="decoder"), OverflowReplayed(), len(given))
    assert (plan.reading, plan.known, plan.skip, memory.passed_in, memory.overflow_where) == (
        output,
        None,
        False,
        set(),
        {key: None},
    )
    memory.new_run()  # the next call: named from memory as none, not replayed
    again = decide("vae", checks.Suspects(None, None, output), [output], memory=memory, output_finite=True,
                   full=False, leaf=lambda c, m: False, received=lambda c, s: False, unwatched=None,
                   site="decoder", localize=True, fraction=0.5).overflow  # fmt: skip
    assert (again.replay, again.known, again.skip) == (None, None, False)


@pytest.mark.parametrize(
    "dtype, value, at_max",
    [
        ("float16", 64504.0, True),  # T5's clamp: finfo.max - 1000
        ("float16", 64000.0, False),
        ("bfloat16", 3.0e38, False),
        ("float8_e5m2", 57344.0, True),
        ("float8_e4m3fn", 230.0, False),  # (max 448: the 1000 margin would take every value for at the max)
        ("float8_e4m3fn", 440.0, False),
        ("float8_e4m3fn", 448.0, True),
    ],
)
def test_at_the_max_is_within_a_clamps_margin_only_where_the_dtype_reaches_far_beyond_it(dtype, value, at_max):
    """A near-max block at the max is replayed once a run (a clip's): with fp8 e4m3 every value was 'at the
    max' (448 - 1000 < 0), so each near-max e4m3 block was replayed every run."""
    from diffusion_debug.diffusion.replay.decide import at_dtype_max
    from diffusion_debug.probes import ModuleReading

    assert at_dtype_max(ModuleReading("block.0", 0, dtype, None, value, dtype)) is at_max
