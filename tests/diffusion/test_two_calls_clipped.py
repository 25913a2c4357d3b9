"""An Inf made in the second of a step's two denoiser calls (a pipeline that runs its conditional and
unconditional passes as separate calls: Helios, Wan) and read with full probes is named as made, never
as clipped by the module around it because that module's *first* call, which had no Inf, returned a
finite output. The call that ran the producer is the one whose clip is asked about."""

from __future__ import annotations

import diffusers
import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.replay.decide import clipped_producer
from diffusion_debug.probes import ModuleReading
from diffusion_debug.testing import plant_nonfinite, tiny_pipeline
from diffusion_debug.testing.zoo_video_audio import WAN_TRANSFORMER

FFN = "blocks.1.ffn"


def reading(module: str, call: int, output: float) -> ModuleReading:
    return ModuleReading(module, call, "float32", 1.0, output, "float32")


def test_a_module_finite_in_its_first_call_does_not_clip_the_inf_its_second_call_returned():
    first = [reading(f"{FFN}.net.2", 0, 2.0), reading(FFN, 0, 2.0), reading("blocks.1", 0, 3.0)]
    second = [reading(f"{FFN}.net.2", 1, float("inf")), reading(FFN, 1, float("inf")), reading("blocks.1", 1, 3.0)]
    producer, clipped_in, _ = clipped_producer(first + second, "")
    assert (producer, clipped_in) == (second[0], "blocks.1")  # the second call's block clipped it, not ffn
    unclipped = second[:2] + [reading("blocks.1", 1, float("-inf"))]
    assert clipped_producer(first + unclipped, "") == (unclipped[0], "", None)  # nothing around it clipped it


def helios() -> diffusers.HeliosPipeline:
    """Helios (Wan's VAE, T5 and transformer sizes; one-stage schedule): conditional and unconditional
    passes are two transformer calls a step, and the history tokens' outputs are dropped, so an Inf
    made there leaves the transformer's output finite."""
    wan = tiny_pipeline("wan22")
    torch.manual_seed(0)
    config = {k: v for k, v in WAN_TRANSFORMER.items() if k not in ("rope_max_seq_len",)}
    transformer = diffusers.HeliosTransformer3DModel(**config, rope_dim=(4, 4, 4)).eval()
    return diffusers.HeliosPipeline(
        tokenizer=wan.tokenizer,
        text_encoder=wan.text_encoder,
        transformer=transformer,
        vae=wan.vae,
        scheduler=diffusers.HeliosScheduler(stages=1, shift=3.0),
    )


def call(pipe) -> torch.Tensor:
    return pipe(
        prompt_embeds=torch.linspace(-1, 1, 16 * 32).reshape(1, 16, 32),
        negative_prompt_embeds=torch.zeros(1, 16, 32),
        guidance_scale=2.0,
        height=16,
        width=16,
        num_frames=9,
        num_latent_frames_per_chunk=2,
        num_inference_steps=2,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).frames


def test_an_inf_made_in_a_steps_second_helios_call_is_named_made_not_clipped(tmp_path):
    twin, pipe = helios(), helios()
    with plant_nonfinite(twin.transformer.get_submodule(f"{FFN}.net.2"), from_call=1):
        expected = call(twin)
    dbg = DiffusionModelDebugger(pipe, DebugConfig(output_dir=str(tmp_path), log_level="error", probes="full"))
    with plant_nonfinite(pipe.transformer.get_submodule(f"{FFN}.net.2"), from_call=1), dbg:
        assert torch.equal(call(pipe), expected)
    (error,) = [a for a in dbg.report().anomalies if a.severity == "error"]
    assert (error.kind, error.component, error.module, error.step) == ("nonfinite", "transformer", f"{FFN}.net.2", 0)
    assert "clipped_in" not in error.details
    assert "clipped" not in error.message
    assert not [a for a in dbg.report().anomalies if a.kind == "debugger_error"]
    assert torch.equal(call(pipe), call(twin))  # detached: the pipeline as the twin
    dbg.close()
