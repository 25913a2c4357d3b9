"""Fine-tuning stacks beyond ``test_user_training_stacks``, each trained twice on a fresh copy of the
tiny SD UNet, with and without the debugger: the losses and the final weights are bitwise the same,
the steps before the planted fault are quiet (no warning or error, no ``debugger_error``), and the
fault is the first error, named at its origin (kind, module, step). Stacks: a GradScaler (fp16
autocast on the CPU) whose loss is inf at a known step (the scaler skips it)."""

import copy
import math

import torch

from diffusion_debug import DebugConfig, TrainingDebugger
from diffusion_debug.record import severity_rank


def _batch(unet, step):
    generator = torch.Generator().manual_seed(step)
    sample = torch.randn(2, unet.config.in_channels, 8, 8, generator=generator)
    context = torch.randn(2, 4, unet.config.cross_attention_dim, generator=generator)
    noise = torch.randn(sample.shape, generator=generator)
    return sample, torch.tensor([100, 700]), context, noise


def _train(unet, steps, debugger, *, step_loss, scaler=None):
    """A plain AdamW loop; ``step_loss(step, unet)`` the step's loss. Returns the debugger (closed),
    every step's loss and the final weights."""
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    tdbg = debugger(unet) if debugger is not None else None
    losses = []
    for step in range(steps):
        loss = step_loss(step, unet)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        losses.append(loss.item())
        if tdbg is not None:
            tdbg.monitor_training_step(
                loss, optimizer=optimizer, step=step, timesteps=torch.tensor([100, 700]), scaler=scaler
            )
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    if tdbg is not None:
        tdbg.close()
    return tdbg, losses, {k: v.detach().clone() for k, v in unet.state_dict().items()}


def _twice(tiny_unet, tmp_path, steps, **loop):
    """The stack unwatched then watched (``loop["setup"](unet)`` first, ``loop["scaler"]()`` a fresh
    scaler each run); asserts the runs are bitwise the same. Returns the debugger."""
    runs = []
    for watch in (False, True):
        unet = copy.deepcopy(tiny_unet).train()
        loop.get("setup", lambda unet: None)(unet)
        debugger = (
            (lambda model: TrainingDebugger(model, config=DebugConfig(output_dir=str(tmp_path), log_level="error")))
            if watch
            else None
        )
        scaler = loop["scaler"]() if "scaler" in loop else None
        runs.append(_train(unet, steps, debugger, step_loss=loop["step_loss"], scaler=scaler))
    (_, reference_losses, reference), (tdbg, losses, weights) = runs
    assert [str(x) for x in losses] == [str(x) for x in reference_losses]  # nan and inf compared too
    assert [k for k in reference if not torch.equal(reference[k].nan_to_num(), weights[k].nan_to_num())] == []
    assert [a for a in tdbg.report().anomalies if a.kind == "debugger_error"] == []
    return tdbg


def _serious(tdbg):
    return [a for a in tdbg.report().anomalies if severity_rank(a.severity) >= severity_rank("warning")]


def _mse(step, unet, *, dtype=None, inf_at=None):
    sample, timesteps, context, noise = _batch(unet, step)
    if dtype is None:
        pred = unet(sample, timesteps, context).sample
    else:
        with torch.autocast("cpu", dtype=dtype):
            pred = unet(sample, timesteps, context).sample
    loss = ((pred.float() - noise) ** 2).mean()
    return loss * math.inf if step == inf_at else loss


def test_fp16_grad_scaler_a_step_whose_loss_is_inf_is_named_there_and_skipped(_tiny_unet, tmp_path):
    tdbg = _twice(
        _tiny_unet,
        tmp_path,
        4,
        step_loss=lambda step, unet: _mse(step, unet, dtype=torch.float16, inf_at=2),
        scaler=lambda: torch.amp.GradScaler("cpu", init_scale=2.0**8),
    )
    serious = _serious(tdbg)
    assert [(a.kind, a.module, a.step, a.severity) for a in serious] == [("nonfinite_loss", "", 2, "error")]
    skipped = [a for a in tdbg.report().anomalies if a.kind == "skipped_step"]
    assert [(a.step, a.details["reason"]) for a in skipped] == [(2, "grad_scaler")]
