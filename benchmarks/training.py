"""Training overhead: one UNet training step (noise-prediction loss, backward, AdamW) plain vs
with TrainingDebugger (the default config, events streamed) vs under torch.autograd.detect_anomaly(check_nan=True).

:func:`run` is the plain PyTorch loop; :class:`AccelerateStep` is the step under Accelerate that
``benchmarks.gpu``'s training case (SD1.5's UNet at real size) and ``benchmarks.user_path``'s
(its CPU proxy) both time, with :func:`plain_vs_watched` (a plain step has no debugger attached)
and :func:`added_ops`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from diffusion_debug import DebugConfig, TrainingDebugger

from .harness import CLOCKS, Comparison, interleaved, warm_up_rounds


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


# -- a UNet training step under Accelerate: benchmarks.gpu's training case and benchmarks.user_path's proxy


@dataclass
class AccelerateStep:
    """One diffusion training step of ``model`` under ``accelerator``: the noise-prediction loss in
    autocast, ``accelerator.backward``, with ``max_grad_norm`` the clip every diffusers training
    script makes (``if accelerator.sync_gradients: accelerator.clip_grad_norm_(params,
    args.max_grad_norm)``; None: no clip), AdamW. Called with a debugger, it is monitored between
    the backward and the clip, as the README's lines for ``train_text_to_image.py`` place it."""

    accelerator: Any
    model: nn.Module
    optimizer: Any
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    """The latents, the noise, the text context and the timesteps (every step the same)."""
    max_grad_norm: float | None = None
    clipped_norm: Any = None
    """What the last step's ``clip_grad_norm_`` returned (None: no clip)."""

    def __call__(self, debugger: TrainingDebugger | None = None) -> None:
        latents, noise, context, timesteps = self.inputs
        with self.accelerator.autocast():
            prediction = self.model(latents + noise, timesteps, encoder_hidden_states=context).sample
            loss = F.mse_loss(prediction.float(), noise)
        self.accelerator.backward(loss)
        if debugger is not None:
            debugger.monitor_training_step(loss, optimizer=self.optimizer, timesteps=timesteps)
        if self.max_grad_norm is not None and self.accelerator.sync_gradients:
            self.clipped_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def accelerate_steps(
    unets: list[nn.Module],
    precision: str,
    *,
    device: str,
    size: int,
    context_len: int,
    max_grad_norm: float | None = None,
) -> list[AccelerateStep]:
    """One :class:`AccelerateStep` per UNet (each with its own AdamW and its own Accelerator, with
    mixed precision ``precision``: a plain twin's clip and GradScaler are none of the watched
    one's; the same inputs, batch 2, ``size`` x ``size`` latents, ``context_len`` tokens), clipping
    at ``max_grad_norm`` (None: no clip). Call :func:`reset_accelerate` when done.

    ``"fp16"`` on a CPU: Accelerate's CPU fp16 is no mixed precision at all (no autocast, no
    scaler), so the step takes a GPU's path by hand, fp16 autocast on the CPU and a
    ``torch.amp.GradScaler("cpu")`` that Accelerate's ``backward`` and optimizers use as they use
    the CUDA one. ``"bf16"`` on a CPU is Accelerate's own CPU path (bf16 autocast, no scaler)."""
    from accelerate import Accelerator

    reset_accelerate()  # a second Accelerator with another precision in one process
    accelerators, prepared = [], []
    for unet in unets:
        accelerator = Accelerator(mixed_precision=precision, cpu=device == "cpu")
        if precision == "fp16" and device == "cpu":
            accelerator.native_amp, accelerator.scaler = True, torch.amp.GradScaler("cpu")
        accelerators.append(accelerator)
        prepared.append(accelerator.prepare(unet, torch.optim.AdamW(unet.parameters(), lr=1e-6)))
    config = accelerators[0].unwrap_model(prepared[0][0]).config
    g = torch.Generator(device).manual_seed(0)
    shape = (2, config.in_channels, size, size)
    inputs = (
        torch.randn(shape, generator=g, device=device),
        torch.randn(shape, generator=g, device=device),
        torch.randn(2, context_len, config.cross_attention_dim, generator=g, device=device),
        torch.randint(0, 1000, (2,), generator=g, device=device),
    )
    return [
        AccelerateStep(accelerator, model, optimizer, inputs, max_grad_norm)
        for accelerator, (model, optimizer) in zip(accelerators, prepared)
    ]


def reset_accelerate() -> None:
    """Accelerate's process-wide state forgotten: the process's next Accelerator (another
    precision, a test after this one) starts afresh."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


CLIP = 1.0
"""The ``max_grad_norm`` diffusers' training scripts clip at by default: the user's step clips."""
WATCHED = "TrainingDebugger default"
ANOMALY_MODE = "torch.autograd.detect_anomaly"


def plain_vs_watched(
    title: str,
    steps: list[AccelerateStep],
    debugger: TrainingDebugger,
    *,
    rounds: int,
    warmup: int = 2,
    clock: str = "wall",
    anomaly_mode: bool = False,
) -> Comparison:
    """Plain steps against steps monitored by ``debugger`` (and, with ``anomaly_mode``, plain steps
    under ``torch.autograd.detect_anomaly(check_nan=True)``), interleaved round by round, by
    ``clock`` (synced on CUDA); ``warmup`` rounds first, untimed (the first monitored steps read
    the weights and learn the backward order; the plain cases take one under
    :func:`~benchmarks.harness.smoke_warm_ups`).

    A plain step has no debugger attached: its hooks (the OOM watch's on the model's call, the
    backward order's while they are on) are the watched case's cost. With two steps (twins: the
    same weights and inputs), the first trains the UNet no debugger ever watched and ``debugger``
    watches the second, never re-attached. With one (a model too large to hold twice), the
    debugger is detached for the plain cases and attached again for the watched one, which then
    takes one untimed monitored step first: attaching puts the backward-order hooks on for one
    backward, as a run has them once every ``ORDER_REFRESH`` steps, not every step."""
    now = CLOCKS[clock]
    plain_step, watched_step = steps[0], steps[-1]
    twins = plain_step is not watched_step

    def plain() -> None:
        if not twins:
            debugger.detach()

    def watched() -> None:
        if not debugger.attached:
            debugger.attach()
            watched_step(debugger)

    def under_anomaly_mode() -> None:
        with torch.autograd.detect_anomaly(check_nan=True):
            plain_step()

    cases = {"plain": (plain, plain_step), WATCHED: (watched, lambda: watched_step(debugger))}
    if anomaly_mode:
        cases[ANOMALY_MODE] = (plain, under_anomaly_mode)
    result = Comparison(title, {name: [] for name in cases}, clock)
    # under harness.smoke_warm_ups (checks, not figures) the plain cases warm up once: the watched case's
    # warm-up rounds are the monitored steps it must be past (user_path's: the per-module figures' first)
    plain_warmup = warm_up_rounds(warmup)
    for i in range(warmup + rounds):
        for name, (setup, run) in cases.items():
            if name != WATCHED and plain_warmup <= i < warmup:
                continue
            setup()
            _sync()
            start = now()
            run()
            _sync()
            if i >= warmup:
                result.times[name].append(now() - start)
    return result


def added_ops(steps: list[AccelerateStep], debugger: TrainingDebugger) -> dict[str, int]:
    """Aten ops of one plain step and what monitoring one step adds (the last step is the watched
    one, attached; the first the plain one, as :func:`plain_vs_watched` takes them)."""
    from diffusion_debug.op_count import count_aten_ops

    ops = {}
    for monitor in (False, True):
        if not monitor and steps[0] is steps[-1]:
            debugger.detach()
        elif monitor and not debugger.attached:
            debugger.attach()
            steps[-1](debugger)  # the backward-order hooks' one backward
        with count_aten_ops() as counted:
            if monitor:
                steps[-1](debugger)
            else:
                steps[0]()
        ops[monitor] = sum(counted.counts.values())
    return {"added_ops_per_step": ops[True] - ops[False], "plain_ops_per_step": ops[False]}


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
