"""A NaN/Inf made from finite values near the dtype's max is named at the module that made those values,
not at the one whose arithmetic overflowed on them (the cause, not the consequence). In a bf16 VAE a conv
planted at 0.9 of bf16's max makes the next GroupNorm's variance overflow (fp16's GroupNorm upcasts: there
the same plant is an ``overflow_risk``); bf16 components are checked at their output, so the replay that
already runs on the NaN decides it, and a clean call pays nothing more."""

from __future__ import annotations

import contextlib

import diffusion_helpers as helpers
import pytest
import torch
from diffusion_helpers import BF16_VAE, SD_FP16_VAE, changed_weight, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion import checks
from diffusion_debug.diffusion.replay.decide import ReplayMemory, decide
from diffusion_debug.diffusion.replay.near_max import near_max_maker
from diffusion_debug.probes import ModuleReading
from diffusion_debug.record import folded
from diffusion_debug.testing import plant_overflow, tiny_pipeline

CONV = "decoder.up_blocks.1.resnets.0.conv2"  # the VAE's planted conv
NORM = "decoder.up_blocks.1.resnets.1.norm1"  # the GroupNorm it feeds (through the resnet's residual add)
REPLAYED = "output check -> replay with full probes"


@pytest.fixture(scope="module")
def bf16_sd():
    return tiny_pipeline("sd", dtype=torch.bfloat16)


def warmed(pipe, tmp_path, **config) -> DiffusionModelDebugger:
    return helpers.warmed(pipe, lambda pipe: run(pipe, steps=1), str(tmp_path), **config)


def later(dbg, *kinds):
    """The anomalies of ``kinds`` the debugger's second run found."""
    return [a for a in dbg.report().anomalies if a.kind in kinds and a.details.get("run") == 2]


def test_a_bf16_vae_conv_near_the_max_is_named_as_the_origin_of_the_norms_nan(bf16_sd, tmp_path):
    dbg = warmed(bf16_sd, tmp_path)
    with plant_overflow(bf16_sd.vae.get_submodule(CONV), fraction=0.9), dbg:
        images = run(bf16_sd, steps=1)
    assert torch.from_numpy(images).isnan().any()
    found = later(dbg, "nonfinite", "overflow_risk")
    assert [(a.kind, a.severity, a.component, a.module, a.step) for a in found] == [
        ("nonfinite", "error", "vae", CONV, None),
        ("nonfinite", "warning", "vae", NORM, None),
    ]
    error, norm = found
    assert error.details["localized_by"] == norm.details["localized_by"] == REPLAYED
    assert (error.details["overflowed_in"], error.details["dtype"]) == (NORM, "bfloat16")
    assert error.details["near_max"] == pytest.approx(0.9, abs=0.01)  # bf16 rounds 0.9 x max to 0.902 of it
    assert error.details["absmax"] == pytest.approx(0.9 * torch.finfo(torch.bfloat16).max, rel=0.01)
    # bf16 has float32's range: no dtype advice, the values are wrong (before: "run the VAE in float32", at the norm)
    assert error.message == (
        f"vae.{CONV} made values at 90% of the bfloat16 maximum (|x|=3.057e+38), and vae.{NORM}, given them, "
        "produced NaN/Inf (its arithmetic overflowed on them: a norm's variance, a matmul); bfloat16 holds "
        f"float32's range, so float32 overflows on these values too: check vae.{CONV}'s weights and the scale of "
        "its inputs."
    )
    assert norm.details["follows"] == {"kind": "nonfinite", "rank": 0, "module": CONV}
    assert norm.details["input_near_max"] == pytest.approx(0.9, abs=0.01)
    assert norm.message == (
        f"vae.{NORM} produced NaN/Inf from finite inputs at 90% of the bfloat16 maximum (its arithmetic "
        f"overflowed on them); it follows the near-max values made at vae.{CONV}: fix that first."
    )
    # the headline is the conv, the norm's NaN folded under it; one replay, the one a NaN already had
    report = dbg.report()
    headline = report.headline
    assert (headline.kind, headline.severity, headline.component, headline.module) == (
        "nonfinite",
        "error",
        "vae",
        CONV,
    )
    cause, following = folded(report.anomalies)[0]
    assert cause is headline and [(a.module, a.severity) for a in following] == [(NORM, "warning")]
    assert [e["component"] for e in dbg.record.events if e["type"] == "replay"] == ["vae"]
    dbg.close()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_same_plant_is_named_at_the_conv_in_fp16_and_bf16(dtype, tmp_path):
    """fp16's GroupNorm upcasts: the conv's near-max output stays finite, an ``overflow_risk`` warning
    at the conv; bf16's overflows: a ``nonfinite`` error at the same conv. Either way the conv."""
    pipe = tiny_pipeline("sd", dtype=dtype)
    dbg = warmed(pipe, tmp_path)
    with plant_overflow(pipe.vae.get_submodule(CONV), fraction=0.9), dbg:
        run(pipe, steps=1)
    found = [(a.kind, a.severity, a.module) for a in later(dbg, "nonfinite", "overflow_risk")]
    if dtype == torch.float16:
        assert found == [("overflow_risk", "warning", CONV)]
    else:
        assert found == [("nonfinite", "error", CONV), ("nonfinite", "warning", NORM)]
    dbg.close()


def test_a_bf16_unet_conv_near_the_max_is_named_at_its_step(bf16_sd, tmp_path):
    """The UNet's third call (step 2): named at the conv with its step and timestep; the latents' NaN and
    the VAE's are warnings that point at it."""
    conv, norm = "up_blocks.1.resnets.0.conv2", "up_blocks.1.attentions.0.norm"
    dbg = warmed(bf16_sd, tmp_path)
    with plant_overflow(bf16_sd.unet.get_submodule(conv), fraction=0.9, from_call=2), dbg:
        run(bf16_sd, steps=3)
    anomalies = later(dbg, "nonfinite", "overflow_risk", "latent_divergence")
    (error,) = [a for a in anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "unet", conv, 2)
    assert error.timestep == dbg.report().steps[-1]["timestep"]
    assert (error.details["overflowed_in"], error.details["localized_by"]) == (norm, REPLAYED)
    (made,) = [a for a in anomalies if a.module == norm]
    assert (made.severity, made.step, made.details["follows"]["module"]) == ("warning", 2, conv)
    (passed,) = [a for a in anomalies if a.details.get("passed_on")]
    assert (passed.kind, passed.component, passed.details["origin"]) == (
        "nonfinite",
        "vae",
        f"unet {conv}, step 2 (t=1)",
    )
    assert passed.message == (  # the cause the headline names (the maker), not the norm that overflowed
        f"vae received non-finite input and passed it on; fix the first NaN/Inf at unet {conv}, step 2 (t=1) "
        "rather than vae."
    )
    assert all(a.severity == "warning" for a in anomalies if a is not error)
    headline = dbg.report().headline
    assert (headline.component, headline.module, headline.step) == ("unet", conv, 2)
    dbg.close()


def test_a_nan_weight_in_a_bf16_norm_is_still_named_at_the_norm(bf16_sd, tmp_path):
    """A NaN made inside the norm from moderate inputs: no module before it is taken for the cause."""
    dbg = warmed(bf16_sd, tmp_path)
    with changed_weight(bf16_sd.vae.get_submodule(NORM), lambda w: w.view(-1)[:1].fill_(float("nan"))), dbg:
        run(bf16_sd, steps=1)
    (error,) = [a for a in later(dbg, "nonfinite") if a.severity == "error"]
    assert (error.component, error.module, error.details["localized_by"]) == ("vae", NORM, REPLAYED)
    assert "overflowed_in" not in error.details and "near_max_from" not in error.details
    assert error.message == (
        f"vae.{NORM} produced NaN/Inf from finite inputs ({BF16_VAE}: check its weights and inputs)."
    )
    assert [a.module for a in later(dbg, "nonfinite")] == [NORM]
    dbg.close()


def _overflowing(out, given):
    """A norm that does not upcast: NaN where its input reached half of the dtype's max."""
    return torch.full_like(out, float("nan")) if given.abs().amax() >= 0.5 * torch.finfo(given.dtype).max else out


def _run_overflowing_at_the_norm(pipe, dbg, first_call, *planted):
    """One watched call of ``pipe`` (after a clean one where not ``first_call``) whose VAE ``NORM`` overflows
    in fp16 on its near-max input, each of ``planted`` (VAE modules) made near the max; the call's run number."""
    if not first_call:
        with dbg:
            run(pipe, steps=1)
    hook = pipe.vae.get_submodule(NORM).register_forward_hook(lambda module, args, out: _overflowing(out, args[0]))
    try:
        with contextlib.ExitStack() as plants:
            for name in planted:
                plants.enter_context(plant_overflow(pipe.vae.get_submodule(name), fraction=0.9))
            with dbg:
                run(pipe, steps=1)
    finally:
        hook.remove()
    return 1 if first_call else 2


@pytest.mark.parametrize("first_call", [True, False])
def test_an_fp16_module_that_overflows_on_near_max_inputs_is_named_after_their_maker(first_call, tmp_path):
    """fp16: the VAE's first call is read with full probes (decided from the call's readings, no replay),
    a later one by its sentinel and a replay; both name the conv, and no ``overflow_risk`` repeats it."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    run_number = _run_overflowing_at_the_norm(pipe, dbg, first_call, CONV)
    found = [a for a in dbg.report().anomalies if a.details.get("run") == run_number and a.component == "vae"]
    assert [(a.kind, a.severity, a.module) for a in found] == [
        ("nonfinite", "error", CONV),
        ("nonfinite", "warning", NORM),
    ]
    how = "full probes" if first_call else "sentinel -> replay with full probes"
    assert found[0].details["localized_by"] == how
    assert found[0].message.endswith(f"; {SD_FP16_VAE}.")  # fp16: SD 1.5's VAE's advice (no force_upcast read)
    dbg.close()


# -- the decision, on readings ----------------------------------------------------------------------
BF16_MAX = torch.finfo(torch.bfloat16).max
CONV_READING = ModuleReading("up.0.conv2", 0, "bfloat16", 2.0, 0.9 * BF16_MAX, "bfloat16")
NORM_READING = ModuleReading("up.1.norm1", 0, "bfloat16", 0.9 * BF16_MAX, float("nan"), "bfloat16")


def test_near_max_maker_takes_the_first_module_that_made_the_values_the_producer_was_given():
    passed_on = ModuleReading("up.0", 0, "bfloat16", 2.0, 0.9 * BF16_MAX, "bfloat16")  # the block returns after it
    readings = [CONV_READING, passed_on, NORM_READING]
    assert near_max_maker(readings, NORM_READING, 0.5) is CONV_READING
    moderate = NORM_READING._replace(input_value=3.0)  # a NaN weight: its inputs were moderate
    assert near_max_maker([CONV_READING, moderate], moderate, 0.5) is None
    given = CONV_READING._replace(input_value=0.9 * BF16_MAX)  # the call's arguments brought them: no maker
    assert near_max_maker([given, NORM_READING], NORM_READING, 0.5) is None
    assert near_max_maker([NORM_READING, CONV_READING], NORM_READING, 0.5) is None  # made after it: not its


@pytest.mark.parametrize("localize, replay", [(True, "up.1.norm1"), (False, None)])
def test_a_leaf_a_sentinel_read_given_near_max_inputs_is_replayed_to_name_their_maker(localize, replay):
    """A leaf's NaN/Inf from moderate inputs is named as read; from near-max ones its call is replayed
    (where replays are allowed) to find the module that made them."""
    seen = checks.suspects([NORM_READING], 0.5)
    asked = dict(output_finite=False, full=False, received=lambda c, s: False, unwatched=None, site="")
    plan = decide(
        "vae",
        seen,
        [NORM_READING],
        memory=ReplayMemory(),
        leaf=lambda c, m: True,
        localize=localize,
        fraction=0.5,
        **asked,
    )
    assert plan.replay == replay
    assert (plan.source is None) == localize
    moderate = NORM_READING._replace(input_value=3.0)
    plan = decide(
        "vae",
        checks.suspects([moderate], 0.5),
        [moderate],
        memory=ReplayMemory(),
        leaf=lambda c, m: True,
        localize=True,
        fraction=0.5,
        **asked,
    )
    assert (plan.replay, plan.source.module, plan.source.how) == (None, "up.1.norm1", "sentinel (a leaf module)")


def test_a_nan_inside_a_module_given_near_max_inputs_names_their_maker_from_full_probes():
    """Full probes read in the call decide as the replay does: the maker, with the producer as given."""
    seen = checks.suspects([CONV_READING, NORM_READING], 0.5)
    asked = dict(output_finite=False, received=lambda c, s: False, unwatched=None, site="", leaf=lambda c, m: True)
    plan = decide(
        "vae",
        seen,
        [CONV_READING, NORM_READING],
        memory=ReplayMemory(),
        full=True,
        localize=True,
        fraction=0.5,
        **asked,
    )
    assert (plan.source.module, plan.source.how) == ("up.1.norm1", "full probes")
    assert plan.source.near_max == (CONV_READING, NORM_READING)


def test_why_and_the_bundle_replay_name_the_module_that_made_the_near_max_values(bf16_sd, tmp_path):
    """``report.why()`` and the repro bundle's replay replay the origin's call and name what the run
    named; bf16 holds float32's range, so the VAE's float32 replay overflows as well."""
    from diffusion_debug.diffusion import replay

    dbg = warmed(bf16_sd, tmp_path)
    with plant_overflow(bf16_sd.vae.get_submodule(CONV), fraction=0.9):
        with dbg:
            run(bf16_sd, steps=1)
        result = dbg.report().why()
        (error,) = [a for a in later(dbg, "nonfinite") if a.severity == "error"]
        replayed = replay(dbg.report().save() / error.details["bundle"], bf16_sd.vae)
    assert (replayed["module"], replayed["overflowed_in"], replayed["first_nonfinite"]) == (CONV, NORM, NORM)
    assert (result.component, result.module, result.baseline.finite, result.fix) == ("vae", CONV, False, None)
    assert {r.factor: r.finite for r in result.replays}["vae upcast (float32)"] is False
    assert result.markdown().startswith(f"# why: vae {CONV}\n")
    dbg.close()


def test_why_and_the_bundle_replay_decide_at_the_runs_overflow_fraction(bf16_sd, tmp_path):
    """A run configured with ``overflow_fraction=0.2`` names a conv planted at 0.3 of bf16's max as the
    maker; its bundle keeps the fraction, so ``why()`` and the bundle replay name the same conv (before:
    both decided at the default 0.5 and named the norm). A bundle saved before the key existed replays
    at the default."""
    import json

    from diffusion_debug.diffusion import replay

    dbg = warmed(bf16_sd, tmp_path, overflow_fraction=0.2)
    with plant_overflow(bf16_sd.vae.get_submodule(CONV), fraction=0.3):
        with dbg:
            run(bf16_sd, steps=1)
        result = dbg.report().why()
        (error,) = [a for a in later(dbg, "nonfinite") if a.severity == "error"]
        bundle = dbg.report().save() / error.details["bundle"]
        replayed = replay(bundle, bf16_sd.vae)
        meta = json.loads((bundle / "meta.json").read_text())
        del meta["overflow_fraction"]  # as a bundle of an older version holds it
        (bundle / "meta.json").write_text(json.dumps(meta))
        old = replay(bundle, bf16_sd.vae)
    assert (error.module, error.details["overflowed_in"]) == (CONV, NORM)
    assert replayed["meta"]["overflow_fraction"] == 0.2
    assert (replayed["module"], replayed["overflowed_in"], replayed["first_nonfinite"]) == (CONV, NORM, NORM)
    assert (result.component, result.module, result.baseline.finite) == ("vae", CONV, False)
    assert (old["module"], old["overflowed_in"]) == (NORM, None)  # 0.3 is below the default 0.5
    dbg.close()


# -- whose values: the producer's own inputs, followed back, never an unrelated module ----------------
UNRELATED = "decoder.mid_block.resnets.0.conv1"  # near-max too, but only its resnet's norm2 (upcast in fp16) reads it


@pytest.mark.parametrize("first_call", [True, False])
def test_an_unrelated_earlier_near_max_module_is_not_taken_for_the_maker(first_call, tmp_path):
    """An earlier conv whose near-max values its own resnet's fp16 GroupNorm normalised away (an
    ``overflow_risk``, nothing more) did not make what the later norm overflowed on: the conv that
    feeds that norm did (before: the first near-max module of the call was named, whatever it fed)."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    run_number = _run_overflowing_at_the_norm(pipe, dbg, first_call, UNRELATED, CONV)
    found = [a for a in dbg.report().anomalies if a.details.get("run") == run_number and a.kind == "nonfinite"]
    assert [(a.severity, a.component, a.module) for a in found] == [("error", "vae", CONV), ("warning", "vae", NORM)]
    assert found[0].details["overflowed_in"] == NORM and found[1].details["follows"]["module"] == CONV
    ran = [a for a in dbg.report().anomalies if a.details.get("run") == run_number]
    risks = [a.module for a in ran if a.kind == "overflow_risk"]
    assert (UNRELATED in risks) == first_call  # full probes warn of it (a NaN's replay reads no risk, as before)
    dbg.close()


def _reading(module, given, made):
    return ModuleReading(module, 0, "bfloat16", given, made, "bfloat16")


def test_near_max_maker_follows_the_values_the_producer_was_given_back_to_where_they_were_made():
    """By value: the reading whose output is what the producer was given (to bf16's rounding), passed on
    through modules given them too, down into the innermost module that made them from moderate inputs."""
    big, other = 0.9 * BF16_MAX, 0.8 * BF16_MAX
    unrelated = [_reading("mid.0.conv1", 2.0, other), _reading("mid.0.norm2", other, 1.0), _reading("mid.0", 2.0, 3.0)]
    made = [_reading("up.0.conv1", 3.0, 4.0), _reading("up.0.conv2", 4.0, big), _reading("up.0", 3.0, big)]
    passed = [_reading("up.1.act", big, big)]  # a module given them, that hands them on
    norm = _reading("up.2.norm1", big, float("nan"))
    assert near_max_maker(unrelated + made + passed + [norm], norm, 0.5).module == "up.0.conv2"
    # the same values from the unrelated module, the one before the norm not near max: no maker named
    assert near_max_maker(unrelated + [_reading("up.0", 3.0, 5.0), norm], norm, 0.5) is None
    # an earlier call of the block (its modules before it) is not inside this one
    first = [_reading("up.0.conv2", 4.0, big), _reading("up.0", 3.0, 5.0)]
    again = [_reading("up.0.conv2", 4.0, 6.0), _reading("up.0", 3.0, big)]
    assert near_max_maker(first + again + [norm], norm, 0.5) is again[1]
    # float32 values read by abs-max, near fp16's max only once cast to it: not near their own dtype's max
    fp16_max = torch.finfo(torch.float16).max
    wide = ModuleReading("up.0", 0, "float32", 2.0, 0.9 * fp16_max, "float32", "absmax")
    narrow = ModuleReading("up.1.norm1", 0, "float16", 0.9 * fp16_max, float("nan"), "float16")
    assert near_max_maker([wide, narrow], narrow, 0.5) is None
