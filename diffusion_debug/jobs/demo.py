"""The demo behind ``diffusion-debug demo``: the tiny built-in pipeline, a clean run, then faults.

Four runs of the tiny SD pipeline (:func:`~diffusion_debug.testing.tiny_pipeline`), each with a
:class:`DiffusionModelDebugger` attached and its own run directory: a clean fp32 run, an Inf
planted in one weight of a UNet conv, an fp16 VAE pushed close to overflow, and a prompt longer
than 77 tokens. After each run the anomalies it adds to the clean run are printed. The Inf run
also saves its faulty pipeline into ``<run_dir>/pipeline`` (named in ``invocation.json``, so the
report's replay command carries ``--model``) and replays its repro bundle on it: the replay names
the conv that produced the Inf. At the end, the path of each ``report.html``.

Limits: the weights are random, so the clean run already reports latent drift (the demo says so)
and the images are noise. Runs on the CPU, one scenario after the other.
"""

from __future__ import annotations

import contextlib
import io
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from ..config import DebugConfig
from ..diffusion import DiffusionModelDebugger
from ..record.run_claim import holds_run
from ..testing import plant_overflow, tiny_pipeline

INF_MODULE = "up_blocks.1.resnets.0.conv2"
"""The UNet conv whose weight the Inf scenario breaks (the producer the debugger and the replay name)."""

_PROMPT = "a photo of a cat"
_LONG_PROMPT = "a highly detailed photo of " + ", ".join(["a red cat on a blue sofa"] * 12)


def _clean(pipe):
    return _PROMPT, None


def _unet_weight_inf(pipe):
    # in a weight, not a hook: the fault travels with the saved pipeline, so the bundle replays it
    weight = pipe.unet.get_submodule(INF_MODULE).weight
    with torch.no_grad():
        weight[(0,) * weight.dim()] = float("inf")
    return _PROMPT, None


def _vae_fp16(pipe):
    return _PROMPT, plant_overflow(pipe.vae.get_submodule("decoder.up_blocks.0.resnets.0.conv2"), fraction=0.7)


def _long_prompt(pipe):
    return _LONG_PROMPT, None


# (name, pipeline dtype, plant): plant(pipe) -> (prompt, fault handle or None)
SCENARIOS = (
    ("clean run", "float32", _clean),
    ("Inf in a UNet weight", "float32", _unet_weight_inf),
    ("fp16 VAE close to overflow", "float16", _vae_fp16),
    ("prompt over 77 tokens", "float32", _long_prompt),
)


def _anomaly_block(anomalies, title: str) -> str:
    from ..report.terminal import anomaly_table

    count = f"{len(anomalies)} anomal{'y' if len(anomalies) == 1 else 'ies'}"
    return f"\n{title}\n{count}" + (f"\n{anomaly_table(anomalies)}" if anomalies else "")


def _save_for_replay(pipe: Any, run_dir: Path, dtype: str) -> Path:
    """Save the faulty pipeline into ``<run_dir>/pipeline`` (safetensors) and name it in the run's
    ``invocation.json``, as ``diffusion-debug run`` does: bundles hold no weights."""
    from ..record import dumps, write_atomic

    pipeline_dir = (run_dir / "pipeline").resolve()
    pipe.save_pretrained(pipeline_dir, safe_serialization=True)
    used = {"command": "demo", "model": str(pipeline_dir), "kind": None, "dtype": dtype}
    write_atomic(run_dir / "invocation.json", dumps(used, indent=1))
    return pipeline_dir


def _replay(run_dir: Path, anomalies, pipeline_dir: Path) -> str:
    """The report's replay command for the run's first bundle, then what that replay printed."""
    from ..record import load_run
    from ..report.html import replay_command
    from .replay import replay_bundle

    bundle = next((a.details["bundle"] for a in anomalies if a.details.get("bundle")), None)
    if bundle is None:
        return "replay: the run wrote no repro bundle"
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            replay_bundle(run_dir / bundle, model=str(pipeline_dir))
    except Exception as error:  # the demo goes on to its next scenario
        return f"replay: failed: {type(error).__name__}: {error}"
    return f"replay: {replay_command(load_run(run_dir), bundle)}\n{printed.getvalue().rstrip()}"


def run_demo(
    output_dir: str | Path = "debug_output", *, steps: int = 8, level: str | None = None, progress: bool = True
) -> list[Path]:
    """Run the demo's scenarios, print what each one finds, and return their run directories.

    Args:
        output_dir: where the run directories go (``demo-1-clean``, ``demo-2-inf``, ...): each
            replaces the previous demo's run of its name (a run directory holds one run).
        steps: denoising steps per run.
        level: the debug level (default ``"advanced"``).
        progress: a bar over the scenarios on stderr (the CLI: only at a terminal, without --quiet).

    Returns:
        The run directories, in the order of :data:`SCENARIOS`.
    """
    from tqdm.auto import tqdm

    from ..report import write_html

    run_dirs: list[Path] = []
    baseline: set[tuple[str, str, str]] = set()
    bar = tqdm(SCENARIOS, desc="demo", unit="scenario", file=sys.stderr, disable=not progress)
    for index, (name, dtype, plant) in enumerate(bar, 1):
        bar.set_postfix_str(name)
        pipe = tiny_pipeline("sd", dtype=getattr(torch, dtype))
        prompt, fault = plant(pipe)
        run_name = f"demo-{index}-{name.split()[0].lower()}"
        if holds_run(Path(output_dir) / run_name):  # the previous demo's: the demo's paths stay the same
            shutil.rmtree(Path(output_dir) / run_name)
        config = DebugConfig(level=level or "advanced", output_dir=output_dir, log_level="error", run_name=run_name)
        debugger = DiffusionModelDebugger(pipe, config)
        # the block printed after each run lists its anomalies; a log line during the next run would
        # land under the previous run's block (the Inf run's error under "[1/4] clean run")
        ours = logging.getLogger("diffusion_debug")
        level = ours.level
        ours.setLevel(logging.CRITICAL)
        try:
            with debugger:
                pipe(prompt, num_inference_steps=steps, generator=torch.Generator().manual_seed(0))
        finally:
            ours.setLevel(level)
            debugger.close()  # report() still works: the record is kept
            if fault is not None:
                fault.remove()
        report = debugger.report()
        run_dir = Path(report.save(html=False))
        pipeline_dir = _save_for_replay(pipe, run_dir, dtype) if plant is _unet_weight_inf else None
        write_html(run_dir)  # after invocation.json: the replay command carries --model
        keys = [(a.kind, a.component, a.module) for a in report.anomalies]
        if index == 1:
            baseline = set(keys)
            title = f"[{index}/{len(SCENARIOS)}] {name} (random weights, so the latents drift; the debugger says so)"
            shown = report.anomalies
        else:
            title = f"[{index}/{len(SCENARIOS)}] {name}: what it adds to the clean run"
            shown = [a for a, key in zip(report.anomalies, keys) if key not in baseline]
        block = _anomaly_block(shown, title)
        if pipeline_dir is not None:
            block += "\n" + _replay(run_dir, report.anomalies, pipeline_dir)
        tqdm.write(block)
        run_dirs.append(run_dir)
    bar.close()
    print("\nHTML reports:")
    for (name, _, _), run_dir in zip(SCENARIOS, run_dirs):
        print(f"  {name:36} {run_dir / 'report.html'}")
    return run_dirs
