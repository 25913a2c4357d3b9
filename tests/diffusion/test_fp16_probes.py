"""fp16 components at the default (DESIGN: no component gets full probes on every call). A VAE or
text encoder is read with full probes on its first call, then by its output and its block sentinel
(fp16 block outputs, their abs-maxes one op a call); the denoiser by its block sentinel, one op a
call. A reused debugger's later runs take that path: every planted fault is still named at its
module and step, by a replay of the kept call with full probes."""

from __future__ import annotations

import copy

import diffusion_helpers as helpers
import pytest
import torch
from diffusion_helpers import BF16_VAE, SD_FP16_VAE, plant, run

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components.sentinel_pace import reads
from diffusion_debug.testing import plant_overflow, tiny_pipeline
from diffusion_debug.testing.features import HAS_LAYERWISE_CASTING, SDPA_KEEPS_NAN, clip_name

REPLAYED = "sentinel -> replay with full probes"
OUTPUT_REPLAYED = "output check -> replay with full probes"  # a step the UNet's sentinel does not read
RECEIVED = "sentinel: its inputs were already non-finite"
VAE_DECODER_BLOCKS = [  # what the VAE's sentinel watches of a decode (the encoder's blocks run only for img2img):
    # its blocks that hold modules and the single modules after them (conv_norm_out, conv_out: the decode's end, whose
    # near-max or NaN/Inf the sentinel names at its module as read), not conv_in before them (its near-max reaches the
    # first block's output, read, and a replay names it); post_quant_conv runs outside the decoder; the mid block is
    # one block, as each up block is
    "decoder.up_blocks.0",
    "decoder.up_blocks.1",
    "decoder.up_blocks.2",
    "decoder.mid_block",
    "decoder.conv_norm_out",
    "decoder.conv_out",
    "post_quant_conv",
]
UNET_BLOCKS = [  # the fp16 UNet's sentinel: its blocks, its mid block as one, and conv_out (its output is the call's)
    "time_embedding",
    "down_blocks.0",
    "down_blocks.1",
    "up_blocks.0",
    "up_blocks.1",
    "mid_block",
    "conv_out",
]


@pytest.fixture(scope="module")
def fp16_sd():
    return tiny_pipeline("sd", dtype=torch.float16)


def warmed(pipe, tmp_path, **kwargs) -> DiffusionModelDebugger:
    return helpers.warmed(pipe, lambda pipe: run(pipe, steps=1), str(tmp_path), **kwargs)


def later_run(dbg, kind):
    """The anomalies of ``kind`` the debugger's second run found."""
    return [a for a in dbg.report().anomalies if a.kind == kind and a.details.get("run") == 2]


def suffixed(module, name):
    """transformers' CLIP models nest the encoder differently across versions: match the suffix."""
    return next(n for n, _ in module.named_modules() if n == name or n.endswith("." + name))


def test_a_component_called_once_per_image_is_read_fully_once_then_by_its_block_sentinel(fp16_sd, tmp_path):
    dbg = DiffusionModelDebugger(fp16_sd, DebugConfig(output_dir=str(tmp_path)))
    probes = dbg._steps.probes
    with dbg:
        assert probes.levels == {"unet": "sentinel", "text_encoder": "full", "vae": "full"}
        run(fp16_sd, steps=1, output_type="latent")  # no decode: the VAE's first call is still to come
    with dbg:
        assert probes.levels == {"unet": "sentinel", "text_encoder": "sentinel", "vae": "full"}
        run(fp16_sd, steps=1)
    with dbg:
        assert probes.levels == {"unet": "sentinel", "text_encoder": "sentinel", "vae": "sentinel"}
        decoder = [n for n in probes.probes["vae"].module_names if not n.startswith(("encoder.", "quant_conv"))]
        assert decoder == VAE_DECODER_BLOCKS
        # its layer stack at its last layer (a residual stream: what a layer makes reaches it) and its last norm
        # (the call's end), not its embeddings
        text = probes.probes["text_encoder"].module_names
        assert [name.split(".")[-2:] for name in text[:-1]] == [["layers", "1"]]
        assert text[-1] == clip_name("final_layer_norm")
        assert probes.probes["unet"].module_names == UNET_BLOCKS
    dbg.clear_debug_history()  # forgets the first reads too: the next call is read fully again
    with dbg:
        assert probes.levels == {"unet": "sentinel", "text_encoder": "full", "vae": "full"}
    fp16_sd.vae.float()  # a component whose dtype changed is read fully once more (fp32: not at all)
    try:
        with dbg:
            assert probes.levels["vae"] == "output"
    finally:
        fp16_sd.vae.half()
    dbg.close()


@pytest.mark.parametrize(
    "component, module, from_call, step",
    [
        ("unet", "up_blocks.1.resnets.0.conv2", 1, 1),
        ("unet", "mid_block.attentions.0.transformer_blocks.0.ff.net.2", 2, 2),
        ("vae", "decoder.up_blocks.1.resnets.0.conv2", 0, None),
        ("text_encoder", clip_name("encoder.layers.1.mlp.fc1"), 0, None),
    ],
)
def test_a_nonfinite_after_the_first_call_is_named_at_its_module_and_step(
    fp16_sd, tmp_path, component, module, from_call, step
):
    dbg = warmed(fp16_sd, tmp_path, level="basic")
    target = getattr(fp16_sd, component)
    module = suffixed(target, module)
    with plant(target.get_submodule(module), from_call), dbg:
        run(fp16_sd)
    errors = [a for a in later_run(dbg, "nonfinite") if a.severity == "error"]
    assert [(a.component, a.module, a.step) for a in errors] == [(component, module, step)]
    # the UNet's sentinel reads steps 0, 1, 4, 8...: the NaN/Inf at step 2 reached the step's output,
    # whose check found it, and the replay named it there
    unread = component == "unet" and not reads(step, warm=False)
    assert errors[0].details["localized_by"] == (OUTPUT_REPLAYED if unread else REPLAYED)
    passed_on = [a for a in later_run(dbg, "nonfinite") if a is not errors[0]]
    assert passed_on or component == "vae"  # the last component: none downstream
    # the components downstream received the NaN/Inf: seen in their kept arguments, with no replay
    assert {(a.severity, a.details["localized_by"]) for a in passed_on} <= {("warning", RECEIVED)}
    assert [e["component"] for e in dbg.record.events if e["type"] == "replay"] == [component]
    dbg.close()


@pytest.mark.parametrize(
    "component, module",
    [("vae", "decoder.conv_out"), ("vae", "decoder.conv_in"), ("text_encoder", clip_name("final_layer_norm"))],
)
def test_a_nonfinite_from_a_single_module_the_sentinel_leaves_out_is_named_at_it_by_the_replay(
    fp16_sd, tmp_path, component, module
):
    """A component called once per image keeps no sentinel on the single modules at either end of
    its stack: what one of them makes non-finite reaches the call's output, and the replay names it."""
    dbg = warmed(fp16_sd, tmp_path, level="basic")
    target = getattr(fp16_sd, component)
    module = suffixed(target, module)
    with plant(target.get_submodule(module), 0), dbg:
        run(fp16_sd)
    errors = [a for a in later_run(dbg, "nonfinite") if a.severity == "error"]
    assert [(a.component, a.module, a.step) for a in errors] == [(component, module, None)]
    assert errors[0].details["localized_by"] == REPLAYED  # its component has a sentinel, whose replay names it
    assert [e["component"] for e in dbg.record.events if e["type"] == "replay"] == [component]
    dbg.close()


@pytest.mark.parametrize(
    "component, module, from_call, step",
    [
        ("unet", "conv_in", 1, 1),
        ("unet", "conv_norm_out", 0, 0),
        ("text_encoder", clip_name("embeddings"), 0, None),
    ],
)
def test_a_nonfinite_from_an_end_module_of_the_denoiser_or_a_text_encoders_embeddings_is_named_by_the_replay(
    fp16_sd, tmp_path, component, module, from_call, step
):
    """The UNet's sentinel leaves out its single modules at the input end and its norm before
    ``conv_out``, a text encoder's sentinel its embeddings (lookups): what one of them makes
    non-finite reaches the next block's output or the call's, and the replay names it, at its step."""
    dbg = warmed(fp16_sd, tmp_path, level="basic")
    target = getattr(fp16_sd, component)
    module = suffixed(target, module)
    with plant(target.get_submodule(module), from_call), dbg:
        run(fp16_sd)
    errors = [a for a in later_run(dbg, "nonfinite") if a.severity == "error"]
    assert [(a.component, a.module, a.step) for a in errors] == [(component, module, step)]
    assert errors[0].details["localized_by"] == REPLAYED
    assert [e["component"] for e in dbg.record.events if e["type"] == "replay"] == [component]
    dbg.close()


@pytest.mark.parametrize(
    "component, module, step",
    [
        ("unet", "mid_block.resnets.0", 0),
        ("unet", "mid_block.attentions.0.proj_out", 0),  # (an attention block returns a tuple: planted inside)
        ("vae", "decoder.mid_block.resnets.0", None),
        ("text_encoder", clip_name("embeddings"), None),
        ("text_encoder", clip_name("encoder.layers.0.mlp.fc2"), None),
        ("text_encoder", clip_name("encoder.layers.0.self_attn.out_proj"), None),
    ],
)
def test_an_fp16_near_overflow_inside_a_mid_block_or_at_embeddings_is_named_at_its_module_by_the_replay(
    fp16_sd, tmp_path, component, module, step
):
    """A mid block is one sentinel block (a residual chain: what one of its resnets or attentions
    makes reaches its output); a text encoder's layers are a residual stream read at its last layer,
    which carries what its embeddings and any earlier layer made: the block's near-overflow is read,
    and the replay with full probes names the module that made it."""
    dbg = warmed(fp16_sd, tmp_path)
    target = getattr(fp16_sd, component)
    module = suffixed(target, module)
    with plant_overflow(target.get_submodule(module), fraction=0.61), dbg:
        run(fp16_sd, steps=1)
    risks = [a for a in later_run(dbg, "overflow_risk") if a.component == component]
    assert [(a.component, a.module, a.step) for a in risks] == [(component, module, step)]
    assert risks[0].details["localized_by"] == REPLAYED
    assert risks[0].details["dtype_max_fraction"] == pytest.approx(0.61, abs=1e-3)
    dbg.close()


def test_the_fp16_vae_black_image_after_the_first_call_is_named_at_its_module_with_the_upcast_advice(
    fp16_sd, tmp_path
):
    """The SD VAE's fp16 failure: a decoder activation past 65504 becomes Inf, then NaN, and the
    image black; the same fault as the precision doctor plants."""
    name = "decoder.up_blocks.0.resnets.0.conv2"

    def past_fp16(out):
        return (out.float() * (1e5 / out.detach().abs().amax().float())).to(out.dtype)

    dbg = warmed(fp16_sd, tmp_path)
    with plant(fp16_sd.vae.get_submodule(name), 0, past_fp16), dbg:
        images = run(fp16_sd, steps=2)
    assert torch.from_numpy(images).isnan().all()
    (error,) = [a for a in later_run(dbg, "nonfinite") if a.severity == "error"]
    assert (error.component, error.module, error.details["localized_by"]) == ("vae", name, REPLAYED)
    # SD 1.5's pipeline reads no force_upcast: the decode in float32 it would make is said as the user's own
    assert error.message == f"vae.{name} produced NaN/Inf from finite inputs ({SD_FP16_VAE})."
    dbg.close()


def test_an_fp16_vae_near_overflow_after_the_first_call_is_named_at_its_module_with_the_upcast_advice(
    fp16_sd, tmp_path
):
    name = "decoder.up_blocks.0.upsamplers.0.conv"
    dbg = warmed(fp16_sd, tmp_path)
    with plant_overflow(fp16_sd.vae.get_submodule(name), fraction=0.61), dbg:
        run(fp16_sd, steps=2)
    (risk,) = later_run(dbg, "overflow_risk")
    assert (risk.component, risk.module, risk.details["localized_by"]) == ("vae", name, REPLAYED)
    assert risk.details["dtype_max_fraction"] == pytest.approx(0.61, abs=1e-3)
    assert risk.message.endswith(f"; {SD_FP16_VAE}.")
    assert [e["component"] for e in dbg.record.events if e["type"] == "replay"] == ["vae"]
    dbg.close()


@pytest.mark.parametrize(
    "component, module", [("vae", "decoder.conv_out"), ("text_encoder", clip_name("final_layer_norm"))]
)
def test_an_fp16_near_overflow_at_an_end_module_after_the_first_call_is_named_at_it_by_the_sentinel(
    fp16_sd, tmp_path, component, module
):
    """The sentinel of a VAE or text encoder watches the single modules after its call site's last block (vae36): a
    finite near-overflow one of them makes is named at its module by the sentinel's reading itself, with no replay
    (a leaf: nothing inside it to name), with the component's upcast advice (vae35: seen at the call's output and
    named by one replay of the kept call; that path stays for the runs the sentinel's pace does not read:
    ``test_output_near_max.py``)."""
    dbg = warmed(fp16_sd, tmp_path)
    target = getattr(fp16_sd, component)
    module = suffixed(target, module)
    with plant_overflow(target.get_submodule(module), fraction=0.61), dbg:
        run(fp16_sd, steps=2)
    risks = [a for a in later_run(dbg, "overflow_risk") if a.component == component]
    assert [(a.component, a.module, a.step) for a in risks] == [(component, module, None)]
    (risk,) = risks
    assert risk.details["localized_by"] == "sentinel"
    assert risk.details["dtype_max_fraction"] == pytest.approx(0.61, abs=1e-3)
    assert risk.message.startswith(f"{component}.{module} output reached 61%")
    if component == "vae":
        assert risk.message.endswith(f"; {SD_FP16_VAE}.")
    else:
        assert "run this component in bfloat16 or float32" in risk.message
    assert [e for e in dbg.record.events if e["type"] == "replay"] == []  # (named as read)
    dbg.close()


def test_a_later_clean_fp16_call_is_quiet_and_bitwise_equal(fp16_sd, tmp_path):
    plain = run(fp16_sd, steps=2)
    dbg = warmed(fp16_sd, tmp_path)
    with dbg:
        watched = run(fp16_sd, steps=2)
    assert (plain == watched).all()
    assert not [a for a in dbg.report().anomalies if a.kind in ("nonfinite", "overflow_risk")]
    assert not [e for e in dbg.record.events if e["type"] == "replay"]
    dbg.close()


def growing(fractions):
    """A forward hook scaling its module's output so that its abs-max is, at its n-th call, the n-th of
    ``fractions`` of fp16's largest value (the last one after them)."""
    calls = iter(fractions)

    def hook(module, args, output):
        fraction = next(calls, fractions[-1])
        peak = output.detach().abs().amax().float().clamp(min=1e-6)
        return (output.float() * (fraction * torch.finfo(torch.float16).max / peak)).to(output.dtype)

    return hook


@pytest.mark.parametrize(
    "quiet, warned",
    [
        (0.01, 8),  # far from the warning: steps 0, 1, 4, 8 read; the step 5 growth is warned at step 8
        (0.2, 5),  # within 4x of it (warm, read at steps 0-4): every step read, warned as it crosses
    ],
)
def test_a_growing_fp16_unet_near_overflow_is_warned_at_the_next_step_its_sentinel_reads(
    fp16_sd, tmp_path, quiet, warned
):
    """The UNet's sentinel reads a run's steps 0 and 1, then every 4th, and every step while a block it
    read was within 4x of the warning (sentinel_pace): a block output that grows past the warning
    (half of fp16's largest value) at step 5 is warned at the next step read, at the module that
    made it (the replay of that step's call); nothing is warned before."""
    module = "mid_block.resnets.0"
    fractions = [quiet] * 5 + [0.52, 0.55, 0.58, 0.61, 0.64]
    dbg = warmed(fp16_sd, tmp_path)
    handle = fp16_sd.unet.get_submodule(module).register_forward_hook(growing(fractions))
    try:
        with dbg:
            run(fp16_sd, steps=10)
    finally:
        handle.remove()
    risks = [a for a in later_run(dbg, "overflow_risk") if a.component == "unet"]
    assert [(a.module, a.step) for a in risks] == [(module, warned)]
    assert risks[0].details["localized_by"] == REPLAYED
    assert risks[0].details["dtype_max_fraction"] > 0.5  # (the replay is a call of its own: the next fraction)
    dbg.close()


def test_a_reused_debuggers_1_step_calls_read_the_unet_sentinel_at_calls_1_2_5_9_and_while_warm(fp16_sd, tmp_path):
    """A served 1-step pipeline's every call is a run of one step: the UNet's sentinel reads a run's
    step 0 at the debugger's first two runs, then every 4th (5, 9...), and while a block it read was
    near the warning (sentinel_pace); at the others its hooks are out as the UNet runs. A block output
    near overflow from call 6 on is warned at call 9, at its block, step 0; the images stay bitwise."""
    plain = run(fp16_sd, steps=1)
    dbg = DiffusionModelDebugger(fp16_sd, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    blocks = [fp16_sd.unet.get_submodule(name) for name in UNET_BLOCKS]
    hooked = []  # as the call's UNet begins (not a replay's): whether its blocks are hooked
    calls = [0]
    seen = fp16_sd.unet.register_forward_pre_hook(
        lambda m, a: hooked.append({len(b._forward_hooks) for b in blocks}) if len(hooked) < calls[0] else None
    )
    module = "mid_block.resnets.0"
    grown = fp16_sd.unet.get_submodule(module).register_forward_hook(
        lambda m, a, out: out * (0.6 * 65504 / out.abs().max()) if calls[0] >= 6 else None
    )
    try:
        for call in range(1, 10):
            calls[0] = call
            with dbg:
                images = run(fp16_sd, steps=1)
            if call < 6:
                assert (images == plain).all()
    finally:
        seen.remove()
        grown.remove()
    assert hooked == [{1}, {1}, {0}, {0}, {1}, {0}, {0}, {0}, {1}]
    risks = [a for a in dbg.report().anomalies if a.kind == "overflow_risk" and a.component == "unet"]
    assert [(a.module, a.step, a.details.get("run")) for a in risks] == [(module, 0, 9)], risks
    dbg.close()


def test_the_unet_sentinel_hooks_are_out_at_the_steps_it_does_not_read_and_none_stays_after_detach(fp16_sd, tmp_path):
    """At a step the UNet's sentinel does not read, its hooks are out of the blocks' hook dicts (torch's
    fast path: nothing runs, nothing is held); the next run of the same attach begins read, after a run's
    last step its hooks stay as they were (no step follows to read), and a detach at a step not read
    leaves no hook; the image stays bitwise the same."""
    plain = run(fp16_sd, steps=6)
    dbg = warmed(fp16_sd, tmp_path)
    blocks = [fp16_sd.unet.get_submodule(name) for name in UNET_BLOCKS]
    seen = []  # as each step ends: whether the next step's blocks are hooked

    def callback(pipe, step, timestep, kwargs):
        seen.append([len(block._forward_hooks) for block in blocks])
        return kwargs

    with dbg:
        images = run(fp16_sd, steps=6, callback_on_step_end=callback)
        run(fp16_sd, steps=3, callback_on_step_end=callback)  # a second run of the same attach
    reads = [1, 0, 0, 1, 0, 0] + [1, 0, 0]  # steps 1 to 5 of the first run, then its last's; 1, 2 of the second
    assert seen == [[read] * len(blocks) for read in reads]
    assert (images == plain).all()
    assert all(not module._forward_hooks for module in fp16_sd.unet.modules())  # detached at a step not read
    with dbg:  # the next attach reads its first steps
        run(fp16_sd, steps=2, callback_on_step_end=callback)
    assert seen[-2:] == [[1] * len(blocks)] * 2  # its step 1 read (and after it, its last, as it was)
    assert not [a for a in dbg.report().anomalies if a.kind in ("nonfinite", "overflow_risk")]
    dbg.close()


def test_a_cfg_calls_two_text_encoder_calls_are_read_in_one_flush_before_the_denoiser_runs(fp16_sd, tmp_path):
    """Issue 45: on a GPU every host read is a sync. A CFG call encodes the prompt and the negative
    prompt, two text encoder calls: they are read together (one fused abs-max flush and one host
    read for both), before the UNet's first call. A reused debugger's 1-step call flushes 3 times
    (the text encoder's two calls, the step, the VAE decode: 4 while each encoder call was read on
    its own) and adds 2 blocking host reads (4, then 3 while ``set_timesteps`` read its first
    timestep, which now rides in the first step's copy) and the step's deferred copy."""
    from diffusion_debug.probes import fused
    from diffusion_debug.stats.host import count_host_transfers

    dbg = warmed(fp16_sd, tmp_path)
    flushes, at_unet = [], []
    flush = fused.HeldAbsmax.flush

    def counted(self):
        if self.tensors:
            flushes.append(len(self.tensors))
        return flush(self)

    fused.HeldAbsmax.flush = counted
    hook = fp16_sd.unet.register_forward_pre_hook(lambda module, args: at_unet.append(len(flushes)))
    try:
        with count_host_transfers() as plain:
            run(fp16_sd, steps=1)
        flushes.clear(), at_unet.clear()
        with dbg, count_host_transfers() as watched:
            run(fp16_sd, steps=1)
    finally:
        fused.HeldAbsmax.flush = flush
        hook.remove()
    # its watched modules: its last layer, then its final_layer_norm, whose output is the call's output (CLIP's
    # last_hidden_state), so the output check finds it held (its slot) and holds no tensor of its own
    text = [name for name, _ in dbg._steps.probes._kept["text_encoder"][0]]
    assert text[-1] == clip_name("final_layer_norm") and len(text) == 2, text
    assert at_unet == [1] and flushes[0] == 2 * len(text), (
        flushes
    )  # both calls' modules (output: the last's), then UNet
    assert len(flushes) == 3, flushes
    # blocking: the text encoder's calls, the VAE decode; the step's copy is deferred (with the schedule's values)
    assert (len(watched.blocking) - len(plain.blocking), len(watched.deferred)) == (2, 1), (watched.calls, plain.calls)
    dbg.close()


def test_a_nan_made_only_by_the_negative_prompts_encoding_is_named_on_that_call(fp16_sd, tmp_path):
    """The two encoder calls read together are still checked each on its own kept call: a NaN made
    only while the negative prompt is encoded is named at its module, at no step, by a replay of
    that call (a replay of the prompt's call would make none)."""
    module = suffixed(fp16_sd.text_encoder, clip_name("encoder.layers.1.mlp.fc1"))
    prompt_ids, negative = [], [False]

    def which(encoder, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        prompt_ids[:] = prompt_ids or [ids]
        negative[0] = not torch.equal(ids, prompt_ids[0])

    def nan_for_the_negative_prompt(mod, args, output):
        return torch.full_like(output, float("nan")) if negative[0] else None

    dbg = warmed(fp16_sd, tmp_path, level="basic")
    hooks = [
        fp16_sd.text_encoder.register_forward_pre_hook(which, with_kwargs=True),
        fp16_sd.text_encoder.get_submodule(module).register_forward_hook(nan_for_the_negative_prompt),
    ]
    try:
        with dbg:
            run(fp16_sd)
    finally:
        for hook in hooks:
            hook.remove()
    errors = [a for a in later_run(dbg, "nonfinite") if a.severity == "error"]
    assert [(a.component, a.module, a.step) for a in errors] == [("text_encoder", module, None)]
    assert errors[0].details["localized_by"] == REPLAYED
    assert [e["component"] for e in dbg.record.events if e["type"] == "replay"] == ["text_encoder"]
    dbg.close()


def test_an_encoder_output_the_pipeline_changes_in_place_before_the_read_is_read_as_changed(fp16_sd, tmp_path):
    """An encoder call is read after the pipeline has had its output (Cosmos zeroes the padding of
    its T5 output in place): an output changed since its call is measured as it is then, so a NaN
    its last module made (no sentinel block sees it) that the change left in place is still named
    at that module, at no step, before the denoiser runs."""
    name = suffixed(fp16_sd.text_encoder, clip_name("final_layer_norm"))

    def nan_at_the_first_token(mod, args, output):
        output = output.clone()
        output[:, 0] = float("nan")
        return output

    def zero_the_last_token(mod, args, kwargs, output):  # as Cosmos does after the call, in place
        with torch.no_grad():
            output[0][:, -1] = 0

    dbg = warmed(fp16_sd, tmp_path, level="basic")
    planted = fp16_sd.text_encoder.get_submodule(name).register_forward_hook(nan_at_the_first_token)
    try:
        with dbg:  # registered after the debugger's own hook: it runs after the call was held
            zeroing = fp16_sd.text_encoder.register_forward_hook(zero_the_last_token, with_kwargs=True)
            try:
                run(fp16_sd, steps=1)
            finally:
                zeroing.remove()
    finally:
        planted.remove()
    errors = [a for a in later_run(dbg, "nonfinite") if a.severity == "error"]
    assert [(a.component, a.module, a.step) for a in errors] == [("text_encoder", name, None)]
    assert errors[0].details["localized_by"] == REPLAYED
    dbg.close()


# -- bf16: no overflow to watch (its largest value is float32's); checked at the output, then replayed --


@pytest.fixture(scope="module")
def bf16_sd():
    return tiny_pipeline("sd", dtype=torch.bfloat16)


def test_bf16_components_have_no_probe_on_any_call_of_a_reused_debugger(bf16_sd, tmp_path):
    """What an fp16 component keeps on a later call (its block sentinel) looks for overflow, which
    bf16 cannot reach: every bf16 component is checked at its output from the first call on."""
    dbg = DiffusionModelDebugger(bf16_sd, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    for _ in range(2):
        with dbg:
            assert dbg._steps.probes.levels == {"unet": "output", "text_encoder": "output", "vae": "output"}
            assert dbg._steps.probes.probes == {}
            run(bf16_sd, steps=1)
    dbg.close()


@pytest.mark.parametrize(
    "component, module, from_call, step",
    [
        ("vae", "decoder.up_blocks.1.resnets.0.conv2", 0, None),
        ("unet", "up_blocks.1.resnets.0.conv2", 1, 1),
        ("text_encoder", clip_name("encoder.layers.1.mlp.fc1"), 0, None),
    ],
)
def test_a_bf16_nonfinite_after_the_first_call_is_named_at_its_module_by_the_replay(
    bf16_sd, tmp_path, component, module, from_call, step
):
    dbg = warmed(bf16_sd, tmp_path, level="basic")
    target = getattr(bf16_sd, component)
    module = suffixed(target, module)
    with plant(target.get_submodule(module), from_call, lambda out: torch.full_like(out, float("nan"))), dbg:
        run(bf16_sd)
    errors = [a for a in later_run(dbg, "nonfinite") if a.severity == "error"]
    assert [(a.component, a.module, a.step) for a in errors] == [(component, module, step)]
    assert errors[0].details["localized_by"] == "output check -> replay with full probes"
    assert [e["component"] for e in dbg.record.events if e["type"] == "replay"] == [component]
    dbg.close()


def test_a_nan_weight_in_a_bf16_vae_decoder_module_on_a_later_call_is_named_at_it(bf16_sd, tmp_path):
    """A weight that goes bad between two calls of a reused debugger (a NaN written into the VAE
    decoder's convolution, as a broken fine-tune or a bad load leaves it): the decode's output is
    NaN, and the replay of the kept call names the convolution."""
    name = "decoder.up_blocks.1.resnets.0.conv1"
    conv = bf16_sd.vae.get_submodule(name)
    dbg = warmed(bf16_sd, tmp_path)
    saved = conv.weight.detach().clone()
    try:
        with torch.no_grad():
            conv.weight[0, 0, 0, 0] = float("nan")
        with dbg:
            images = run(bf16_sd, steps=1)
    finally:
        with torch.no_grad():
            conv.weight.copy_(saved)
    assert torch.from_numpy(images).isnan().any()
    (error,) = [a for a in later_run(dbg, "nonfinite") if a.severity == "error"]
    assert (error.component, error.module, error.step) == ("vae", name, None)
    assert error.details["localized_by"] == "output check -> replay with full probes"
    # a bf16 VAE is told its range is float32's, not fp16's advice nor "run the VAE in float32", which holds no more
    assert (
        error.message == f"vae.{name} produced NaN/Inf from finite inputs ({BF16_VAE}: check its weights and inputs)."
    )
    dbg.close()


def test_a_later_clean_bf16_call_is_quiet_and_bitwise_equal(bf16_sd, tmp_path):
    plain = run(bf16_sd, steps=2)
    dbg = warmed(bf16_sd, tmp_path)
    with dbg:
        watched = run(bf16_sd, steps=2)
    assert (plain == watched).all()
    assert not [a for a in dbg.report().anomalies if a.kind in ("nonfinite", "overflow_risk")]
    assert not [e for e in dbg.record.events if e["type"] == "replay"]
    dbg.close()


@pytest.mark.skipif(not HAS_LAYERWISE_CASTING, reason="this diffusers has no layerwise casting")
def test_fp8_stored_weights_computing_in_bf16_take_the_bf16_path_and_a_later_nan_is_named(tmp_path):
    """diffusers' layerwise casting: weights stored in fp8, each layer computing in bf16. The
    activations are bf16, so nothing can overflow: no probe (a sentinel there would run a hook a
    block to read bf16 outputs its fp8/fp16 filter skips), and a NaN made on a later call is named
    at its module by the replay."""
    pipe = tiny_pipeline("sd", dtype=torch.bfloat16)
    for component in (pipe.unet, pipe.vae):
        component.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        assert dbg._steps.probes.levels == {"unet": "output", "text_encoder": "output", "vae": "output"}
        run(pipe, steps=1)
    name = "decoder.up_blocks.1.resnets.0.conv2"
    with plant(pipe.vae.get_submodule(name), 0, lambda out: torch.full_like(out, float("nan"))), dbg:
        assert dbg._steps.probes.probes == {}
        run(pipe, steps=1)
    (error,) = [a for a in later_run(dbg, "nonfinite") if a.severity == "error"]
    assert (error.component, error.module) == ("vae", name)
    assert error.details["localized_by"] == "output check -> replay with full probes"
    # it computes in bf16, advised as a bf16 VAE (before: vae_dtype float8_e4m3fn, its storage, and fp16's advice)
    assert (error.details["vae_dtype"], error.message) == (
        "bfloat16",
        f"vae.{name} produced NaN/Inf from finite inputs ({BF16_VAE}: check its weights and inputs).",
    )
    dbg.close()


def test_a_debugger_made_per_call_reads_a_component_fully_once_per_pipeline(tmp_path):
    """The first full read belongs to the pipeline's components (their trees and dtypes), not to
    one debugger: ``with DiffusionModelDebugger(pipe):`` around each call reads as a reused debugger
    does; a replaced component is read fully again."""
    pipe = tiny_pipeline("sd", dtype=torch.float16)

    def levels_of_a_new_debugger(**call):
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
        with dbg:
            found = dict(dbg._steps.probes.levels)
            run(pipe, steps=1, **call)
        dbg.close()
        return found

    assert levels_of_a_new_debugger() == {"unet": "sentinel", "text_encoder": "full", "vae": "full"}
    assert levels_of_a_new_debugger() == {"unet": "sentinel", "text_encoder": "sentinel", "vae": "sentinel"}
    pipe.vae = tiny_pipeline("sd", dtype=torch.float16, seed=1).vae
    assert levels_of_a_new_debugger() == {"unet": "sentinel", "text_encoder": "sentinel", "vae": "full"}
    other = tiny_pipeline("sd", dtype=torch.float16)  # another pipeline: its own first reads
    with DiffusionModelDebugger(other, DebugConfig(output_dir=str(tmp_path), log_level="error")) as dbg:
        assert dbg._steps.probes.levels["vae"] == "full"


def test_a_reused_debugger_keeps_its_probes_across_calls_and_they_still_name_each_fault(fp16_sd, tmp_path):
    """A reused debugger attaches at every call: each component's probe (and its hooks) is kept
    from one attach to the next while the tree and level are the same, emptied at detach. Faults
    planted on the fifth and sixth calls are named at their module by the kept probes, and the
    call after them is quiet."""
    dbg = DiffusionModelDebugger(fp16_sd, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    # the first reads the VAE and text encoder fully, the second their sentinels, the third the text
    # encoder's, the fourth none (components.sentinel_pace: the UNet's step 0 reads run 5, the VAE run 6)
    for _ in range(4):
        with dbg:
            run(fp16_sd, steps=1)
    assert dbg._steps.probes.probes == {}  # dropped at detach ...
    kept = {name: entry[2] for name, entry in dbg._steps.probes._kept.items()}
    assert sorted(kept) == ["text_encoder", "unet", "vae"]  # ... and kept for the next attach
    with plant(fp16_sd.unet.get_submodule("up_blocks.1.resnets.0.conv2"), 1), dbg:
        assert all(dbg._steps.probes.probes[c] is probe for c, probe in kept.items())
        run(fp16_sd, steps=2)
    errors = [a for a in dbg.report().anomalies if a.kind == "nonfinite" and a.severity == "error"]
    assert [(a.component, a.module, a.step, a.details["run"]) for a in errors] == [
        ("unet", "up_blocks.1.resnets.0.conv2", 1, 5)
    ]
    name = "decoder.up_blocks.0.upsamplers.0.conv"
    with plant_overflow(fp16_sd.vae.get_submodule(name), fraction=0.61), dbg:
        run(fp16_sd, steps=2)
    (risk,) = [a for a in dbg.report().anomalies if a.kind == "overflow_risk" and a.details.get("run") == 6]
    assert (risk.component, risk.module, risk.details["localized_by"]) == ("vae", name, REPLAYED)
    with dbg:
        run(fp16_sd, steps=2)
    assert not [a for a in dbg.report().anomalies if a.details.get("run") == 7]
    assert all(dbg._steps.probes._kept[c][2] is probe for c, probe in kept.items())
    dbg.close()


@pytest.mark.skipif(not SDPA_KEEPS_NAN, reason="this torch's CPU attention drops a NaN query: the run is finite")
def test_a_reused_debugger_follows_a_lora_adapter_and_a_swapped_block_added_between_calls(tmp_path):
    """The probes kept across attaches are kept only while the tree is the same: a LoRA adapter
    added between two calls (peft puts new modules in) and a block swapped for a copy each give the
    UNet a new probe at the next attach, and a fault planted in the new modules is named there, at
    its step, not missed by the probe of the old tree."""
    peft = pytest.importorskip("peft")
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    dbg = warmed(pipe, tmp_path)
    with dbg:
        run(pipe, steps=1)
    before = dbg._steps.probes._kept["unet"][2]
    pipe.unet.add_adapter(peft.LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"]))
    lora = "up_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.default"
    with plant(pipe.unet.get_submodule(lora), 1), dbg:
        assert dbg._steps.probes.probes["unet"] is not before
        run(pipe, steps=2)
    errors = [a for a in dbg.report().anomalies if a.kind == "nonfinite" and a.severity == "error"]
    assert [(a.component, a.module, a.step, a.details["run"]) for a in errors] == [("unet", lora, 1, 3)]
    swapped = copy.deepcopy(pipe.unet.up_blocks[1])
    pipe.unet.up_blocks[1] = swapped
    with plant_overflow(swapped, fraction=0.7), dbg:
        run(pipe, steps=1)
    risks = [a for a in dbg.report().anomalies if a.kind == "overflow_risk" and a.details.get("run") == 4]
    assert [(a.component, a.module, a.step) for a in risks] == [("unet", "up_blocks.1", 0)]
    dbg.close()


def test_a_reused_debugger_follows_its_pipeline_cast_between_calls(tmp_path):
    """``.to(dtype)`` casts in place (the same parameter objects: the tree key is unchanged), so the
    kept probes and call-site plans stay; the level follows the dtype. An fp32 pipeline cast to fp16
    after two calls has a near-overflow named at its block, and cast back, a NaN at its step."""
    pipe = tiny_pipeline("sd")
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    for _ in range(2):
        with dbg:
            run(pipe, steps=1, output_type="latent")
    pipe.to(torch.float16)
    with plant_overflow(pipe.unet.get_submodule("up_blocks.1"), fraction=0.7), dbg:
        assert dbg._steps.probes.levels["unet"] == "sentinel"
        run(pipe, steps=1, output_type="latent")
    risks = [a for a in dbg.report().anomalies if a.kind == "overflow_risk"]
    assert [(a.component, a.module, a.step, a.details["run"]) for a in risks] == [("unet", "up_blocks.1", 0, 3)]
    pipe.to(torch.float32)
    with plant(pipe.unet.get_submodule("up_blocks.1.resnets.0.conv2"), 1), dbg:
        run(pipe, steps=2, output_type="latent")
    errors = [a for a in dbg.report().anomalies if a.kind == "nonfinite" and a.severity == "error"]
    assert [(a.component, a.module, a.step, a.details["run"]) for a in errors] == [
        ("unet", "up_blocks.1.resnets.0.conv2", 1, 4)
    ]
    dbg.close()


def test_a_component_read_fully_once_is_not_read_fully_again_when_another_is_collected_under_a_detached_debugger(
    tmp_path,
):
    """A debugger made per call is a cycle: it may outlive its ``with`` until the garbage collector
    runs, detached, its pipeline's modules held weakly. A VAE replaced then is collected under it and
    takes its own entry of the pipeline's tree memo with it, not the text encoder's: the next debugger
    reads the unchanged text encoder by its sentinel. (The whole memo was emptied: a flaky second full
    read of the fp16 text encoder in CI, in the test above, where the garbage collector had not run.)"""
    pipe = tiny_pipeline("sd", dtype=torch.float16)
    config = DebugConfig(output_dir=str(tmp_path), log_level="error")
    with DiffusionModelDebugger(pipe, config) as earlier:  # kept below, as one not collected yet is
        assert earlier._steps.probes.levels == {"unet": "sentinel", "text_encoder": "full", "vae": "full"}
        run(pipe, steps=1)
    pipe.vae = tiny_pipeline("sd", dtype=torch.float16, seed=1).vae
    with DiffusionModelDebugger(pipe, config) as dbg:
        assert dbg._steps.probes.levels == {"unet": "sentinel", "text_encoder": "sentinel", "vae": "full"}
    earlier.close()


def test_the_unet_sentinel_s_pace_of_runs_is_each_debugger_s_and_an_inf_at_a_run_not_read_is_named(fp16_sd, tmp_path):
    """review16: a 1-step call whose step 0 the UNet's sentinel does not read (the debugger's 3rd)
    still has an Inf made inside a block named at its module, step 0, by the replay; a new debugger on
    the same pipeline reads its own first two runs, and the first one's count goes on as it was (its
    5th run read, its 6th not), with no finding at the clean runs."""
    blocks = [fp16_sd.unet.get_submodule(name) for name in UNET_BLOCKS]
    hooked, calls = [], [0]  # as the call's UNet begins (not a replay's): whether its blocks are hooked
    seen = fp16_sd.unet.register_forward_pre_hook(
        lambda m, a: hooked.append({len(b._forward_hooks) for b in blocks}) if len(hooked) < calls[0] else None
    )
    module = "up_blocks.1.resnets.0.conv2"
    planted = fp16_sd.unet.get_submodule(module).register_forward_hook(  # at the 3rd call (and its replay)
        lambda m, a, out: torch.full_like(out, float("inf")) if calls[0] == 3 else None
    )
    first = DiffusionModelDebugger(fp16_sd, DebugConfig(output_dir=str(tmp_path / "a"), log_level="error"))
    second = DiffusionModelDebugger(fp16_sd, DebugConfig(output_dir=str(tmp_path / "b"), log_level="error"))
    try:
        for dbg in [first] * 4 + [second] * 2 + [first] * 2:
            calls[0] += 1
            with dbg:
                run(fp16_sd, steps=1)
    finally:
        seen.remove()
        planted.remove()
    assert hooked == [{1}, {1}, {0}, {0}, {1}, {1}, {1}, {0}]
    errors = [a for a in first.report().anomalies if a.severity == "error"]
    assert errors and (errors[0].kind, errors[0].component, errors[0].module, errors[0].step) == (
        "nonfinite",
        "unet",
        module,
        0,
    ), errors
    assert errors[0].details.get("run") == 3, errors[0].details
    found = [a for dbg in (first, second) for a in dbg.report().anomalies if a.kind in ("nonfinite", "overflow_risk")]
    assert [a.details.get("run") for a in found] == [3] * len(found), found
    first.close()
    second.close()


@pytest.mark.parametrize(
    "value, steps",
    [
        (6e4, 1),  # conv_in is given them (the UNet's "own forward" before), the pipeline's 1/scaling_factor overflows
        (4e4, 2),  # over the warning, below what the UNet's blocks show: DDIMScheduler.step's x0 overflows
    ],
)
def test_near_max_latents_the_user_passed_are_the_input_not_the_unet_or_the_scheduler(fp16_sd, tmp_path, value, steps):
    """``latents=`` past half of float16's max (the overflow warning's threshold) are the user's values: the
    run's error names the input, its near-overflow too, and what overflows later (scheduler.step, the
    pipeline's 1/scaling_factor, the VAE) points there instead of standing as a cause."""
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1)).half()
    latents = latents * (value / latents.abs().amax().float())
    with DiffusionModelDebugger(fp16_sd, DebugConfig(output_dir=str(tmp_path), log_level="error")) as dbg:
        run(fp16_sd, steps=steps, latents=latents)
    report = dbg.report()
    (error,) = [a for a in report.anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module) == ("nonfinite", "input", "latents")
    assert error.details["near_max"] == pytest.approx(value / 65504, abs=1e-3)
    assert error.message.startswith(f"The pipeline input latents= was at {value / 65504:.0%} of its dtype's maximum")
    assert report.headline is error
    later = [a for a in report.anomalies if a.kind == "nonfinite" and a is not error]
    assert later and all(a.details["origin"] == error.where() for a in later)
    risks = [(a.component, a.module) for a in report.anomalies if a.kind == "overflow_risk"]
    assert risks == ([("input", "latents")] if steps == 1 else [])
    dbg.close()


def test_a_block_near_max_only_by_the_users_latents_is_replayed_again_for_a_later_runs_own_overflow(fp16_sd, tmp_path):
    """Where the user's near-max latents took a block near the max is not kept as where the UNet's own
    forward builds them: a later run's overflow made inside that block is named at its module."""
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1)).half()
    latents = latents * (6e4 / latents.abs().amax().float())
    dbg = DiffusionModelDebugger(fp16_sd, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        run(fp16_sd, steps=1, latents=latents)
    name = "down_blocks.0.downsamplers.0.conv"
    with plant_overflow(fp16_sd.unet.get_submodule(name), fraction=0.61), dbg:
        run(fp16_sd, steps=1)
    risks = [(a.component, a.module) for a in later_run(dbg, "overflow_risk")]
    assert risks == [("unet", name)]
    dbg.close()


def test_a_nan_a_unet_module_makes_under_large_but_finite_user_latents_is_named_at_the_module(fp16_sd, tmp_path):
    """Latents at 0.6x float16's max (over the warning's threshold, which then names the input) do not take
    the blame for a NaN a UNet module makes itself: the error is that module's, at its step."""
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1)).half()
    latents = latents * (0.6 * 65504 / latents.abs().amax().float())
    dbg = warmed(fp16_sd, tmp_path)
    module = "up_blocks.1.resnets.0.conv2"
    nan = lambda out: torch.full_like(out, float("nan"))  # noqa: E731
    with plant(fp16_sd.unet.get_submodule(module), 0, nan), dbg:  # step 0: before DDIM's x0 overflows them
        run(fp16_sd, steps=2, latents=latents)
    errors = [a for a in later_run(dbg, "nonfinite") if a.severity == "error"]
    assert [(a.component, a.module, a.step) for a in errors] == [("unet", module, 0)], errors
    assert dbg.report().headline is errors[0]
    dbg.close()


def test_only_half_precision_user_inputs_near_the_max_are_named_and_no_other_input_raises():
    """Non-tensors, integers, float32, empty, NaN-holding and float8 inputs are never near-max (float8's CPU
    abs-max is not implemented: the check raised), float16 and bfloat16 ones are, at their exact share."""
    from diffusion_debug.diffusion.origins import near_max_names

    values = {
        "steps": 3,
        "none": None,
        "ids": torch.full((2,), 30000, dtype=torch.int16),
        "fp32": torch.full((2,), 6e4),
        "empty": torch.empty(0, dtype=torch.float16),
        "nan": torch.tensor([float("nan"), 6e4], dtype=torch.float16),
        "listed": [torch.full((1,), 6e4, dtype=torch.float16)],
        "fp8": torch.full((2,), 400.0).to(torch.float8_e4m3fn),
        "latents": torch.tensor([-32752.0, 1.0], dtype=torch.float16),
        "embeds": torch.full((2,), 2.0**127, dtype=torch.bfloat16),
    }
    found = near_max_names(values, 0.5)
    assert found == {"latents": 32752 / 65504, "embeds": 2.0**127 / torch.finfo(torch.bfloat16).max}


def test_an_inf_an_fp16_t5_block_clamped_below_the_max_after_its_near_max_was_localised_is_an_error(tmp_path):
    """A plain float16 T5 (no autocast) whose embeddings and ``wo`` run near float16's max: runs 1-2 localise the
    near-max at ``encoder.block.0.layer.1`` (kept for the debugger's life). Then ``wo`` makes an Inf (2x the max):
    T5 clamps its stream to ``finfo.max - 1000`` (64504, not float16's 65504), so the block's output was not read as
    at the max, its replay not run again, the Inf swallowed (an overflow warning). Within 1000 of the max is at it:
    each such run has the one error at ``wo``, the clip said."""
    from diffusion_debug.testing.flux import FLUX_CALL

    fp16_max = torch.finfo(torch.float16).max
    wo_name = helpers.T5_WO
    pipe = tiny_pipeline("flux").to(torch.float16)
    t5 = pipe.text_encoder_2
    args = FLUX_CALL[0]()
    args.pop("output_type", None)

    def call():
        pipe(**args, num_inference_steps=1, generator=torch.Generator().manual_seed(0), output_type="latent")

    wo_at = helpers.t5_near_max(t5, call)
    layer = t5.get_submodule("encoder.block.0.layer.1")
    reached = []  # the layer's output in runs 1-2, as a share of the max
    hook = layer.register_forward_hook(lambda _m, _a, out: reached.append(out.abs().max().item() / fp16_max))
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    try:
        for run_number, scale in enumerate((0.3, 0.3, 2.0, 2.0), 1):
            wo_at(scale)
            with dbg:
                call()
            if run_number == 2:
                hook.remove()
        runs = {
            number: [
                (a.kind, a.severity, a.module)
                for a in dbg.report().anomalies
                if a.component == "text_encoder_2" and a.details.get("run") == number
            ]
            for number in (1, 2, 3, 4)
        }
        errors = [a for a in dbg.report().anomalies if a.kind == "nonfinite"]
    finally:
        hook.remove()
        dbg.close()
    # transformers 5's T5 reaches 0.67 of the max there; 4.x's (the floor) 0.44: nothing near it to localise first
    near = [("overflow_risk", "warning", "encoder.block.0.layer.1")] if min(reached) >= 0.5 else []
    assert runs[1] == runs[2] == near
    assert runs[3] == runs[4] == [("nonfinite", "error", wo_name)]
    assert [a.details["clipped_in"] for a in errors] == ["encoder.block.0"] * 2
    clamped = "text_encoder_2.encoder.block.0 clipped it to 64512, below float16's largest value (65504)"  # not 65504
    assert [clamped in a.message for a in errors] == [True, True]
