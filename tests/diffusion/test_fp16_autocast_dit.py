"""Float32 transformer denoisers under ``torch.autocast(..., dtype=torch.float16)`` (PixArt, SD3, Flux users run them
so; CPU autocast here): each block's attention and FeedForward projections compute in float16, and the block scales
each by its adaLN gate before adding it to its stream (PixArt's float32; SD3's float16, not clipped). The sentinel
read the block lists' ends, never a projection against float16's max: a projection at 90% of it was never warned. It
reads the projections too (a float32 transformer under float16 autocast only), paced by step (0, 1, every 8th): a
planted near-max is warned at its module and step, a clean run stays quiet, and the images are bitwise the unwatched
ones.

Each fault is planted by scaling one projection's weights so that its float16 output under autocast reaches 90% of
65504, in a block that is not its list's last (the sentinel's own block)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from autocast_helpers import autocast

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import tiny_pipeline
from diffusion_debug.testing.flux import deeper
from diffusion_debug.testing.zoo import ZOO_CALLS

FP16_MAX = torch.finfo(torch.float16).max

# kind -> (layers, a block's attention projection, its FeedForward's last Linear, the planted block)
PLANTED = {
    "pixart": (3, "transformer_blocks.1.attn1.to_out.0", "transformer_blocks.1.ff.net.2", "transformer_blocks.1"),
    "sd3": (3, "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.ff.net.2", "transformer_blocks.0"),
}


def call_kwargs(kind: str) -> dict:
    return ZOO_CALLS["pixart"][0]() if kind == "pixart" else {"prompt": "a cat"}


def run(pipe, kind: str, steps: int = 3, output_type: str = "np"):
    with autocast():
        return pipe(
            **call_kwargs(kind),
            num_inference_steps=steps,
            generator=torch.Generator().manual_seed(0),
            output_type=output_type,
        ).images


@pytest.fixture
def dits():
    """Float32 tiny PixArt and SD3 with three blocks (a block list whose last block is not the planted one), fresh
    each test: SD3's streams are float16 under autocast, but its blocks do not clip them (told at its first watched
    call: ``component_probes._StreamDtype``), so its projections are read as PixArt's, paced by step."""
    return {kind: deeper(tiny_pipeline(kind), num_layers=PLANTED[kind][0]) for kind in PLANTED}


def peaks_by_call(pipe, kind, modules, steps):
    """Per transformer call (one a step: CFG's two halves go in one batch), the abs-max of each of ``modules``'
    outputs (a tuple's first tensor) in an unwatched autocast run."""
    transformer = pipe.transformer
    peaks: dict[str, list[float]] = {name: [] for name in modules}

    def hook(name):
        def read(_module, _args, output):
            tensor = output[0] if isinstance(output, tuple) else output
            peaks[name].append(tensor.abs().max().item())

        return read

    handles = [transformer.get_submodule(name).register_forward_hook(hook(name)) for name in modules]
    try:
        run(pipe, kind, steps, output_type="latent")
    finally:
        for handle in handles:
            handle.remove()
    return peaks


def scaled_to(pipe, kind, name, fraction, steps):
    """``name`` of the transformer, its weight and bias scaled so that its float16 output under autocast peaks at
    ``fraction`` of 65504 over a ``steps``-step run; returns how to put them back."""
    module = pipe.transformer.get_submodule(name)
    by = fraction * FP16_MAX / max(peaks_by_call(pipe, kind, [name], steps)[name])
    saved = [p.detach().clone() for p in (module.weight, module.bias)]
    with torch.no_grad():
        module.weight.mul_(by)
        module.bias.mul_(by)

    def restore():
        with torch.no_grad():
            module.weight.copy_(saved[0])
            module.bias.copy_(saved[1])

    return restore


def found(dbg):
    """Every anomaly but ``latent_divergence``: the tiny random PixArt's latents diverge under autocast at step 0
    (DPM-Solver on an untrained transformer; not what these tests ask), as the tiny SD's static scheduler warning is
    left out elsewhere."""
    anomalies = dbg.report().anomalies
    return [(a.kind, a.severity, a.component, a.module, a.step) for a in anomalies if a.kind != "latent_divergence"]


@pytest.mark.parametrize("kind", list(PLANTED))
@pytest.mark.parametrize("which", ["attention", "feed_forward"])
def test_a_float32_dits_projection_near_float16s_max_under_autocast_is_warned_at_its_module_and_step(
    dits, kind, which, tmp_path
):
    """The planted projection's float16 output peaks at 90% of 65504 under autocast; the gate brings its block's
    float32 output far below it (so no reading of the block would see it). Warned at that Linear, at the first step
    its output passes the warning's half of the max (later steps fold into it), as the sentinel read it; nothing
    else is warned."""
    pipe = dits[kind]
    layers, attention, feed_forward, block = PLANTED[kind]
    name = attention if which == "attention" else feed_forward
    restore = scaled_to(pipe, kind, name, 0.9, steps=3)
    try:
        peaks = peaks_by_call(pipe, kind, [name, block], steps=3)
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
        with dbg:
            run(pipe, kind, steps=3, output_type="latent")
        dbg.close()
    finally:
        restore()
    first = next(step for step, peak in enumerate(peaks[name]) if peak >= 0.5 * FP16_MAX)
    # (planted against a clean run's peak; the block's new output moves the later steps' inputs a little)
    assert 0.8 * FP16_MAX < max(peaks[name]) < FP16_MAX, peaks[name]
    assert max(peaks[block]) < 0.5 * FP16_MAX, peaks[block]  # the gated block output stays small
    # (the latents such weights make may diverge: latent_divergence, not asked here)
    risks = [a for a in dbg.report().anomalies if a.kind == "overflow_risk"]
    assert [(a.kind, a.severity, a.component, a.module, a.step) for a in risks] == [
        ("overflow_risk", "warning", "transformer", name, first)
    ]
    (risk,) = risks
    assert risk.details["localized_by"] == "sentinel"
    assert (risk.details["dtype"], risk.details["weights_dtype"]) == ("float16", "float32")
    assert risk.details["absmax"] == pytest.approx(peaks[name][first], rel=1e-3)
    assert risk.message == (
        f"transformer.{name} output reached {risk.details['dtype_max_fraction']:.0%} of the float16 maximum "
        f"(|x|={risk.details['absmax']:.4g}); it ran under float16 autocast (its weights are float32): autocast to "
        f"bfloat16 instead (torch.autocast(..., dtype=torch.bfloat16)) or run transformer.{name} outside autocast."
    )


@pytest.mark.parametrize("kind", list(PLANTED))
def test_clean_float32_dits_under_fp16_autocast_stay_quiet_and_bitwise_equal_with_their_projections_read(
    dits, kind, tmp_path
):
    """Clean runs under autocast: the transformer's sentinel holds each block's projections (two attentions and a
    FeedForward a PixArt block; an attention's two and two FeedForwards an SD3 block, its last, which keeps no text
    stream, one of each: its float16 streams are not clipped), nothing is warned, and each image is bitwise the
    unwatched one. Out of autocast the float32 transformer is not probed (its output checked at every step)."""
    pipe = dits[kind]
    plain = run(pipe, kind)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    watched = []
    try:
        for _ in range(2):
            with dbg:
                watched.append(run(pipe, kind))
                modules = list(dbg._steps.probes.probes["transformer"].module_names)
        with dbg:
            level = dbg._steps.probes.levels["transformer"]
    finally:
        dbg.close()
    assert [np.array_equal(image, plain) for image in watched] == [True, True]
    assert found(dbg) == []
    assert level == "output"
    projections = [m for m in modules if m.endswith(("to_out.0", "to_add_out", "ff.net.2", "ff_context.net.2"))]
    if kind == "pixart":
        expected = [f"transformer_blocks.{i}.{m}" for i in range(3) for m in ("attn1.to_out.0", "attn2.to_out.0")]
        expected = sorted(expected + [f"transformer_blocks.{i}.ff.net.2" for i in range(3)], key=_block_order)
    else:  # its float16 streams not clipped (told at its first watched call): read at the 2nd attach too
        both = ("attn.to_out.0", "attn.to_add_out", "ff.net.2", "ff_context.net.2")
        expected = [f"transformer_blocks.{i}.{m}" for i in range(2) for m in both]
        expected += ["transformer_blocks.2.attn.to_out.0", "transformer_blocks.2.ff.net.2"]
    assert projections == expected


def _block_order(name: str) -> tuple[int, int]:
    order = ("attn1.to_out.0", "attn2.to_out.0", "ff.net.2")
    _, index, rest = name.split(".", 2)
    return int(index), order.index(rest)


def test_flux_float16_streams_under_autocast_read_every_step_an_inf_made_at_one_step_is_named_there(tmp_path):
    """Flux under float16 autocast with float32 weights: its x_embedder and gates run in float16, so its block streams
    are float16, which its blocks clip to +-65504 (an Inf a projection makes turns finite before any output). Paced
    (steps 0, 1, every 8th) an Inf made only at step 2 went unread: nothing reported. Its sentinel reads every step."""
    from diffusion_debug.testing.flux import FLUX_CALL

    pipe = deeper(tiny_pipeline("flux"), num_layers=3, num_single_layers=3)
    kw = {k: v for k, v in FLUX_CALL[0]().items() if k not in ("output_type", "num_inference_steps", "generator")}
    timesteps: list[float] = []  # each step's, in order; a replay of a step's call has its step's (and its Inf)
    now = [0.0]
    target = "transformer_blocks.0.ff_context.net.2"

    def count(module, args, kwargs):
        now[0] = float(kwargs["timestep"].flatten()[0])
        if now[0] not in timesteps:
            timesteps.append(now[0])

    def inf_at_step_2(module, args, output):
        if timesteps.index(now[0]) == 2:  # the transformer's call at step 2 (or its replay)
            output = output.clone()
            output[(0,) * output.dim()] = float("inf")
            return output

    pipe.transformer.register_forward_pre_hook(count, with_kwargs=True)
    pipe.transformer.get_submodule(target).register_forward_hook(inf_at_step_2)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg, autocast():
        out = pipe(
            **kw, num_inference_steps=6, generator=torch.Generator().manual_seed(0), output_type="latent"
        ).images
    dbg.close()
    assert len(timesteps) == 6
    assert bool(torch.isfinite(out).all())  # clipped: the step's output never showed it
    got = [(a.kind, a.module, a.step) for a in dbg.report().anomalies if a.kind != "latent_divergence"]
    assert got[:1] == [("nonfinite", target, 2)], got


def test_sd3s_projection_near_float16s_max_is_warned_at_later_calls_and_attaches_not_only_the_first(dits, tmp_path):
    """SD3's streams are float16 under autocast, but its blocks do not clip them (Flux's do): an Inf a projection
    makes at a step not read reaches the step's output, so its projections are paced as PixArt's, at every call.
    Each debugger's first call is clean (the streams' dtype told there), then the planted projection is warned at
    that debugger's next call, and at a new debugger's first: the warning comes at whatever call the near-max
    does (read at the first call only, a later one was never warned)."""
    pipe = dits["sd3"]
    _, name, _, _ = PLANTED["sd3"]
    risks = []
    for attach in range(2):
        dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path / str(attach)), log_level="error"))
        with dbg:
            run(pipe, "sd3", output_type="latent")
        restore = scaled_to(pipe, "sd3", name, 0.9, steps=3)
        try:
            peaks = peaks_by_call(pipe, "sd3", [name], steps=3)
            with dbg:
                run(pipe, "sd3", output_type="latent")
        finally:
            restore()
            dbg.close()
        first = next(step for step, peak in enumerate(peaks[name]) if peak >= 0.5 * FP16_MAX)
        found_risks = [a for a in dbg.report().anomalies if a.kind == "overflow_risk"]
        risks.append([(a.component, a.module, a.step) for a in found_risks] == [("transformer", name, first)])
    assert risks == [True, True]


def _flux_with_inf(step: int, call: int):
    """Tiny Flux (3 + 3 blocks) and a hook that makes ``transformer_blocks.0.ff_context.net.2`` output an Inf at step
    ``step`` of the ``call``-th pipeline call (from 0; a replay of that step's call too): its blocks clip it away.
    Returns the pipeline, its call's keywords, the module's name and the call counter to set."""
    from diffusion_debug.testing.flux import FLUX_CALL

    pipe = deeper(tiny_pipeline("flux"), num_layers=3, num_single_layers=3)
    kw = {k: v for k, v in FLUX_CALL[0]().items() if k not in ("output_type", "num_inference_steps", "generator")}
    target = "transformer_blocks.0.ff_context.net.2"
    state = {"call": 0, "timesteps": [], "now": 0.0}

    def count(module, args, kwargs):
        state["now"] = float(kwargs["timestep"].flatten()[0])
        if state["now"] not in state["timesteps"]:
            state["timesteps"].append(state["now"])

    def inf(module, args, output):
        if state["call"] == call and state["timesteps"].index(state["now"]) == step:
            output = output.clone()
            output[(0,) * output.dim()] = float("inf")
            return output

    pipe.transformer.register_forward_pre_hook(count, with_kwargs=True)
    pipe.transformer.get_submodule(target).register_forward_hook(inf)
    return pipe, kw, target, state


def test_flux_under_one_attach_around_a_serving_loop_has_an_inf_at_step_0_of_its_6th_call_named_there(tmp_path):
    """One ``with dbg`` around six Flux calls under float16 autocast: its clipped streams are told at the first call,
    and from then its sentinel reads every step of every call, as main's. Its step 0 was still paced by run (read at
    calls 1, 2, 5, 9...): an Inf made at step 0 of the 6th call, clipped by its blocks, was reported nowhere (main
    names it)."""
    pipe, kw, target, state = _flux_with_inf(step=0, call=5)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    outs = []
    with dbg, autocast():
        for call in range(6):
            state["call"], state["timesteps"] = call, []
            outs.append(
                pipe(
                    **kw, num_inference_steps=4, generator=torch.Generator().manual_seed(0), output_type="latent"
                ).images
            )
    dbg.close()
    assert bool(torch.isfinite(outs[5]).all())  # clipped: the step's output never showed it
    got = [(a.kind, a.module, a.step) for a in dbg.report().anomalies if a.kind == "nonfinite"]
    assert got[:1] == [("nonfinite", target, 0)], got


def test_a_block_not_known_to_keep_float16_streams_unclipped_is_read_every_step(tmp_path):
    """A float16 stream is paced only where its blocks are of a class known not to clip it (SD3's
    ``JointTransformerBlock``); any other is read as on main, every step. Here SD3's blocks become a subclass that
    clips with ``torch.finfo(torch.float16).max`` (as diffusers' NucleusMoE does; Sana clips in its processor): no
    ``65504`` in its source, so it was paced as an unclipped one, and an Inf its first block's FeedForward made at
    step 2 (not read: steps 0, 1, 8) was clipped away and reported nowhere. Named there now."""
    from diffusers.models.attention import JointTransformerBlock

    class FinfoClippedBlock(JointTransformerBlock):
        def forward(self, *args, **kwargs):
            encoder, hidden = super().forward(*args, **kwargs)
            big = torch.finfo(torch.float16).max
            clip = lambda t: t if t is None or t.dtype != torch.float16 else t.clip(-big, big)  # noqa: E731
            return clip(encoder), clip(hidden)

    pipe = deeper(tiny_pipeline("sd3"), num_layers=3)
    for block in pipe.transformer.transformer_blocks:
        block.__class__ = FinfoClippedBlock
    target = "transformer_blocks.0.ff.net.2"
    timesteps: list[float] = []
    now = [0.0]

    def count(module, args, kwargs):
        now[0] = float(kwargs["timestep"].flatten()[0])
        if now[0] not in timesteps:
            timesteps.append(now[0])

    def inf_at_step_2(module, args, output):
        if timesteps.index(now[0]) == 2:
            output = output.clone()
            output[(0,) * output.dim()] = float("inf")
            return output

    pipe.transformer.register_forward_pre_hook(count, with_kwargs=True)
    pipe.transformer.get_submodule(target).register_forward_hook(inf_at_step_2)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        out = run(pipe, "sd3", steps=4, output_type="latent")
    dbg.close()
    assert len(timesteps) == 4
    assert bool(torch.isfinite(out).all())  # clipped by the blocks
    got = [(a.kind, a.module, a.step) for a in dbg.report().anomalies if a.kind == "nonfinite"]
    assert got[:1] == [("nonfinite", target, 2)], got


def test_a_dits_stream_dtype_is_told_once_then_remembered_both_ways(dits, tmp_path, monkeypatch):
    """Whether a float32 transformer's streams need main's path is told at its first watched call and remembered
    either way: a PixArt (float32 streams: paced) watched at four attaches is told once, and its later attaches add
    no check (it was told again at every attach: a hook on its block lists' ends and a read of its blocks' source,
    1-2 ms a call, of DESIGN's 3 ms fixed cost)."""
    from diffusion_debug.diffusion.components import component_probes

    told = []
    original = component_probes._StreamDtype.__init__

    def counting(self, *args, **kwargs):
        told.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(component_probes._StreamDtype, "__init__", counting)
    pipe = dits["pixart"]
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    sampled = []
    try:
        for _ in range(4):
            with dbg:
                run(pipe, "pixart", steps=2, output_type="latent")
                sampled.append(list(dbg._steps.probes.pace.sampled))
    finally:
        dbg.close()
    assert len(told) == 1
    assert sampled == [["transformer"]] * 4


def test_a_dit_with_no_projection_found_is_not_paced_for_none(tmp_path):
    """A transformer whose blocks hold no projection :func:`~.sentinel_blocks.block_projections` reads (here each
    wrapped in an ``nn.Sequential``) is read as on main (its block lists' ends every step, not paced), not paced for
    projections it does not read (peft's LoRA wrappers were such: found none, paced still)."""
    from diffusion_debug.diffusion.components.sentinel_blocks import block_projections

    pipe = deeper(tiny_pipeline("pixart"), num_layers=3)
    for block in pipe.transformer.transformer_blocks:
        for attention in (block.attn1, block.attn2):
            attention.to_out[0] = torch.nn.Sequential(attention.to_out[0])
        block.ff.net[2] = torch.nn.Sequential(block.ff.net[2])
    assert block_projections(pipe.transformer) == []
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    try:
        with dbg:
            run(pipe, "pixart", steps=2, output_type="latent")
            sampled = list(dbg._steps.probes.pace.sampled)
            every = dbg._steps.probes.pace.every
    finally:
        dbg.close()
    assert (sampled, every) == ([], 4)
    assert found(dbg) == []


def test_a_lora_wrapped_projection_near_float16s_max_is_warned_at_the_wrapper(tmp_path):
    """peft's LoRA wraps each targeted projection in a ``lora.Linear`` (its ``base_layer`` the ``nn.Linear``): the
    wrapper is read, its output the projection's with the adapter's. Its base layer scaled so that the wrapper's
    float16 output peaks at 90% of 65504: warned at the first step past half the max, the replay naming the base layer
    inside the wrapper the sentinel read (none was read: block_projections found no ``nn.Linear``)."""
    from peft import LoraConfig, inject_adapter_in_model

    from diffusion_debug.diffusion.components.sentinel_blocks import block_projections

    pipe = deeper(tiny_pipeline("pixart"), num_layers=3)
    config = LoraConfig(r=4, target_modules=["to_out.0", "ff.net.2"], init_lora_weights=True)
    inject_adapter_in_model(config, pipe.transformer)
    _, name, _, _ = PLANTED["pixart"]
    assert len(block_projections(pipe.transformer)) == 9
    module = pipe.transformer.get_submodule(name)
    by = 0.9 * FP16_MAX / max(peaks_by_call(pipe, "pixart", [name], steps=3)[name])
    with torch.no_grad():
        module.base_layer.weight.mul_(by)
        module.base_layer.bias.mul_(by)
    peaks = peaks_by_call(pipe, "pixart", [name], steps=3)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        run(pipe, "pixart", steps=3, output_type="latent")
    dbg.close()
    first = next(step for step, peak in enumerate(peaks[name]) if peak >= 0.5 * FP16_MAX)
    risks = [(a.kind, a.module, a.step) for a in dbg.report().anomalies if a.kind == "overflow_risk"]
    assert risks == [("overflow_risk", f"{name}.base_layer", first)]


def test_a_projected_prior_beside_a_unet_leaves_the_unets_pace_as_on_main(tmp_path):
    """A float32 PriorTransformer and a float32 UNet under float16 autocast (Kandinsky's combined pipelines' prior and
    UNet; UnCLIP's): the prior is paced as a projected transformer (step 0 of every run, then steps 1 and every 8th),
    the UNet as on main (its step 0 by run: runs 1, 2, 5...; then steps 1 and every 4th). The projected pace was the
    whole group's: the UNet was read at steps 0, 1 and every 8th of every run."""
    from diffusers import PriorTransformer, UNet2DConditionModel

    from diffusion_debug.diffusion.components.component_probes import ComponentProbes
    from diffusion_debug.diffusion.components.inventory import Component
    from diffusion_debug.diffusion.components.sentinel_blocks import block_projections
    from diffusion_debug.diffusion.components.sentinel_pace import reads
    from diffusion_debug.diffusion.components.structure import TreeMemo

    torch.manual_seed(0)
    prior = PriorTransformer(num_attention_heads=2, attention_head_dim=16, embedding_dim=32, num_layers=1)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
    )
    probes = ComponentProbes(DebugConfig(output_dir=str(tmp_path), log_level="error"), on_error=print)
    components = [Component("unet", "denoiser", unet), Component("prior", "denoiser", prior)]
    memo, dtypes = TreeMemo(), {"unet": "float32", "prior": "float32"}
    projections = [m for _, m in block_projections(prior)]
    assert projections

    def hooked(modules) -> bool:
        return any(m._forward_hooks for m in modules)

    seen: dict[str, list[list[int]]] = {"unet": [], "prior": []}
    every: list[tuple[int, list[str]]] = []
    for _ in range(6):  # runs 1 to 6
        memo.refresh([unet, prior])  # as an attach does: the probes kept are reused (their hooks left out or not)
        with torch.autocast("cpu", dtype=torch.float16):
            handle = probes.attach(components, memo, dtypes)
        assert (probes.levels, sorted(probes.pace.sampled)) == (
            {"unet": "sentinel", "prior": "sentinel"},
            ["prior", "unet"],
        )
        every.append((probes.pace.every, list(getattr(probes.pace, "projected", []))))
        read: dict[str, list[int]] = {"unet": [], "prior": []}
        for step in range(17):
            probes.pace.at(step)
            if hooked(unet.modules()):
                read["unet"].append(step)
            if hooked(projections):
                read["prior"].append(step)
        seen["unet"].append(read["unet"])
        seen["prior"].append(read["prior"])
        handle.remove()
    assert seen["unet"] == [[s for s in range(17) if reads(s, warm=False, run=run)] for run in range(1, 7)]
    assert seen["unet"][2] == [1, 4, 8, 12, 16]  # run 3: its step 0 not read, as on main
    assert seen["prior"] == [[0, 1, 8, 16]] * 6
    assert every == [(4, ["prior"])] * 6
