"""Localisation cost: from a planted Inf in an inner UNet module to the named producer, as a
multiple of one denoising step (the replay with full probes is the extra work)."""

from __future__ import annotations

import math
import statistics
import time

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger

TARGET = "up_blocks.1.resnets.0.conv2"


def run(pipe, *, steps: int, repeats: int, output_dir: str, at_step: int = 1) -> dict:
    module = pipe.unet.get_submodule(TARGET)
    calls = {"n": 0}
    cfg_batches = 1  # the UNet is called once per step (CFG runs as one batch of 2)

    def plant(_, __, output):
        calls["n"] += 1
        if calls["n"] > at_step * cfg_batches:
            return torch.full_like(output, math.inf)

    def one_run(faulty: bool) -> tuple[float, list]:
        calls["n"] = 0
        handle = module.register_forward_hook(plant) if faulty else None
        config = DebugConfig(output_dir=output_dir)
        try:
            with DiffusionModelDebugger(pipe, config) as dbg:
                start = time.perf_counter()
                pipe(
                    "a cat",
                    num_inference_steps=steps,
                    output_type="latent",
                    generator=torch.Generator().manual_seed(0),
                )
                seconds = time.perf_counter() - start
            return seconds, dbg.report().anomalies
        finally:
            if handle is not None:
                handle.remove()

    clean, faulty, named = [], [], []
    for _ in range(repeats):
        clean.append(one_run(False)[0])
        seconds, anomalies = one_run(True)
        faulty.append(seconds)
        found = [a for a in anomalies if a.kind == "nonfinite" and a.component == "unet"]
        named.append(found[0].module if found else None)
    step_time = statistics.median(clean) / steps
    extra = statistics.median(faulty) - statistics.median(clean)
    return {
        "planted": f"unet {TARGET} from step {at_step}",
        "named": named[-1],
        "correct": all(n == TARGET for n in named),
        "step_seconds": step_time,
        "localisation_seconds": max(extra, 0.0),
        "localisation_in_steps": max(extra, 0.0) / step_time,
    }
