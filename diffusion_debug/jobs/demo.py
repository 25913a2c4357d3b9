"""The demo behind ``diffusion-debug demo``: the tiny built-in pipeline, a clean run, then faults.

Four runs of the tiny SD pipeline (:func:`~diffusion_debug.testing.tiny_pipeline`), each with a
:class:`DiffusionModelDebugger` attached and its own run directory: a clean fp32 run, an Inf
planted in a UNet block from step 3 on, an fp16 VAE pushed close to overflow, and a prompt longer
than 77 tokens. After each run the anomalies it adds to the clean run are printed; at the end, the
path of each ``report.html``.

Limits: the weights are random, so the clean run already reports latent drift (the demo says so)
and the images are noise. Runs on the CPU, one scenario after the other.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..config import DebugConfig
from ..diffusion import DiffusionModelDebugger
from ..testing import plant_nonfinite, plant_overflow, tiny_pipeline

_PROMPT = "a photo of a cat"
_LONG_PROMPT = "a highly detailed photo of " + ", ".join(["a red cat on a blue sofa"] * 12)


def _clean(pipe):
    return _PROMPT, None


def _unet_inf(pipe):
    return _PROMPT, plant_nonfinite(pipe.unet.get_submodule("up_blocks.1.resnets.0.conv2"), from_call=3)


def _vae_fp16(pipe):
    return _PROMPT, plant_overflow(pipe.vae.get_submodule("decoder.up_blocks.0.resnets.0.conv2"), fraction=0.7)


def _long_prompt(pipe):
    return _LONG_PROMPT, None


# (name, pipeline dtype, plant): plant(pipe) -> (prompt, fault handle or None)
SCENARIOS = (
    ("clean run", "float32", _clean),
    ("Inf in a UNet block from step 3 on", "float32", _unet_inf),
    ("fp16 VAE close to overflow", "float16", _vae_fp16),
    ("prompt over 77 tokens", "float32", _long_prompt),
)


def _anomaly_block(anomalies, title: str) -> str:
    from ..report.terminal import anomaly_table

    count = f"{len(anomalies)} anomal{'y' if len(anomalies) == 1 else 'ies'}"
    return f"\n{title}\n{count}" + (f"\n{anomaly_table(anomalies)}" if anomalies else "")


def run_demo(output_dir: str | Path = "debug_output", *, steps: int = 8, level: str | None = None) -> list[Path]:
    """Run the demo's scenarios, print what each one finds, and return their run directories.

    Args:
        output_dir: where the run directories go (``demo-1-clean``, ``demo-2-inf``, ...; an
            existing one of that name is reused).
        steps: denoising steps per run.
        level: the debug level (default ``"advanced"``).

    Returns:
        The run directories, in the order of :data:`SCENARIOS`.
    """
    from tqdm.auto import tqdm

    run_dirs: list[Path] = []
    baseline: set[tuple[str, str, str]] = set()
    progress = tqdm(SCENARIOS, desc="demo", unit="scenario", file=sys.stderr)
    for index, (name, dtype, plant) in enumerate(progress, 1):
        progress.set_postfix_str(name)
        pipe = tiny_pipeline("sd", dtype=getattr(torch, dtype))
        prompt, fault = plant(pipe)
        config = DebugConfig(
            level=level or "advanced",
            output_dir=output_dir,
            log_level="error",
            run_name=f"demo-{index}-{name.split()[0].lower()}",
        )
        debugger = DiffusionModelDebugger(pipe, config)
        try:
            with debugger:
                pipe(prompt, num_inference_steps=steps, generator=torch.Generator().manual_seed(0))
        finally:
            if fault is not None:
                fault.remove()
        report = debugger.report()
        run_dir = Path(report.save())
        keys = [(a.kind, a.component, a.module) for a in report.anomalies]
        if index == 1:
            baseline = set(keys)
            title = f"[{index}/{len(SCENARIOS)}] {name} (random weights, so the latents drift; the debugger says so)"
            shown = report.anomalies
        else:
            title = f"[{index}/{len(SCENARIOS)}] {name}: what it adds to the clean run"
            shown = [a for a, key in zip(report.anomalies, keys) if key not in baseline]
        tqdm.write(_anomaly_block(shown, title))
        run_dirs.append(run_dir)
    progress.close()
    print("\nHTML reports:")
    for (name, _, _), run_dir in zip(SCENARIOS, run_dirs):
        print(f"  {name:36} {run_dir / 'report.html'}")
    return run_dirs
