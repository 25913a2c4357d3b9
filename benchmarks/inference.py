"""Inference overhead: the plain pipeline vs DiffusionModelDebugger (default config: sentinel
probes; and the default config with full probes on every module) vs transformers'
DebugUnderflowOverflow on the denoiser, in one process, interleaved."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger

from .harness import Comparison, interleaved


@contextmanager
def underflow_overflow(model: torch.nn.Module):
    """transformers' DebugUnderflowOverflow, which keeps no handles: remove its hooks by
    comparing each module's hook dict before and after."""
    from transformers.debug_utils import DebugUnderflowOverflow

    before = {m: set(m._forward_hooks) for m in model.modules()}
    DebugUnderflowOverflow(model)
    try:
        yield
    finally:
        for module, keys in before.items():
            for key in set(module._forward_hooks) - keys:
                del module._forward_hooks[key]


def run(pipe, *, steps: int, repeats: int, output_dir: str, size: int | None = None) -> Comparison:
    kwargs = dict(num_inference_steps=steps, output_type="latent")
    if size:
        kwargs.update(height=size, width=size)

    def plain():
        pipe("a photo of a cat", generator=torch.Generator(pipe.device).manual_seed(0), **kwargs)

    def debugged(probes: str) -> Callable[[], None]:
        # the user's default config (events streamed, warnings logged), with only the probe
        # granularity changed (level "extreme" would also decode previews with the VAE, which is
        # not probe cost)
        config = DebugConfig(probes=probes, output_dir=output_dir)

        def case():
            with DiffusionModelDebugger(pipe, config):
                plain()

        return case

    def transformers_tool():
        with underflow_overflow(pipe.unet):
            plain()

    params = sum(p.numel() for p in pipe.unet.parameters()) / 1e6
    return interleaved(
        f"pipeline, UNet {params:.1f}M, {steps} steps (CFG)",
        {
            "plain": plain,
            "debugger default (sentinel)": debugged("sentinel"),
            "debugger, full probes": debugged("full"),
            "transformers DebugUnderflowOverflow": transformers_tool,
        },
        repeats=repeats,
    )
