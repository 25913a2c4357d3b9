"""Helpers of the float16 autocast tests (test_fp16_autocast*.py): a CPU float16 autocast region, a module's
float16 output under it scaled to a share of float16's largest value, the anomalies found, the UNet's ``to_out``
Inf a replay test starts from."""

from __future__ import annotations

import contextlib
from contextlib import contextmanager

import torch
from diffusion_helpers import run, scaled

from diffusion_debug import DebugConfig, DiffusionModelDebugger

UNET_ATTENTION_OUT = "up_blocks.1.attentions.1.transformer_blocks.0.attn1.to_out.0"
REPLAYED = "sentinel -> replay with full probes"
FP16_MAX = torch.finfo(torch.float16).max


def autocast():
    return torch.autocast("cpu", dtype=torch.float16)


def cfg(tmp_path) -> DebugConfig:
    return DebugConfig(output_dir=str(tmp_path), log_level="error")


def found(dbg, run_number=None):
    """``(kind, severity, component, module, step)`` of every anomaly but the tiny pipeline's static scheduler
    warning (3 'leading' steps), of the debugger's ``run_number``-th run where given."""
    return [
        (a.kind, a.severity, a.component, a.module, a.step)
        for a in dbg.report().anomalies
        if a.kind != "scheduler_config" and (run_number is None or a.details.get("run") == run_number)
    ]


def peak_under_autocast(pipe, module, steps, under_autocast=True) -> float:
    """The largest |output| of ``module`` in a clean autocast call of ``pipe`` (its planted scale is found from it;
    ``under_autocast`` False: a call outside autocast, a float16 pipeline's)."""
    peaks = []
    handle = module.register_forward_hook(lambda _m, _a, out: peaks.append(out.abs().max().item()))
    try:
        with autocast() if under_autocast else contextlib.nullcontext():
            run(pipe, steps=steps, output_type="latent")
    finally:
        handle.remove()
    return max(peaks)


def near_max(pipe, component, name, fraction, steps=3, under_autocast=True):
    """``component.name`` scaled so that its float16 output under autocast (or outside: ``under_autocast``) peaks at
    ``fraction`` of 65504."""
    module = getattr(pipe, component).get_submodule(name)
    return scaled(module, fraction * FP16_MAX / peak_under_autocast(pipe, module, steps, under_autocast))


@contextmanager
def to_out_inf(pipe, tmp_path, under_autocast=True):
    """The replay tests' one set-up: ``pipe``'s UNet ``to_out`` at 4x float16's max (its weights put back after), a
    2-step latent call watched under float16 autocast (or outside it: a float16 pipeline's), whose one error is its
    Inf at step 0. Yields ``(the debugger, that error)``; the debugger closed after."""
    steps = 3 if under_autocast else 2  # (the peak each test read its scale from)
    with near_max(pipe, "unet", UNET_ATTENTION_OUT, 4.0, steps, under_autocast):
        dbg = DiffusionModelDebugger(pipe, cfg(tmp_path))
        try:
            with dbg, autocast() if under_autocast else contextlib.nullcontext():
                run(pipe, steps=2, output_type="latent")
            (error,) = [a for a in dbg.report().anomalies if a.severity == "error"]
            yield dbg, error
        finally:
            dbg.close()
