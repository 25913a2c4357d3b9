"""The sentinels of an fp16 VAE and text encoder, components called once per image, read a reused
debugger's first two runs, then runs of their own: the VAE's 6, 10..., the text encoder's 3, 7, 11...
(the UNet's step 0: 5, 9...), and every run after one whose block outputs were warm
(``components.sentinel_pace``): a near-overflow is warned at most ``SENTINEL_EVERY - 1`` calls late,
and a NaN/Inf at a call not read is still named at its module by the replay of the kept call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusion_helpers import SD_FP16_VAE, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger, installed
from diffusion_debug.diffusion.components.sentinel_pace import SENTINEL_EVERY
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.features import HAS_MODULAR, clip_name

REPLAYED = "sentinel -> replay with full probes"
OUTPUT_REPLAYED = "output check -> replay with full probes"
VAE_BLOCKS = [
    "decoder.up_blocks.0",
    "decoder.up_blocks.1",
    "decoder.up_blocks.2",
    "decoder.mid_block",
    "post_quant_conv",
]
HALF_MAX = torch.finfo(torch.float16).max
READINGS = "probe readings"  # (benchmarks.op_counts.READINGS)
modular = pytest.mark.skipif(not HAS_MODULAR, reason="this diffusers has no modular pipelines")


def module_named(component, name):
    """transformers' CLIP models nest the encoder differently across versions: match the suffix."""
    return next(n for n, _ in component.named_modules() if n == name or n.endswith("." + name))


class Calls:
    """Which call of the debugger is running (set by the test), and whether the once-per-image
    components' sentinel blocks were hooked as each call's own decode and encoding began (not a replay's)."""

    def __init__(self, pipe):
        self.now = 0
        self.hooked: dict[str, list[int]] = {"vae": [], "text_encoder": []}
        text = pipe.text_encoder
        last = text.get_submodule(module_named(text, clip_name("encoder.layers.1")))
        blocks = {"vae": [pipe.vae.get_submodule(name) for name in VAE_BLOCKS], "text_encoder": [last]}
        roots = {"vae": pipe.vae.decoder, "text_encoder": text}
        self.handles = [
            roots[name].register_forward_pre_hook(self._seen(name, blocks[name])) for name in ("vae", "text_encoder")
        ]

    def _seen(self, name, blocks):
        def pre_hook(module, args):
            if len(self.hooked[name]) < self.now - 1:  # from the 2nd call (the 1st reads with full probes)
                self.hooked[name].append(int(all(len(b._forward_hooks) == 1 for b in blocks)))

        return pre_hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize(
    "quiet, warned, vae_reads",
    [
        # far from the warning: the VAE reads runs 2 and 6; the near-overflow from call 3 on is warned at 6,
        # SENTINEL_EVERY - 1 calls late, and at 7 (warm since 6)
        (0.01, [6, 7], [1, 0, 0, 0, 1, 1]),
        (0.2, [3, 4, 5, 6, 7], [1] * 6),  # within 4x of it (warm): every run read, warned from the call it appears on
    ],
)
def test_a_reused_debugger_reads_the_vae_and_text_encoder_sentinels_at_runs_of_their_own_and_while_warm(
    tmp_path, quiet, warned, vae_reads
):
    """A served fp16 pipeline's every call is a run: the VAE's and text encoder's sentinels read a
    debugger's first two runs, then every 4th, each on runs of its own (the VAE 6, 10...; the text
    encoder 3, 7...: no call pays both), and every run after one where a block output its group read
    was within 4x of the warning; at the others their hooks are out as the component runs. A VAE block
    output near overflow from call 3 on (the call after a run read) is warned within ``SENTINEL_EVERY - 1``
    calls, at its module (the replay of that call's decode), with the VAE's upcast advice; the VAE's
    warmth makes the text encoder read no run more."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    calls = Calls(pipe)
    name = "decoder.up_blocks.0.upsamplers.0.conv"

    def scaled(module, args, out):
        fraction = 0.61 if calls.now >= 3 else quiet
        return (out.float() * (fraction * HALF_MAX / out.detach().abs().amax().float())).to(out.dtype)

    grown = pipe.vae.get_submodule(name).register_forward_hook(scaled)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    try:
        for call in range(1, 8):
            calls.now = call
            with dbg:
                run(pipe, steps=1)
    finally:
        calls.remove()
        grown.remove()
    assert calls.hooked == {"vae": vae_reads, "text_encoder": [1, 1, 0, 0, 0, 1]}  # calls 2 to 7
    risks = [a for a in dbg.report().anomalies if a.kind == "overflow_risk"]
    assert [(a.component, a.module, a.details.get("run")) for a in risks] == [("vae", name, r) for r in warned], risks
    assert warned[0] - 3 <= SENTINEL_EVERY - 1
    assert risks[0].details["localized_by"] == REPLAYED
    assert risks[0].message.endswith(f"; {SD_FP16_VAE}.")  # SD 1.5's: no force_upcast read
    dbg.close()


def past_fp16(out):
    """The SD VAE's fp16 failure: a decoder activation past 65504 (Inf, then NaN: a black image)."""
    return (out.float() * (1e5 / out.detach().abs().amax().float())).to(out.dtype)


def nan(out):
    return torch.full_like(out, float("nan"))


@pytest.mark.parametrize(
    "component, module, make",
    [
        ("vae", "decoder.up_blocks.0.resnets.0.conv2", past_fp16),
        ("vae", "decoder.mid_block.attentions.0.to_out.0", nan),
        ("text_encoder", clip_name("encoder.layers.1.mlp.fc1"), nan),
    ],
)
def test_a_nonfinite_at_a_run_the_sentinels_do_not_read_is_named_at_its_module_by_the_replay(
    tmp_path, component, module, make
):
    """The debugger's 4th call (its VAE's and text encoder's sentinels out): the NaN/Inf reaches the
    call's output, checked at every call, and the replay of the kept call names its module, at no
    step; the fp16 VAE's black image keeps its upcast advice. The calls around it are clean and
    bitwise as without the debugger."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    target = getattr(pipe, component)
    module = module_named(target, module)
    plain = run(pipe, steps=1)
    calls = Calls(pipe)
    planted = target.get_submodule(module).register_forward_hook(
        lambda m, a, out: make(out) if calls.now == 4 else None  # the 4th call (and its replay)
    )
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    try:
        for call in range(1, 5):
            calls.now = call
            with dbg:
                images = run(pipe, steps=1)
            assert (images == plain).all() != (call == 4), call
    finally:
        calls.remove()
        planted.remove()
    assert calls.hooked == {"vae": [1, 0, 0], "text_encoder": [1, 1, 0]}  # calls 2 to 4
    errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert [(a.kind, a.component, a.module, a.step, a.details.get("run")) for a in errors] == [
        ("nonfinite", component, module, None, 4)
    ], errors
    assert errors[0].details["localized_by"] == OUTPUT_REPLAYED
    if make is past_fp16:
        assert errors[0].message.endswith(f" ({SD_FP16_VAE}).")  # SD 1.5's: no force_upcast read
    assert [e["component"] for e in dbg.record.events if e["type"] == "replay"] == [component]
    found = [a for a in dbg.report().anomalies if a.kind in ("nonfinite", "overflow_risk")]
    assert {a.details.get("run") for a in found} == {4}, found
    dbg.close()


def hooks_fired(run_call):
    """The package's module hooks torch ran during ``run_call()``, by name, and the probes' readings
    (``benchmarks.op_counts.hook_calls``)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import op_counts

    return op_counts.hook_calls(run_call)


def test_one_attach_around_a_serving_loop_reads_the_vae_and_text_encoder_fully_on_its_first_call_only(tmp_path):
    """``with dbg:`` around six 1-step calls (a serving loop) reads the fp16 VAE and text encoder
    with full probes on the first call alone, as a debugger attached at every call does: calls 2 to 6
    run the hooks and readings of the attach-per-call pattern's calls 2 to 6 (the sentinels: all at run 2,
    26 hooks and 18 readings; the text encoder's at run 3, the UNet's at 5, the VAE's at 6; 8 hooks and 0
    readings at run 4; 22 and 14 before vae36 watched the VAE decoder's and text encoder's end modules), where
    every call of the one attach ran full probes on every module of both (174 to 181 hooks and 120 to 127 readings
    a call on tiny SD). The images are bitwise the plain ones."""
    patterns = {}
    for pattern in ("once", "per_call"):
        pipe = tiny_pipeline("sd", dtype=torch.float16)  # its own memo of components read fully
        plain = run(pipe, steps=1)
        calls = Calls(pipe)
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / pattern), log_level="error"))
        counts = []

        def call():
            images = run(pipe, steps=1)
            assert (images == plain).all()

        def per_call():
            with dbg:
                call()

        try:
            if pattern == "once":
                with dbg:
                    for n in range(1, 7):
                        calls.now = n
                        counts.append(hooks_fired(call))
            else:
                for n in range(1, 7):
                    calls.now = n
                    counts.append(hooks_fired(per_call))
        finally:
            calls.remove()
        patterns[pattern] = (counts, calls.hooked)
        assert not [a for a in dbg.report().anomalies if a.severity == "error"]
        dbg.close()
    (once, hooked), (per_call, hooked_per_call) = patterns["once"], patterns["per_call"]
    assert hooked == hooked_per_call == {"vae": [1, 0, 0, 0, 1], "text_encoder": [1, 1, 0, 0, 0]}  # calls 2 to 6
    assert once[1:] == per_call[1:]
    readings = [count.pop(READINGS, 0) for count in once[1:]]
    assert readings == [18, 4, 0, 7, 7]  # the UNet's sentinel 7, the text encoder's 2 x 2 (CFG), the VAE's 7
    assert [sum(count.values()) for count in once[1:]] == [26, 12, 8, 15, 15]  # the call sites' 8 and the sentinels'


def nan_at_one_call(tmp_path, pipe, call, component, module, at, calls, levels):
    """One attach around ``calls`` calls of ``pipe`` (``call()``: its image); ``component``'s ``module`` makes a
    NaN at call ``at`` (and its replay) alone: every other call's image is bitwise the plain one, the component's
    probe level after each call is ``levels[n - 1]``, and the one error is that NaN, named at its module and run
    (found at the output, no step). Returns the debugger (closed by the caller) and the error."""
    plain = call()
    now = [0]
    planted = (
        getattr(pipe, component)
        .get_submodule(module)
        .register_forward_hook(lambda m, a, out: nan(out) if now[0] == at else None)
    )
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    try:
        with dbg:
            for n in range(1, calls + 1):
                now[0] = n
                assert np.array_equal(call(), plain) != (n == at), n
                assert dbg._steps.probes.levels[component] == levels[n - 1], n
    finally:
        planted.remove()
    errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert [(a.kind, a.component, a.module, a.step, a.details.get("run")) for a in errors] == [
        ("nonfinite", component, module, None, at)
    ], errors
    return dbg, errors[0]


def test_a_nan_in_the_vae_decoder_at_the_4th_call_of_one_attach_is_named_at_its_module(tmp_path):
    """One attach around a serving loop: the 4th call's VAE decode (its sentinel out, the first call's
    full probes off since that call ended) makes a NaN; the output check finds it and the replay of the
    kept call names its module, at that run alone. The calls around it are bitwise the plain ones."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    module = "decoder.up_blocks.1.resnets.0.conv2"
    levels = ["sentinel"] * 6  # probed again as call 1 ends (maybe_free_model_hooks)
    dbg, error = nan_at_one_call(tmp_path, pipe, lambda: run(pipe, steps=1), "vae", module, 4, 6, levels)
    assert error.details["localized_by"] == OUTPUT_REPLAYED
    assert [e["component"] for e in dbg.record.events if e["type"] == "replay"] == ["vae"]
    dbg.close()


def modular_fp16():
    """A tiny fp16 Modular Diffusers SDXL pipeline (built as test_modular.py builds one), its VAE run in fp16
    (no ``force_upcast``), and a 1-step call of it: no ``maybe_free_model_hooks`` ends its calls."""
    from diffusers.modular_pipelines.stable_diffusion_xl import StableDiffusionXLAutoBlocks

    components = {k: v for k, v in tiny_pipeline("sdxl", dtype=torch.float16).components.items() if v is not None}
    components["vae"].register_to_config(force_upcast=False)
    pipe = StableDiffusionXLAutoBlocks().init_pipeline()
    pipe.update_components(**components)

    def call():
        out = pipe(
            prompt="a cat", num_inference_steps=1, height=32, width=32, generator=torch.Generator().manual_seed(0)
        )
        return np.asarray(out.values["images"][0])

    return pipe, call


@modular
def test_one_attach_around_modular_calls_reads_the_vae_and_text_encoders_fully_on_the_first_call_only(tmp_path):
    """A modular pipeline's call ends unseen (no ``maybe_free_model_hooks``): ``with dbg:`` around five calls
    probes its fp16 VAE and text encoders again as call 2's run begins (at the first text encoder's pre-hooks,
    before its forward), so calls 2 to 5 read what the attach-per-call pattern's calls 2 to 5 read (23, 2, 0
    and 16 readings: run 2 every sentinel, run 3 the text encoders' last layers alone, run 4 none, run 5 the
    UNet's alone; the one attach read every module of all three on every call before: 298 to 330 hooks a
    call); call 2 runs one hook more, the first text encoder's full probe arming itself before it is taken off.
    Where a run does not read a group an attach per call leaves its sentinels out (``SentinelPace.left_out``),
    and the one attach takes them out: the two text encoders' last layers at runs 4 and 5 too (SDXL asks for
    hidden states, so transformers' output-capturing hook shares each of those layers: ``PausedHooks`` takes
    ours out from behind it, and puts it back there at run 3; before, it read them, 2).
    The images are bitwise the plain ones."""
    patterns = {}
    for pattern in ("once", "per_call"):
        pipe, call = modular_fp16()
        plain = call()
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / pattern), log_level="error"))

        def checked():
            assert np.array_equal(call(), plain)

        def per_call():
            with dbg:
                checked()

        if pattern == "once":
            with dbg:
                counts = [hooks_fired(checked) for _ in range(5)]
        else:
            counts = [hooks_fired(per_call) for _ in range(5)]
        patterns[pattern] = counts
        assert dict(dbg._steps.probes.levels) == dict.fromkeys(
            ("unet", "vae", "text_encoder", "text_encoder_2"), "sentinel"
        )
        assert not [a for a in dbg.report().anomalies if a.severity == "error"]
        dbg.close()
    once, per_call = patterns["once"], patterns["per_call"]
    assert once[1] - per_call[1] == {"Probe._attach_armed.<locals>.arm": 1} and not per_call[1] - once[1]
    assert once[2:] == per_call[2:]  # runs 3 to 5: the same sentinels run in either (run 4: none of ours)
    # 23 and 2 before vae36 watched the end modules (the VAE decoder 2, text_encoder 1, text_encoder_2 2)
    assert [count[READINGS] for count in once[1:]] == [28, 5, 0, 16]
    assert [count[READINGS] for count in per_call[1:]] == [28, 5, 0, 16]


@modular
def test_a_nan_in_the_text_encoder_at_the_modular_call_whose_run_start_probes_again_is_named_at_its_module(tmp_path):
    """Call 2 of one attach begins its run at the first text encoder's pre-hooks, where its full probes are
    taken off and its sentinel put on: that call's readings are not lost: a NaN its ``fc1`` makes at call 2
    is named at its module, at run 2 alone, and calls 1, 3 and 4 are bitwise the plain ones."""
    pipe, call = modular_fp16()
    module = module_named(pipe.text_encoder, clip_name("encoder.layers.0.mlp.fc1"))
    levels = ["full", "sentinel", "sentinel", "sentinel"]  # probed again as call 2's run begins
    dbg, _ = nan_at_one_call(tmp_path, pipe, call, "text_encoder", module, 2, 4, levels)
    dbg.close()


@modular
def test_a_nan_in_the_vae_decoder_at_the_4th_modular_call_of_one_attach_is_named_at_its_module(tmp_path):
    """One attach around five calls of a modular pipeline: the 4th call's VAE decode (its sentinel out, the
    first call's full probes off since call 2 began) makes a NaN; the output check finds it and the replay of
    the kept call names its module, at that run alone. The other calls' images are bitwise the plain ones."""
    pipe, call = modular_fp16()
    levels = ["full"] + ["sentinel"] * 4
    dbg, error = nan_at_one_call(tmp_path, pipe, call, "vae", "decoder.up_blocks.1.resnets.0.conv2", 4, 5, levels)
    assert error.details["localized_by"] == OUTPUT_REPLAYED
    assert [e["component"] for e in dbg.record.events if e["type"] == "replay"] == ["vae"]
    dbg.close()


def test_an_attach_before_a_run_not_read_puts_no_sentinel_hook_in(tmp_path):
    """A reused debugger's attach before a run a group of its sentinels does not read (the UNet's step 0,
    the VAE's or the text encoder's calls, each read on runs of its own) leaves its hooks out
    (``SentinelPace.left_out``), where it put them in and the run's beginning took them out again (a
    1-step fp16 call not read paid both, at every call of a served pipeline); a run read finds them in at
    the attach. The calls are bitwise
    the plain ones."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    plain = run(pipe, steps=1)
    text = pipe.text_encoder
    blocks = [pipe.vae.get_submodule(name) for name in VAE_BLOCKS]
    blocks += [text.get_submodule(module_named(text, clip_name("encoder.layers.1"))), pipe.unet.mid_block]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    hooked = []
    for _ in range(6):
        dbg.attach()
        hooked.append(sum(len(block._forward_hooks) for block in blocks))
        assert (run(pipe, steps=1) == plain).all()
        dbg.detach()
    # run 1: full probes (armed at the call; before torch 2.6 a hook on each watched module, 8 of these: the seven
    # blocks' and post_quant_conv's pass-through one); run 2 reads all, 3 the text encoder, 5 the UNet, 6 the VAE
    assert hooked == [2 if installed.GLOBAL_HOOKS_TAKE_KWARGS else 8, 7, 1, 0, 1, 5]
    assert sum(len(block._forward_hooks) for block in blocks) == 0
    assert not [a for a in dbg.report().anomalies if a.severity == "error"]
    dbg.close()


def test_an_unread_1_step_call_puts_no_unet_sentinel_hook_in_after_its_only_step(tmp_path):
    """A reused debugger's 1-step fp16 calls whose step 0 the UNet's sentinel does not read (runs 3 and 4): its
    hooks stay out after that step, the schedule's last (before: ``at(1)`` put them in, for no step), as the VAE
    decodes, whether they were taken out in the attach (run 3: ``PausedHooks``) or left out at it (run 4, an
    attach of its own: ``SentinelPace.left_out``); run 2, read, has them in."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    unet, found = pipe.unet, []

    def unet_hooks(module, args):  # the hooks inside the UNet (its call site's are on the UNet itself)
        found.append(sum(len(m._forward_hooks) for m in unet.modules() if m is not unet))

    seen = pipe.vae.decoder.register_forward_pre_hook(unet_hooks)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    try:
        with dbg:
            for _ in range(3):
                run(pipe, steps=1)
        with dbg:
            run(pipe, steps=1)
    finally:
        seen.remove()
        dbg.close()
    assert found[1:] == [7, 0, 0]  # run 2: its sentinel's 7 blocks (test_fp16_probes' UNET_BLOCKS)
