"""A pipeline changed between the calls of one attach (a served pipeline under one ``with dbg:``):
``fuse_qkv_projections`` (a ``to_qkv`` module added in each attention, ``unfuse`` taking it away) and
``pipe.to(torch.float16)``. Each later call is its unwatched twin's, bit for bit, and is probed as the
pipeline is now: a NaN planted in the new module named there, an fp16 block near overflow warned of.
Before, the probes were the attach's: the fused NaN was named at the attention around it ("before its
modules"), and the fp32 UNet made fp16 went unprobed (no ``overflow_risk``)."""

from __future__ import annotations

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite, plant_overflow, tiny_pipeline

ATTENTION = "up_blocks.1.attentions.0.transformer_blocks.0.attn1"


def call(pipe) -> torch.Tensor:  # 2 steps
    return pipe("a cat", num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt").images


def found(dbg, kind: str) -> list[tuple]:
    return [(a.component, a.module, a.step, a.details.get("run")) for a in dbg.report().anomalies if a.kind == kind]


def test_qkv_fused_and_unfused_between_calls_of_one_attach_with_full_probes(tmp_path):
    twin, pipe = tiny_pipeline("sd"), tiny_pipeline("sd")
    expected = [call(twin)]
    twin.fuse_qkv_projections()
    expected.append(call(twin))
    twin.unfuse_qkv_projections()
    expected.append(call(twin))
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", probes="full"))
    with dbg:
        images = [call(pipe)]
        pipe.fuse_qkv_projections()
        # planted before the call that probes the new module (as a NaN in its weights is): the next call's step 1
        with plant_nonfinite(pipe.unet.get_submodule(f"{ATTENTION}.to_qkv"), from_call=3, value=float("nan")):
            images.append(call(pipe))
            call(pipe)
        pipe.unfuse_qkv_projections()
        images.append(call(pipe))
    assert [torch.equal(*pair) for pair in zip(images, expected)] == [True] * 3
    assert found(dbg, "nonfinite")[0] == ("unet", f"{ATTENTION}.to_qkv", 1, 3)
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
