"""A compiled denoiser: the plain compiled call vs the same call watched by the debugger
(default config), interleaved, with dynamo's graph-break and graph counts before and after."""

from __future__ import annotations

import copy

import torch
from torch._dynamo.utils import counters

from diffusion_debug import DebugConfig, DiffusionModelDebugger

from .harness import Comparison, interleaved


def run(
    pipe,
    *,
    steps: int,
    repeats: int,
    output_dir: str,
    backend: str = "inductor",
    clock: str = "wall",
    title: str = "compiled UNet",
) -> tuple[Comparison, dict]:
    """``pipe.unet`` compiled with ``torch.compile(..., backend)``; returns the timing (by ``clock``,
    :func:`~benchmarks.harness.interleaved`'s; ``title`` names the pipeline) and the dynamo counts
    added by the watched calls (both must stay 0): graph breaks, and graphs compiled after the plain
    call's (a recompile, or a break's second graph)."""
    pipe = copy.copy(pipe)  # a shallow copy: the caller's pipeline keeps its eager UNet
    pipe.unet = torch.compile(pipe.unet, backend=backend)
    kwargs = dict(num_inference_steps=steps, output_type="latent")

    def plain():
        pipe("a photo of a cat", generator=torch.Generator(pipe.device).manual_seed(0), **kwargs)

    config = DebugConfig(output_dir=output_dir, run_name="bench-compiled")
    debugger = DiffusionModelDebugger(pipe, config)

    def watched():
        with debugger:
            plain()

    plain()  # compiles
    before = (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"])
    result = interleaved(
        f"{title} ({backend}), {steps} steps",
        {"plain compiled": plain, "watched": watched},
        repeats=repeats,
        clock=clock,
    )
    after = (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"])
    debugger.close()
    return result, {"added_graph_breaks": after[0] - before[0], "added_graphs": after[1] - before[1]}
