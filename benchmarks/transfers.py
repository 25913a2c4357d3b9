"""Device-to-host reads the debugger adds per denoising step in default mode.

diffusers itself reads the host a few times per step (``__bool__`` of scheduler tensors), so the
debugger's share is the difference with a plain run; and per step it is the growth of that
difference from a short run to a longer one, which cancels what happens once per run (text
encoders, the VAE, the timestep schedule).  Counted by diffusion_debug.stats.host, and on a
GPU also as torch's sync-debug-mode warnings.
"""

from __future__ import annotations

import collections
import warnings

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.stats.host import count_host_transfers


def _reads(pipe, steps: int, debugger: DiffusionModelDebugger | None) -> count_host_transfers:
    def call():
        pipe(
            "a photo of a cat",
            num_inference_steps=steps,
            output_type="latent",
            generator=torch.Generator(pipe.device).manual_seed(0),
        )

    if debugger is None:
        call()  # warm-up
        with count_host_transfers() as reads:
            call()
        return reads
    with debugger:
        call()
        with count_host_transfers() as reads:
            call()
    return reads


def _sync_warnings(pipe, steps: int, debugger: DiffusionModelDebugger) -> int | None:
    if pipe.device.type != "cuda":
        return None
    with debugger:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                pipe(
                    "a photo of a cat",
                    num_inference_steps=steps,
                    output_type="latent",
                    generator=torch.Generator(pipe.device).manual_seed(0),
                )
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return len(caught)


def run(pipe, *, steps: int, output_dir: str) -> dict:
    config = DebugConfig(output_dir=output_dir, run_name="bench-transfers")
    debugger = DiffusionModelDebugger(pipe, config)
    short, long = max(2, steps // 2), max(3, steps)
    added, blocking = {}, {}
    for n in (short, long):
        plain, watched = _reads(pipe, n, None), _reads(pipe, n, debugger)
        added[n] = collections.Counter(watched.calls) - collections.Counter(plain.calls)
        blocking[n] = collections.Counter(watched.blocking) - collections.Counter(plain.blocking)
    per_step = (sum(added[long].values()) - sum(added[short].values())) / (long - short)
    blocking_per_step = (sum(blocking[long].values()) - sum(blocking[short].values())) / (long - short)
    return {
        "steps": [short, long],
        "added_reads": {n: dict(c) for n, c in added.items()},
        "added_reads_per_step": per_step,
        "added_blocking_reads_per_step": blocking_per_step,
        "added_reads_once_per_run": sum(added[short].values()) - per_step * short,
        "cuda_sync_warnings_per_run": _sync_warnings(pipe, long, debugger),
    }
