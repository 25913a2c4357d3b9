"""fp16 Flux and SD3 with a ControlNet at the default: the transformer's block lists are read at their last
block (``component_probes.stack_ends``) while the ControlNet's residuals are added between its
blocks (``hidden_states + controlnet_block_samples[...]`` in diffusers' block loop); the ControlNet
keeps its whole sentinel. A fault is named where it was made: in the ControlNet, in a transformer
block after a residual was added, or in the control image passed in."""

from __future__ import annotations

import diffusion_helpers as helpers
import pytest
import torch
from diffusion_helpers import plant

from diffusion_debug.testing import plant_overflow, tiny_pipeline
from diffusion_debug.testing.flux import FLUX_CALL, deeper

REPLAYED = "sentinel -> replay with full probes"
SETTINGS = {  # every setting a user may pick that names a module: the default replays, full probes read every module
    "advanced": ({}, REPLAYED),
    "extreme": ({"level": "extreme"}, "full probes"),
    "basic, probes=full": ({"level": "basic", "probes": "full"}, "full probes"),
}


def flux_controlnet(dtype=torch.float16):
    """A tiny FluxControlNetPipeline: the tiny Flux with 3 dual-stream and 3 single-stream blocks and a
    FluxControlNetModel of 1 + 1 blocks (diffusers' test config, at the tiny Flux's widths): each
    ControlNet sample is added after every transformer block of its list, its projections made non-zero."""
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    flux = deeper(tiny_pipeline("flux", dtype=dtype), num_layers=3, num_single_layers=3)
    config = flux.transformer.config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        controlnet = FluxControlNetModel(
            patch_size=1,
            in_channels=config.in_channels,
            num_layers=1,
            num_single_layers=1,
            attention_head_dim=config.attention_head_dim,
            num_attention_heads=config.num_attention_heads,
            joint_attention_dim=config.joint_attention_dim,
            pooled_projection_dim=config.pooled_projection_dim,
            guidance_embeds=config.guidance_embeds,
            axes_dims_rope=list(config.axes_dims_rope),
        )
        # its zero-initialised projections (a fresh ControlNet's) made small random ones: its samples add something
        for name in ("controlnet_blocks", "controlnet_single_blocks", "controlnet_x_embedder"):
            for parameter in controlnet.get_submodule(name).parameters():
                torch.nn.init.normal_(parameter, std=0.05)
    controlnet = controlnet.to(dtype=dtype).eval()
    components = {k: v for k, v in flux.components.items() if k not in ("image_encoder", "feature_extractor")}
    pipe = FluxControlNetPipeline(**components, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def sd3_controlnet(dtype=torch.float16):
    """A tiny StableDiffusion3ControlNetPipeline: the tiny SD3 with 4 blocks and an SD3ControlNetModel
    of 1 block at its widths, its zero-initialised projections made non-zero: its one sample is added
    after each of blocks 0-2 (block 3 keeps no text stream: none after it)."""
    from diffusers import SD3ControlNetModel, StableDiffusion3ControlNetPipeline

    sd3 = deeper(tiny_pipeline("sd3", dtype=dtype), num_layers=4)
    config = sd3.transformer.config
    widths = ("sample_size", "patch_size", "in_channels", "out_channels", "attention_head_dim", "num_attention_heads")
    widths += ("joint_attention_dim", "caption_projection_dim", "pooled_projection_dim", "pos_embed_max_size")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        controlnet = SD3ControlNetModel(num_layers=1, **{key: config[key] for key in widths})
        for name in ("controlnet_blocks", "pos_embed_input"):
            for parameter in controlnet.get_submodule(name).parameters():
                torch.nn.init.normal_(parameter, std=0.05)
    components = {k: v for k, v in sd3.components.items() if k not in ("image_encoder", "feature_extractor")}
    pipe = StableDiffusion3ControlNetPipeline(**components, controlnet=controlnet.to(dtype=dtype).eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def control_image(size=16):
    return torch.linspace(0.0, 1.0, 3 * size * size).reshape(1, 3, size, size)


def run(pipe, steps=2, **extra):
    flux = type(pipe).__name__ == "FluxControlNetPipeline"
    kwargs = FLUX_CALL[0]() if flux else {"prompt": "a cat", "output_type": "pt"}
    kwargs.update(control_image=control_image(16 if flux else 32), controlnet_conditioning_scale=0.7)
    torch.manual_seed(0)  # SD3's pipeline samples the control image's latents from the global RNG, not the generator
    return pipe(num_inference_steps=steps, generator=torch.Generator().manual_seed(0), **{**kwargs, **extra}).images


@pytest.fixture(scope="module")
def pipes():
    return {"flux": flux_controlnet(), "sd3": sd3_controlnet()}


@pytest.fixture
def pipe(pipes):
    return pipes["flux"]


def warmed(pipe, **config):
    return helpers.warmed(pipe, run, **config)


def faults(dbg, before):
    return [
        (a.kind, a.severity, a.component, a.module, a.step, a.details.get("localized_by"))
        for a in dbg.report().anomalies[before:]
        if a.kind in ("nonfinite", "overflow_risk")
    ]


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_a_clean_fp16_dit_controlnet_call_is_quiet_and_bitwise_equal(pipes, kind):
    pipe = pipes[kind]
    plain = run(pipe)
    dbg = warmed(pipe)
    before = len(dbg.report().anomalies)
    with dbg:
        watched = run(pipe)
    assert torch.equal(plain, watched)
    assert not faults(dbg, before)
    assert not [e for e in dbg.record.events if e["type"] == "replay"]
    dbg.close()


@pytest.mark.parametrize(
    "kind, module, localized_by",
    [
        ("flux", "transformer_blocks.0.ff.net.2", REPLAYED),  # in its block: the dual-stream sample
        ("flux", "controlnet_single_blocks.0", "sentinel (a leaf module)"),  # the single-stream sample's projection
        ("sd3", "transformer_blocks.0.attn.to_out.0", REPLAYED),
    ],
)
def test_a_nan_in_the_controlnet_is_named_there_not_in_the_transformer(pipes, kind, module, localized_by):
    """The transformer, given the NaN samples, says its inputs were already non-finite and points
    at the ControlNet's module: a warning, not a second origin."""
    pipe = pipes[kind]
    dbg = warmed(pipe)
    before = len(dbg.report().anomalies)
    with plant(pipe.controlnet.get_submodule(module), 1, lambda out: torch.full_like(out, float("nan"))), dbg:
        run(pipe)
    found = faults(dbg, before)
    assert [f for f in found if f[1] == "error"] == [("nonfinite", "error", "controlnet", module, 1, localized_by)]
    (passed_on,) = [a for a in dbg.report().anomalies[before:] if a.component == "transformer"]
    assert (passed_on.severity, passed_on.step, passed_on.details["localized_by"]) == (
        "warning",
        1,
        "sentinel: its inputs were already non-finite",
    )
    assert f"fix the first NaN/Inf at controlnet {module}, step 1" in passed_on.message
    dbg.close()


@pytest.mark.parametrize(
    "kind, module",
    [
        ("flux", "transformer_blocks.1.ff.net.2"),
        ("flux", "transformer_blocks.1.attn.to_out.0"),
        ("flux", "single_transformer_blocks.1.proj_mlp"),
        ("sd3", "transformer_blocks.1.ff.net.2"),
        ("sd3", "transformer_blocks.2.attn.to_out.0"),
    ],
)
def test_an_inf_in_a_transformer_block_after_a_controlnet_residual_is_named_at_its_module(pipes, kind, module):
    """Block 1 runs on the stream block 0 and the ControlNet's first sample made: its Inf (clipped to
    65504 in a Flux dual block, then carried) is named at the module, step 1."""
    pipe = pipes[kind]
    dbg = warmed(pipe)
    before = len(dbg.report().anomalies)
    with plant(pipe.transformer.get_submodule(module), 1), dbg:
        run(pipe)
    assert [f for f in faults(dbg, before) if f[1] == "error"] == [
        ("nonfinite", "error", "transformer", module, 1, REPLAYED)
    ]
    assert not [a for a in dbg.report().anomalies[before:] if a.component == "controlnet"]
    dbg.close()


@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_a_nan_in_the_control_image_is_named_as_the_input(pipes, kind):
    pipe = pipes[kind]
    dbg = warmed(pipe)
    before = len(dbg.report().anomalies)
    image = control_image(16 if kind == "flux" else 32)
    image[0, 0, 0, 0] = float("nan")
    with dbg:
        run(pipe, control_image=image)
    errors = [(a.kind, a.component, a.module) for a in dbg.report().anomalies[before:] if a.severity == "error"]
    assert errors == [("nonfinite", "input", "control_image")]
    dbg.close()


@pytest.mark.parametrize("setting", SETTINGS)
def test_an_inf_the_controlnets_residuals_make_between_blocks_is_named_between_those_blocks(pipe, setting):
    """The ControlNet's dual-stream sample at 61% of fp16's max, 43% once scaled by 0.7: a
    near-overflow warning at its module. diffusers adds it after each of the transformer's 3 blocks:
    43%, 85%, then Inf after block 2, an add in the transformer's own forward that no module makes.
    The error is the transformer's, between the last module whose output was finite and the first
    given the Inf (its single-stream block 0): not at any module of its. The same diagnosis whether a
    replay (the default) or full probes (every module read in the call) found it."""
    config, localized_by = SETTINGS[setting]
    dbg = warmed(pipe, **config)
    before = len(dbg.report().anomalies)
    with plant_overflow(pipe.controlnet.get_submodule("controlnet_blocks.0"), fraction=0.61, from_call=1), dbg:
        run(pipe)
    found = faults(dbg, before)
    read = "full probes" if config else "sentinel"  # the ControlNet's sample is its leaf module's: no replay
    assert found[:3] == [
        ("overflow_risk", "warning", "controlnet", "controlnet_blocks.0", 1, read),
        ("nonfinite", "error", "transformer", "", 1, localized_by),
        ("overflow_risk", "warning", "transformer", "", 1, localized_by),  # the 85% it built before the Inf
    ]
    risk = [a for a in dbg.report().anomalies[before:] if a.kind == "overflow_risk"][1]
    assert (risk.details["after"], risk.details["before"]) == ("transformer_blocks.1", "transformer_blocks.2")
    error = [a for a in dbg.report().anomalies[before:] if a.severity == "error"][0]
    assert (error.details["after"], error.details["before"]) == ("transformer_blocks.2", "single_transformer_blocks.0")
    assert error.message == (
        "transformer produced NaN/Inf from finite inputs in its own forward, between its modules: the output of "
        "transformer.transformer_blocks.2 was finite, the input of transformer.single_transformer_blocks.0 was "
        "not (an operation there, such as a residual added to the stream, overflowed; check its dtype, inputs "
        "and weights; try float32 or bfloat16)."
    )
    dbg.close()


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("kind", ["flux", "sd3"])
def test_a_near_overflow_the_controlnets_residuals_build_between_blocks_is_named_between_them(pipes, kind, setting):
    """The ControlNet's dual-stream sample at 40% of fp16's max, 28% once scaled by 0.7: below the
    50% threshold, no warning at the ControlNet. Added after each of the transformer's 3 blocks, it
    brings the stream to 56% at block 2's input and 84% in the single-stream blocks: values no module
    made (each took them in with its input), which the transformer's own forward built between its
    blocks. A warning there (once), between block 1 (its output below the threshold) and block 2.
    SD3's one sample likewise, after its blocks 0-2. The same whether a replay or full probes found it."""
    pipe = pipes[kind]
    config, localized_by = SETTINGS[setting]
    dbg = warmed(pipe, **config)
    before = len(dbg.report().anomalies)
    with plant_overflow(pipe.controlnet.get_submodule("controlnet_blocks.0"), fraction=0.4, from_call=1), dbg:
        run(pipe, steps=3)
    assert faults(dbg, before) == [("overflow_risk", "warning", "transformer", "", 1, localized_by)]
    (risk,) = [a for a in dbg.report().anomalies[before:] if a.kind == "overflow_risk"]
    assert (risk.details["after"], risk.details["before"]) == ("transformer_blocks.1", "transformer_blocks.2")
    assert risk.details["dtype_max_fraction"] == pytest.approx(0.56, abs=0.01)
    assert risk.message == (
        "transformer's own forward, between its modules, made values at 56% of the float16 maximum "
        "(|x|=3.67e+04): the output of transformer.transformer_blocks.1 was below 50%, the input of "
        "transformer.transformer_blocks.2 was not (an operation there, such as a residual added to the "
        "stream, grew it); run this component in bfloat16 or float32, or upcast this module."
    )
    dbg.close()
