"""fp16 and bf16 pipelines whose read paths differ most from SD's, under a reused debugger at its
default: LTX-2 (a Gemma 3 text encoder and its connectors, a causal video VAE and an audio VAE with
its vocoder; fp16: the sentinels, bf16: output checks only), Mochi (a T5 encoder, an fp16 DiT read
at its block list's end, a causal video VAE), LTX-Video 0.9 (its own causal video VAE) and FLUX.2 [klein]
(a Qwen3 encoder, dual- and single-stream blocks). Each: two clean calls bitwise the unwatched ones and
quiet, no hook left after detach; a NaN made in a middle module of the denoiser, or in a VAE's
decoder, on the second call is the one error, named at its module (and step) by the replay.

A sweep of every kind ``tiny_pipeline`` builds, in fp16 and bf16 (2 and 3 steps, two calls) found
no defect; these three stand for the paths the SD, Flux, PixArt and SD3 tests do not take."""

from __future__ import annotations

import pytest
import torch
from diffusion_helpers import pipeline_hooks

from diffusion_debug import DiffusionModelDebugger
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.features import HALF_REPLICATE_PAD_ON_CPU, kind_missing
from diffusion_debug.testing.zoo_newer import ZOO_CALLS
from diffusion_debug.testing.zoo_recent import ZOO_CALLS as RECENT_CALLS
from diffusion_debug.testing.zoo_recent_video import ZOO_CALLS as RECENT_VIDEO_CALLS
from diffusion_debug.testing.zoo_video_audio import LTX2_CALL

CALLS = {
    "ltx2": LTX2_CALL,
    "mochi": lambda: {**ZOO_CALLS["mochi"][0](), "output_type": "pt"},
    "ltx": lambda: {**RECENT_VIDEO_CALLS["ltx"][0](), "output_type": "pt"},
    # guidance 1: one transformer call a step, as the others
    "flux2_klein": lambda: {**RECENT_CALLS["flux2_klein"][0](), "guidance_scale": 1.0, "output_type": "pt"},
}
# (kind, dtype) -> (the denoiser's middle module, (a VAE, a module of its decoder))
CASES = {
    ("ltx2", torch.float16): (
        "transformer_blocks.0.audio_to_video_attn.to_out.0",
        ("audio_vae", "decoder.mid.block_2.conv1.conv"),
    ),
    ("ltx2", torch.bfloat16): (
        "transformer_blocks.0.audio_to_video_attn.to_out.0",
        ("vae", "decoder.up_blocks.0.resnets.0.conv1.conv"),
    ),
    ("mochi", torch.float16): (
        "transformer_blocks.0.ff.net.0.proj",
        ("vae", "decoder.up_blocks.1.resnets.0.conv2.conv"),
    ),
    # LTX-Video 0.9: its causal video VAE (not LTX-2's); FLUX.2 [klein]: its single-stream block's fused projection
    ("ltx", torch.float16): (
        "transformer_blocks.0.attn2.to_out.0",
        ("vae", "decoder.up_blocks.0.resnets.0.conv1.conv"),
    ),
    ("flux2_klein", torch.float16): (
        "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
        ("vae", "decoder.up_blocks.0.resnets.0.conv2"),
    ),
}
# Mochi's rotary embedding asks for float32 autocast, which a CPU refuses (diffusers warns, plain too)
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast:UserWarning")


def _missing(kind: str, dtype: torch.dtype) -> str | None:
    if kind == "mochi" and dtype == torch.float16 and not HALF_REPLICATE_PAD_ON_CPU:
        return "this torch has no float16 replication_pad3d on CPU (Mochi's VAE)"
    return kind_missing(kind)


# a kind is skipped where this diffusers (the floor) lacks its pipeline, or this torch cannot run it on a CPU
PARAMS = [
    pytest.param(
        kind,
        dtype,
        id=f"{kind}-{str(dtype)[6:]}",
        marks=pytest.mark.skipif(bool(_missing(kind, dtype)), reason=str(_missing(kind, dtype))),
    )
    for kind, dtype in CASES
]
STEPS = 2  # one transformer call a step: its 2nd call of the 2nd pipeline call is at step 1


@pytest.fixture(scope="module")
def zoo():
    return {case: tiny_pipeline(case[0], dtype=case[1]) for case in CASES if not kind_missing(case[0])}


def call(pipe, kind) -> list[torch.Tensor]:
    out = pipe(**CALLS[kind](), num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0))
    return [value for value in out.values() if isinstance(value, torch.Tensor)]  # LTX-2: frames and audio


def said(dbg) -> list[tuple]:
    """Every warning and error so far."""
    anomalies = dbg.report().anomalies
    return [(a.kind, a.severity, a.component, a.module, a.step) for a in anomalies if a.severity != "info"]


def two_calls(pipe, kind, tmp_path) -> tuple[DiffusionModelDebugger, list, list]:
    dbg = DiffusionModelDebugger(pipe, {"output_dir": str(tmp_path)})
    with dbg:
        first = call(pipe, kind)
        after_first = said(dbg)
        second = call(pipe, kind)
    return dbg, after_first, [first, second]


@pytest.mark.parametrize("kind, dtype", PARAMS)
def test_two_clean_calls_are_the_unwatched_ones_quiet_and_leave_no_hook(zoo, tmp_path, caplog, kind, dtype):
    pipe = zoo[kind, dtype]
    plain = call(pipe, kind)
    assert all(t.isfinite().all() for t in plain)
    before = pipeline_hooks(pipe)
    with caplog.at_level("WARNING", logger="diffusion_debug"):
        dbg, _, watched = two_calls(pipe, kind, tmp_path)
        dbg.close()
    assert pipeline_hooks(pipe) == before
    for outputs in watched:
        assert [t.dtype for t in outputs] == [t.dtype for t in plain]
        assert all(torch.equal(seen, expected) for seen, expected in zip(outputs, plain))
    assert said(dbg) == []
    assert [r.getMessage() for r in caplog.records if r.name.startswith("diffusion_debug")] == []


@pytest.mark.parametrize("kind, dtype", PARAMS)
def test_a_nan_in_a_middle_denoiser_module_on_the_second_call_is_the_one_error_at_its_step(zoo, tmp_path, kind, dtype):
    pipe, (module, _) = zoo[kind, dtype], CASES[kind, dtype]
    with plant_nonfinite(pipe.transformer.get_submodule(module), from_call=STEPS + 1, value=float("nan")):
        dbg, after_first, _ = two_calls(pipe, kind, tmp_path)
    assert after_first == []
    errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert [(a.kind, a.component, a.module, a.step) for a in errors] == [("nonfinite", "transformer", module, 1)]
    assert errors[0].details["localized_by"].endswith("replay with full probes")
    dbg.close()


@pytest.mark.parametrize("kind, dtype", PARAMS)
def test_a_nan_in_a_vae_decoder_on_the_second_call_is_the_one_error_there(zoo, tmp_path, kind, dtype):
    pipe, (_, (vae, module)) = zoo[kind, dtype], CASES[kind, dtype]
    with plant_nonfinite(getattr(pipe, vae).get_submodule(module), from_call=1, value=float("nan")):
        dbg, after_first, (_, second) = two_calls(pipe, kind, tmp_path)
    assert after_first == []
    assert not all(t.isfinite().all() for t in second)  # it reaches the call's output
    errors = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert [(a.kind, a.component, a.module) for a in errors] == [("nonfinite", vae, module)]
    dbg.close()
