"""A pipeline changed between the calls of one attach (a served pipeline under one ``with dbg:``):
``fuse_qkv_projections`` (a ``to_qkv`` module added in each attention, ``unfuse`` taking it away),
``pipe.to(torch.float16)`` and a LoRA hotswapped (``enable_lora_hotswap``, ``hotswap=True``). Each
later call is its unwatched twin's, bit for bit, and is probed as the pipeline is now: a NaN planted in
the new module named there, an fp16 block near overflow warned of. Before, the probes were the
attach's: the fused NaN was named at the attention around it ("before its modules"), and the fp32 UNet
made fp16 went unprobed (no ``overflow_risk``). And a tiled fp16 VAE decode (``vae.enable_tiling()``):
a NaN in one tile is named at its module; a UNet compiled in place (``unet.compile()``) between calls gets
no graph break from hooks made for its uncompiled call."""

from __future__ import annotations

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite, plant_overflow, tiny_pipeline

ATTENTION = "up_blocks.1.attentions.0.transformer_blocks.0.attn1"


def call(pipe, steps: int = 2) -> torch.Tensor:
    return pipe(
        "a cat", num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="pt"
    ).images


def found(dbg, kind: str) -> list[tuple]:
    return [(a.component, a.module, a.step, a.details.get("run")) for a in dbg.report().anomalies if a.kind == kind]


def test_qkv_fused_and_unfused_between_calls_of_one_attach_with_full_probes(tmp_path):
    twin, pipe = tiny_pipeline("sd"), tiny_pipeline("sd")
    expected = [call(twin, 1)]
    twin.fuse_qkv_projections()
    expected.append(call(twin, 1))
    twin.unfuse_qkv_projections()
    expected.append(call(twin, 1))
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", probes="full"))
    with dbg:
        images = [call(pipe, 1)]
        pipe.fuse_qkv_projections()
        # planted before the call that probes the new module (as a NaN in its weights is): the next call's
        with plant_nonfinite(pipe.unet.get_submodule(f"{ATTENTION}.to_qkv"), from_call=1, value=float("nan")):
            images.append(call(pipe, 1))
            call(pipe, 1)
        pipe.unfuse_qkv_projections()
        images.append(call(pipe, 1))
    assert [torch.equal(*pair) for pair in zip(images, expected)] == [True] * 3
    assert found(dbg, "nonfinite")[0] == ("unet", f"{ATTENTION}.to_qkv", 0, 3)
    assert found(dbg, "debugger_error") == []
    dbg.close()


def test_a_pipeline_made_fp16_between_calls_of_one_attach_is_warned_of_an_fp16_overflow(tmp_path):
    twin, pipe = tiny_pipeline("sd"), tiny_pipeline("sd")
    expected = call(twin), call(twin.to(torch.float16))
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        images = [call(pipe)]
        pipe.to(torch.float16)
        with plant_overflow(pipe.unet.get_submodule("up_blocks.1"), fraction=0.7, from_call=3):  # next call's step 1
            images.append(call(pipe))
            call(pipe)
    assert [torch.equal(*pair) for pair in zip(images, expected)] == [True, True]
    assert found(dbg, "overflow_risk") == [("unet", "up_blocks.1", 1, 3)]
    assert found(dbg, "debugger_error") == []
    dbg.close()


def lora(unet, seed: int, rank: int) -> dict[str, torch.Tensor]:
    """A LoRA of ``rank`` on every attention's query projection, in the keys ``load_lora_weights`` reads."""
    generator, found = torch.Generator().manual_seed(seed), {}
    for name, module in unet.named_modules():
        if name.endswith(".to_q"):
            found[f"unet.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * 0.3
            found[f"unet.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * 0.3
    return found


def test_a_lora_hotswapped_between_calls_of_one_attach_changes_no_output_and_its_nan_is_named(tmp_path):
    def make():
        pipe = tiny_pipeline("sd")
        pipe.enable_lora_hotswap(target_rank=4)
        pipe.load_lora_weights(lora(pipe.unet, 1, 4), adapter_name="style")
        return pipe

    def swap(pipe):  # a new dict each time: diffusers loads the tensors it is given, hotswap copies into them
        pipe.load_lora_weights(lora(pipe.unet, 2, 2), adapter_name="style", hotswap=True)

    twin, pipe = make(), make()
    expected = [call(twin)]
    swap(twin)
    expected.append(call(twin))
    module = f"{ATTENTION}.to_q.lora_B.style"
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        images = [call(pipe)]
        swap(pipe)
        with plant_nonfinite(pipe.unet.get_submodule(module), from_call=3, value=float("nan")):
            images.append(call(pipe))
            call(pipe)
    assert [torch.equal(*pair) for pair in zip(images, expected)] == [True, True]
    assert found(dbg, "nonfinite")[0] == ("unet", module, 1, 3)
    assert torch.equal(call(pipe), expected[1])  # detached
    dbg.close()


def test_a_nan_in_one_tile_of_a_tiled_fp16_vae_decode_is_named_at_its_module(tmp_path):
    def make():
        pipe = tiny_pipeline("sd", dtype=torch.float16)
        pipe.vae.enable_tiling()
        pipe.vae.tile_sample_min_size, pipe.vae.tile_latent_min_size = 32, 8  # the tiny VAE's: 4x
        return pipe

    def tiled(pipe):  # 48x48: 4 tiles of 32 (8 latent pixels), 24 apart
        kwargs = dict(height=48, width=48, output_type="pt")
        return pipe("a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(0), **kwargs).images

    twin, pipe = make(), make()
    module = "decoder.up_blocks.0.resnets.0.conv2"
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        assert torch.equal(tiled(pipe), tiled(twin))
    with plant_nonfinite(pipe.vae.get_submodule(module), from_call=2, value=float("nan")), dbg:  # the 3rd tile
        tiled(pipe)
    assert found(dbg, "nonfinite") == [("vae", module, None, 2)]
    assert found(dbg, "debugger_error") == []
    dbg.close()


def test_a_unet_compiled_in_place_between_calls_of_one_attach_gets_no_graph_break(tmp_path):
    from diffusion_helpers import dynamo_counts

    pipe = tiny_pipeline("sd")
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error"))
    with dbg:
        call(pipe, 1)
        pipe.unet.compile(backend="aot_eager")
        breaks, _ = dynamo_counts()
        call(pipe, 1)  # before: 2 graph breaks at the call sites' clock, hooks made for an uncompiled call
    assert dynamo_counts()[0] == breaks
    assert [a.kind for a in dbg.report().anomalies if a.kind == "debugger_error"] == []
    dbg.close()


def test_full_probes_of_a_pipeline_made_fp16_in_one_attach_are_hooked_as_a_fresh_attach_hooks_them(tmp_path):
    from diffusion_helpers import pipeline_hooks

    pipe, fresh = tiny_pipeline("sd"), tiny_pipeline("sd", dtype=torch.float16)
    config = DebugConfig(output_dir=str(tmp_path), log_level="error", probes="full")
    with DiffusionModelDebugger(fresh, config) as other:
        call(fresh, 1)
        expected = pipeline_hooks(fresh)
    other.close()
    dbg = DiffusionModelDebugger(pipe, config)
    with dbg:
        call(pipe, 1)
        pipe.to(torch.float16)
        call(pipe, 1)
        # before: 54, not 50: the probes alone put on again, under the call sites' hooks, each root read by a hook of
        # its own (a module with forward hooks at a probe's attach) rather than by the armed global hook
        assert pipeline_hooks(pipe) == expected
    assert found(dbg, "debugger_error") == []
    dbg.close()
