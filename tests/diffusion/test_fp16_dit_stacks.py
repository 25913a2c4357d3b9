"""fp16 transformer denoisers (DiTs) at the default: each repeated block list (Flux's dual-stream
``transformer_blocks`` and its ``single_transformer_blocks``, PixArt's ``transformer_blocks``) is a
residual stream, read by the sentinel at its last block (``component_probes.stack_ends``): one hook
a list a step. A fault a middle block makes reaches the list's end, and the replay of the kept call
with full probes names its module and step."""

from __future__ import annotations

import diffusion_helpers as helpers
import pytest
import torch
from diffusion_helpers import plant

from diffusion_debug.testing import plant_overflow, tiny_pipeline
from diffusion_debug.testing.flux import FLUX_CALL, deeper
from diffusion_debug.testing.zoo import ZOO_CALLS

REPLAYED = "sentinel -> replay with full probes"


@pytest.fixture(scope="module")
def dits():
    """A tiny fp16 Flux with 3 dual-stream and 3 single-stream blocks, a PixArt with 3, an SD3 with 4."""
    flux = deeper(tiny_pipeline("flux", dtype=torch.float16), num_layers=3, num_single_layers=3)
    return {
        "flux": flux,
        "pixart": deeper(tiny_pipeline("pixart", dtype=torch.float16), num_layers=3),
        "sd3": deeper(tiny_pipeline("sd3", dtype=torch.float16), num_layers=4),
    }


def run(pipe, steps=2):
    name = type(pipe).__name__
    kwargs = (
        FLUX_CALL[0]()
        if name == "FluxPipeline"
        else {"prompt": "a cat"}
        if name == "StableDiffusion3Pipeline"
        else ZOO_CALLS["pixart"][0]()
    )
    kwargs["output_type"] = "pt"
    return pipe(num_inference_steps=steps, generator=torch.Generator().manual_seed(0), **kwargs).images


def warmed(pipe, **config):
    return helpers.warmed(pipe, run, **config)  # (2 steps: PixArt's pipeline cannot run 1 with its default scheduler)


def faults(dbg, before):
    return [
        (a.kind, a.severity, a.component, a.module, a.step, a.details.get("localized_by"))
        for a in dbg.report().anomalies[before:]
        if a.kind in ("nonfinite", "overflow_risk") and a.component == "transformer"
    ]


@pytest.mark.parametrize(
    "kind, blocks",
    [
        ("flux", ["transformer_blocks.2", "single_transformer_blocks.2"]),
        ("pixart", ["transformer_blocks.2"]),
        # SD3's last block keeps no text stream (context_pre_only): no repeat of block 2, read with it
        ("sd3", ["transformer_blocks.2", "transformer_blocks.3"]),
    ],
)
def test_an_fp16_dit_sentinel_reads_each_block_list_at_its_last_block(dits, kind, blocks):
    """Blocks 0 and 1 of each list are left out (read at block 2, as 3 hooks a list were); the
    single modules at either end (embedders, norm_out, proj_out) stay as they were."""
    dbg = warmed(dits[kind])
    with dbg:
        watched = dbg._steps.probes.probes["transformer"].module_names
    assert [name for name in watched if "blocks." in name] == blocks
    dbg.close()


@pytest.mark.parametrize(
    "kind, module, value",
    [
        ("flux", "transformer_blocks.1.attn.to_out.0", "nan"),  # the image stream of a dual block
        ("flux", "transformer_blocks.1.ff_context.net.2", "nan"),  # its text stream: read at the list's end too
        ("flux", "transformer_blocks.0.ff.net.2", "inf"),
        ("flux", "single_transformer_blocks.1.proj_mlp", "nan"),
        ("pixart", "transformer_blocks.1.attn1.to_out.0", "nan"),
        ("pixart", "transformer_blocks.1.ff.net.2", "inf"),
        ("sd3", "transformer_blocks.1.ff_context.net.2", "nan"),
        ("sd3", "transformer_blocks.2.ff_context.net.2", "nan"),  # the text stream block 3 does not pass on
    ],
)
def test_a_nonfinite_in_a_middle_block_of_an_fp16_dit_is_named_at_its_module_and_step(dits, kind, module, value):
    pipe = dits[kind]
    dbg = warmed(pipe)
    before = len(dbg.report().anomalies)
    fill = float(value)
    with plant(pipe.transformer.get_submodule(module), 1, lambda out: torch.full_like(out, fill)), dbg:
        run(pipe)
    assert faults(dbg, before) == [("nonfinite", "error", "transformer", module, 1, REPLAYED)]
    dbg.close()


def test_an_fp16_near_overflow_a_middle_flux_block_adds_to_its_stream_is_named_at_its_module(dits):
    """Block 1's attention gate made 1 (its AdaLayerNormZero's projection zeroed but for the gate):
    its attention output, 61% of fp16's largest value from step 1 on, enters the image stream as it
    is; blocks 2 and the single blocks carry it, read at the lists' ends; the replay names it."""
    pipe = deeper(tiny_pipeline("flux", dtype=torch.float16), num_layers=3, num_single_layers=3)
    projection = pipe.transformer.transformer_blocks[1].norm1.linear
    width = projection.out_features // 6  # shift, scale, gate of the attention; shift, scale, gate of the MLP
    with torch.no_grad():
        projection.weight.zero_()
        projection.bias.zero_()
        projection.bias[2 * width : 3 * width] = 1
    dbg = warmed(pipe)
    before = len(dbg.report().anomalies)
    module = "transformer_blocks.1.attn.to_out.0"
    with plant_overflow(pipe.transformer.get_submodule(module), fraction=0.61, from_call=1), dbg:
        run(pipe)
    risks = [a for a in dbg.report().anomalies[before:] if a.kind == "overflow_risk" and a.component == "transformer"]
    assert [(a.module, a.step, a.details["localized_by"]) for a in risks] == [(module, 1, REPLAYED)]
    assert risks[0].details["dtype_max_fraction"] == pytest.approx(0.61, abs=1e-3)
    dbg.close()


@pytest.mark.parametrize("kind", ["flux", "pixart", "sd3"])
def test_a_clean_fp16_dit_call_is_quiet_and_bitwise_equal(dits, kind):
    pipe = dits[kind]
    plain = run(pipe)
    dbg = warmed(pipe)
    before = len(dbg.report().anomalies)
    with dbg:
        watched = run(pipe)
    assert torch.equal(plain, watched)
    assert not faults(dbg, before)
    assert not [e for e in dbg.record.events if e["type"] == "replay"]
    dbg.close()


def test_a_unets_down_and_up_blocks_of_one_width_are_each_read():
    """A UNet's up blocks of one width repeat (type and parameter shapes), but they resample and
    their resnets start with a norm: no residual stream. Each is read, as before, by either test:
    the denoiser is a UNet, and a block that resamples is no repeat."""
    from diffusers import UNet2DConditionModel

    from diffusion_debug.diffusion.components.component_probes import (
        _unet,
        denoiser_blocks,
        overflow_blocks,
        stack_ends,
    )

    unet = UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(8, 8, 8),
        layers_per_block=1,
        down_block_types=("DownBlock2D",) * 3,
        up_block_types=("UpBlock2D",) * 3,
        cross_attention_dim=8,
        norm_num_groups=4,
        attention_head_dim=2,
    )
    blocks = denoiser_blocks(overflow_blocks(unet))
    names = [name for name, _ in blocks]
    assert {"down_blocks.0", "down_blocks.1", "down_blocks.2", "up_blocks.0", "up_blocks.1", "up_blocks.2"} <= set(
        names
    )
    assert _unet(unet) and [name for name, _ in stack_ends(unet, blocks, repeated=True)] == names


@pytest.mark.parametrize("config, localized_by", [({}, REPLAYED), ({"level": "extreme"}, "full probes")])
@pytest.mark.parametrize(
    "module, clipped_in",
    [
        ("transformer_blocks.1.ff_context.net.2", "transformer_blocks.1"),  # the text stream of a dual block
        ("single_transformer_blocks.1.proj_out", "single_transformer_blocks.1"),
    ],
)
def test_an_fp16_inf_a_flux_block_clips_to_the_max_is_named_nonfinite_at_its_module(
    dits, module, clipped_in, config, localized_by
):
    """diffusers clips Flux's fp16 streams to +-65504 in each block: the Inf a module made leaves
    the block as fp16's largest value, finite. The sentinel at the list's end sees a near-overflow;
    its replay finds the module whose output was Inf: the error there at step 1 (not an overflow
    warning at the block), step 2's counted with it. Full probes (level extreme), which read the
    module in the call, say the same."""
    pipe = dits["flux"]
    dbg = warmed(pipe, **config)
    before = len(dbg.report().anomalies)
    with plant(pipe.transformer.get_submodule(module), 1), dbg:
        run(pipe, steps=3)
    assert faults(dbg, before) == [("nonfinite", "error", "transformer", module, 1, localized_by)]
    error = dbg.report().anomalies[before:][0]
    assert (error.details["clipped_in"], error.details["count"]) == (clipped_in, 2)
    assert error.message == (
        f"transformer.{module} produced Inf from finite inputs (float16 overflow); transformer.{clipped_in} "
        "clipped it to float16's largest value (65504), so the output stayed finite but carries that clipped "
        "value, not the one computed (check its dtype, inputs and weights; try float32 or bfloat16)."
    )
    dbg.close()


def test_an_fp16_inf_clipped_where_an_earlier_run_overflowed_is_replayed_and_named():
    """Where an earlier run's near-overflow was localised, a later run's block at exactly fp16's
    max is replayed again (once a run): a clip hides an Inf that way, and the module that made it
    is named, not the earlier run's overflow."""
    pipe = deeper(tiny_pipeline("flux", dtype=torch.float16), num_layers=3, num_single_layers=3)
    projection = pipe.transformer.transformer_blocks[1].norm1.linear
    width = projection.out_features // 6
    with torch.no_grad():
        projection.weight.zero_()
        projection.bias.zero_()
        projection.bias[2 * width : 3 * width] = 1
    dbg = warmed(pipe)
    near = "transformer_blocks.1.attn.to_out.0"
    with plant_overflow(pipe.transformer.get_submodule(near), fraction=0.61, from_call=1), dbg:
        run(pipe)
    before = len(dbg.report().anomalies)
    made = "transformer_blocks.1.ff_context.net.2"
    with plant(pipe.transformer.get_submodule(made), 1), dbg:
        run(pipe)
    assert faults(dbg, before) == [("nonfinite", "error", "transformer", made, 1, REPLAYED)]
    dbg.close()
