"""Training overhead: one UNet training step (noise-prediction loss, backward, AdamW) plain vs
with TrainingDebugger (the default config, events streamed) vs under torch.autograd.detect_anomaly(check_nan=True)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from diffusion_debug import DebugConfig, TrainingDebugger

from .harness import Comparison, interleaved


def run(unet: torch.nn.Module, *, repeats: int, output_dir: str, batch: int = 2, size: int = 32) -> Comparison:
    unet.train()
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(batch, unet.config.in_channels, size, size, generator=g)
    noise = torch.randn(latents.shape, generator=g)
    context = torch.randn(batch, 8, unet.config.cross_attention_dim, generator=g)
    timesteps = torch.randint(0, 1000, (batch,), generator=g)
    state = {"step": 0}

    def step(monitor=None):
        loss = F.mse_loss(unet(latents + noise, timesteps, encoder_hidden_states=context).sample, noise)
        loss.backward()
        if monitor is not None:
            monitor(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1

    tdbg = TrainingDebugger(unet, config=DebugConfig(output_dir=output_dir, run_name="bench-training"))

    def debugged():
        step(
            lambda loss: tdbg.monitor_training_step(loss, optimizer=optimizer, step=state["step"], timesteps=timesteps)
        )

    def anomaly_mode():
        with torch.autograd.detect_anomaly(check_nan=True):
            step()

    params = sum(p.numel() for p in unet.parameters()) / 1e6
    return interleaved(
        f"training step, UNet {params:.1f}M, batch {batch}, {size}x{size}",
        {"plain": step, "TrainingDebugger default": debugged, "torch.autograd.detect_anomaly": anomaly_mode},
        repeats=repeats,
    )
