"""Aten ops the debuggers add per denoising step and per training step: a deterministic count.

At real size on a GPU the pipeline is launch-bound, so every op the debugger adds costs wall time
(DESIGN.md's budget: at most 25 added ops per denoising step in default mode on the tiny
pipeline). Counted with ``diffusion_debug.op_count`` (a TorchDispatchMode; views excluded).

Per step means the difference between a run of ``long`` and one of ``short`` steps, divided by
the step difference: what happens once per pipeline call (prompt encoding, VAE decode, static
checks, the report) cancels out.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from typing import Any, Callable

import torch
import torch.nn.functional as F

from diffusion_debug import DebugConfig, DiffusionModelDebugger, TrainingDebugger
from diffusion_debug.op_count import added_ops, count_aten_ops


def _count(run: Callable[[], Any]) -> Counter[str]:
    with count_aten_ops() as ops:
        run()
    return ops.counts


def _per_step(short: Counter[str], long: Counter[str], steps: int) -> Counter[str]:
    return Counter({op: (long[op] - short.get(op, 0)) / steps for op in long if long[op] != short.get(op, 0)})


def inference_ops(pipe: Any, config: DebugConfig, *, short: int = 2, long: int = 6) -> dict[str, Any]:
    """Ops per denoising step of ``pipe`` plain and under a debugger with ``config``."""

    def call(steps: int) -> Callable[[], Any]:
        return lambda: pipe(
            "a photo of a cat", num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="np"
        )

    def watched(steps: int) -> Callable[[], Any]:
        debugger = DiffusionModelDebugger(pipe, config)

        def run() -> None:
            with debugger:
                call(steps)()
            debugger.close()

        return run

    plain = _per_step(_count(call(short)), _count(call(long)), long - short)
    debugged = _per_step(_count(watched(short)), _count(watched(long)), long - short)
    added = added_ops(debugged, plain)
    return {
        "plain_ops_per_step": sum(plain.values()),
        "added_ops_per_step": sum(debugged.values()) - sum(plain.values()),
        "added_by_op": dict(added.most_common(12)),
    }


def training_ops(model: torch.nn.Module, *, steps: int = 4, size: int = 8, output_dir: str | None = None) -> dict:
    """Ops one ``monitor_training_step`` adds to a UNet training step (default config)."""
    output_dir = output_dir or tempfile.mkdtemp(prefix="diffusion-debug-ops-")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, model.config.in_channels, size, size, generator=g)
    context = torch.randn(2, 8, model.config.cross_attention_dim, generator=g)
    timesteps = torch.randint(0, 1000, (2,), generator=g)
    debugger = TrainingDebugger(model, config=DebugConfig(output_dir=output_dir))
    losses = []
    for _ in range(2):  # warm-up: the first monitored steps read the weights, learn the backward order
        loss = F.mse_loss(model(latents, timesteps, encoder_hidden_states=context).sample, latents)
        loss.backward()
        debugger.monitor_training_step(loss, optimizer=optimizer, timesteps=timesteps)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    counts: Counter[str] = Counter()
    for _ in range(steps):
        loss = F.mse_loss(model(latents, timesteps, encoder_hidden_states=context).sample, latents)
        loss.backward()
        with count_aten_ops() as ops:
            debugger.monitor_training_step(loss, optimizer=optimizer, timesteps=timesteps)
        counts.update(ops.counts)
        losses.append(loss.item())
        optimizer.step()  # a clean run: the weights move (a loop that never steps is one that does not learn)
        optimizer.zero_grad(set_to_none=True)
    debugger.close()
    return {
        "parameters": sum(1 for p in model.parameters() if p.requires_grad),
        "added_ops_per_step": sum(counts.values()) / steps,
        "added_by_op": dict(Counter({k: v / steps for k, v in counts.items()}).most_common(12)),
    }


def run(pipe: Any, *, output_dir: str, smoke: bool = False) -> dict[str, Any]:
    """The op counts of default mode (level advanced) and of level basic, per denoising step, and
    of the default TrainingDebugger per training step (smoke: the default mode only)."""
    out = {"inference_default": inference_ops(pipe, DebugConfig(output_dir=output_dir))}
    if not smoke:
        basic = DebugConfig(level="basic", output_dir=output_dir)
        out["inference_basic"] = inference_ops(pipe, basic)
        out["training_default"] = training_ops(pipe.unet, output_dir=output_dir)
    return out
