"""The real-size GPU comparison: an SD1.5-size pipeline in fp16 (UNet 860M with the SD1.5 config,
the SD VAE, a 12-layer CLIP text encoder, random weights), 512x512, 20 steps, classifier-free
guidance, plain vs the debugger's default / basic / full probes vs transformers'
DebugUnderflowOverflow; the blocking syncs the debugger adds per step; and a training step of the
SD1.5 UNet under Accelerate fp16 with and without the TrainingDebugger.

Runs only where CUDA is available (``python -m benchmarks.run`` calls it then; on its own:
``python -m benchmarks.gpu``). Nothing here downloads: every model is built from a config.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from diffusion_debug import DebugConfig, DiffusionModelDebugger, TrainingDebugger

from .harness import Comparison, interleaved
from .inference import underflow_overflow
from .models import sd15_unet


def sd15_pipeline(dtype: torch.dtype = torch.float16, device: str = "cuda") -> Any:
    """An SD1.5-size StableDiffusionPipeline with random weights, built offline."""
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffusion_debug.testing import tiny_pipeline

    with torch.random.fork_rng():
        torch.manual_seed(0)
        vae = AutoencoderKL(
            block_out_channels=(128, 256, 512, 512),
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            latent_channels=4,
            layers_per_block=2,
            sample_size=512,
        )
        text_encoder = CLIPTextModel(
            CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)
        )
    tokenizer = tiny_pipeline("sd").tokenizer  # a CLIP tokenizer built offline (77 tokens)
    pipe = StableDiffusionPipeline(
        unet=sd15_unet(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=DDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device=device, dtype=dtype)


def _debugged(pipe: Any, config: DebugConfig):
    def case() -> None:
        with DiffusionModelDebugger(pipe, config):
            _call(pipe)

    return case


def _call(pipe: Any, steps: int = 20) -> None:
    pipe("a photo of an astronaut", num_inference_steps=steps, generator=torch.Generator("cuda").manual_seed(0))


def inference(repeats: int = 7, output_dir: str | None = None) -> Comparison:
    out = output_dir or tempfile.mkdtemp(prefix="diffusion-debug-gpu-")
    pipe = sd15_pipeline()

    def config(**kwargs: Any) -> DebugConfig:
        return DebugConfig(output_dir=out, **kwargs)

    def transformers_tool() -> None:
        with underflow_overflow(pipe.unet):
            _call(pipe, steps=5)  # 20 steps print megabytes: 5, and the ratio is scaled below

    def synced() -> None:  # the cost of one blocking sync per step, for scale
        pipe(
            "a photo of an astronaut",
            num_inference_steps=20,
            generator=torch.Generator("cuda").manual_seed(0),
            callback_on_step_end=lambda p, i, t, kw: torch.cuda.synchronize() or {},
        )

    result = interleaved(
        "SD1.5 size, fp16, 512x512, 20 steps (CFG)",
        {
            "plain": lambda: _call(pipe),
            "debugger default (advanced)": _debugged(pipe, config()),
            "debugger level basic": _debugged(pipe, config(level="basic")),
            "debugger, full probes": _debugged(pipe, config(probes="full")),
            "plain + one sync per step": synced,
            "transformers DebugUnderflowOverflow (5 steps)": transformers_tool,
        },
        repeats=repeats,
    )
    return result


def syncs_per_step(output_dir: str | None = None) -> float:
    """Blocking host syncs the default debugger adds per denoising step (torch's sync debug mode
    warns once per sync)."""
    out = output_dir or tempfile.mkdtemp(prefix="diffusion-debug-gpu-")
    pipe = sd15_pipeline()

    def count(run, steps: int) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                run(steps)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    def plain(steps: int) -> None:
        _call(pipe, steps)

    debugger = DiffusionModelDebugger(pipe, DebugConfig(output_dir=out))

    def watched(steps: int) -> None:
        with debugger:
            _call(pipe, steps)

    added_long = count(watched, 10) - count(plain, 10)
    added_short = count(watched, 5) - count(plain, 5)
    return (added_long - added_short) / 5


def loop_under_sync_error(output_dir: str | None = None, steps: int = 10) -> str:
    """The watched denoising loop, from its second step to its last, under
    ``torch.cuda.set_sync_debug_mode("error")``: "no sync", or the error a blocking sync raised
    (the plain pipeline is run the same way first, so a sync of its own is told apart)."""
    out = output_dir or tempfile.mkdtemp(prefix="diffusion-debug-gpu-")
    pipe = sd15_pipeline()

    def strict_from_step_1(p: Any, i: int, t: Any, kwargs: dict) -> dict:
        torch.cuda.set_sync_debug_mode("error" if i < steps - 1 else "default")  # the VAE may read once
        return {}

    def call() -> str:
        try:
            pipe(
                "a photo of an astronaut",
                num_inference_steps=steps,
                generator=torch.Generator("cuda").manual_seed(0),
                callback_on_step_end=strict_from_step_1,
            )
        except RuntimeError as error:
            return f"raised: {str(error).splitlines()[0]}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return "no sync"

    plain = call()
    if plain != "no sync":
        return f"the plain pipeline syncs in its loop ({plain})"
    with DiffusionModelDebugger(pipe, DebugConfig(output_dir=out)):
        return call()


def training(repeats: int = 10, output_dir: str | None = None, mixed_precision: str = "fp16") -> Comparison:
    """One SD1.5-UNet training step (batch 2, 64x64 latents) under Accelerate's mixed precision."""
    from accelerate import Accelerator

    out = output_dir or tempfile.mkdtemp(prefix="diffusion-debug-gpu-")
    accelerator = Accelerator(mixed_precision=mixed_precision)
    unet = sd15_unet().train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-6)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    g = torch.Generator("cuda").manual_seed(0)
    latents = torch.randn(2, 4, 64, 64, generator=g, device="cuda")
    noise = torch.randn(latents.shape, generator=g, device="cuda")
    context = torch.randn(2, 77, 768, generator=g, device="cuda")
    timesteps = torch.randint(0, 1000, (2,), generator=g, device="cuda")
    tdbg = TrainingDebugger(unet, accelerator=accelerator, config=DebugConfig(output_dir=out))

    def step(monitor: bool = False) -> None:
        with accelerator.autocast():
            loss = F.mse_loss(unet(latents + noise, timesteps, encoder_hidden_states=context).sample.float(), noise)
        accelerator.backward(loss)
        if monitor:
            tdbg.monitor_training_step(loss, optimizer=optimizer, timesteps=timesteps)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def anomaly_mode() -> None:
        with torch.autograd.detect_anomaly(check_nan=True):
            step()

    return interleaved(
        f"SD1.5 UNet training step, batch 2, 64x64 latents, Accelerate {mixed_precision}",
        {"plain": step, "TrainingDebugger default": lambda: step(True), "torch.autograd.detect_anomaly": anomaly_mode},
        repeats=repeats,
    )


def run(output_dir: str | None = None) -> dict[str, Any]:
    infer = inference(output_dir=output_dir)
    scaled = infer.ratio("transformers DebugUnderflowOverflow (5 steps)") * 20 / 5
    return {
        "inference": infer,
        "transformers_20_steps_estimate": scaled,
        "added_syncs_per_step": syncs_per_step(output_dir),
        "loop_under_sync_error": loop_under_sync_error(output_dir),
        "training_fp16": training(output_dir=output_dir, mixed_precision="fp16"),
        "training_bf16": training(output_dir=output_dir, mixed_precision="bf16"),
    }


def markdown(results: dict[str, Any]) -> str:
    parts = [
        results["inference"].markdown(),
        f"- DebugUnderflowOverflow scaled to 20 steps: {results['transformers_20_steps_estimate']:.2f}x",
        f"- blocking syncs added per denoising step (default mode): {results['added_syncs_per_step']:.2f}",
        f"- the watched loop under set_sync_debug_mode('error'): {results['loop_under_sync_error']}",
        "",
        results["training_fp16"].markdown(),
        "",
        results["training_bf16"].markdown(),
    ]
    return "\n".join(parts)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.gpu needs a CUDA GPU.")
    print(markdown(run()))
    print(json.dumps({"device": torch.cuda.get_device_name()}))
