"""Probes alone on the mid-size UNet: one forward (batch 2, 32x32 latents), plain vs sentinel
probes vs full probes (each with its one collect per call)."""

from __future__ import annotations

import torch

from diffusion_debug.probes import Probe

from .harness import Comparison, interleaved
from .models import mid_unet


def run(unet: torch.nn.Module | None = None, repeats: int = 15, size: int = 32) -> Comparison:
    unet = (unet or mid_unet()).eval()
    sample = torch.randn(2, 4, size, size, generator=torch.Generator().manual_seed(0))
    context = torch.randn(2, 8, unet.config.cross_attention_dim, generator=torch.Generator().manual_seed(1))

    def forward():
        with torch.no_grad():
            return unet(sample, 500, encoder_hidden_states=context).sample

    def probed(granularity: str):
        probe = Probe(unet, granularity)

        def case():
            with probe.attach():
                forward()
                probe.collect()

        return case

    return interleaved(
        f"UNet forward, {sum(p.numel() for p in unet.parameters()) / 1e6:.1f}M params, batch 2, {size}x{size}",
        {"plain": forward, "sentinel probes": probed("sentinel"), "full probes": probed("full")},
        repeats=repeats,
    )


if __name__ == "__main__":
    print(run().markdown())
