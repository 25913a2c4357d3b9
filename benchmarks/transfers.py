"""Device-to-host reads per denoising step in default mode, counted by
diffusion_debug.host_transfers (and, on a GPU, also by torch's sync debug mode)."""

from __future__ import annotations

import warnings

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.host_transfers import count_host_transfers


def run(pipe, *, steps: int, output_dir: str) -> dict:
    config = DebugConfig(output_dir=output_dir, save_debug_info=False, run_name="bench-transfers")
    generator = torch.Generator(pipe.device).manual_seed(0)
    with DiffusionModelDebugger(pipe, config) as dbg:
        pipe("a photo of a cat", num_inference_steps=steps, output_type="latent", generator=generator)  # warm-up
        dbg.clear_debug_history()
        with count_host_transfers() as reads:
            pipe("a photo of a cat", num_inference_steps=steps, output_type="latent", generator=generator)
        sync_warnings = None
        if pipe.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    pipe("a photo of a cat", num_inference_steps=steps, output_type="latent", generator=generator)
                sync_warnings = len(caught)
            finally:
                torch.cuda.set_sync_debug_mode(0)
    return {
        "steps": steps,
        "host_reads": reads.count,
        "host_reads_per_step": reads.count / steps,
        "calls": sorted(set(reads.calls)),
        "cuda_sync_warnings": sync_warnings,
    }
