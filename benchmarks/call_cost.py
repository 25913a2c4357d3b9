"""Fixed cost of a watched call: a 1-step tiny SD pipeline call, plain vs watched by one
DiffusionModelDebugger reused with ``with dbg:`` (the README's pattern; default config, events
streamed) vs a debugger made per call, interleaved; the added milliseconds are the median of the
per-round differences. At one step the pipeline itself is ~25 ms, so what the debugger adds is its
fixed cost per call (attach, bookkeeping, events), which 1-step and served pipelines pay on every
request (DESIGN: <= 5 ms for the reused debugger)."""

from __future__ import annotations

import copy

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger

from .harness import Comparison, interleaved

REUSED = "reused debugger (with dbg:)"
PER_CALL = "debugger made per call"


def one_step(pipe):
    """``pipe`` (a shallow copy) with ``timestep_spacing="trailing"``, as 1-step pipelines ship, and
    predicting v: a clean call's fixed cost is what is timed and counted, not a warning's. With the
    tiny pipeline's "leading" the one step starts at t=1, and with its epsilon prediction its random
    UNet makes latents 15x the noise level at t=999: the debugger rightly warns on every call
    (``latent_divergence``), as the SD1.5-shaped proxy's epsilon twin does (benchmarks.models)."""
    pipe = copy.copy(pipe)
    config = pipe.scheduler.config
    pipe.scheduler = type(pipe.scheduler).from_config(
        config, timestep_spacing="trailing", prediction_type="v_prediction"
    )
    return pipe


def run(
    pipe,
    *,
    repeats: int,
    output_dir: str,
    output_type: str = "latent",
    label: str = "tiny SD",
    clock: str = "wall",
    **call: object,
) -> Comparison:
    """``pipe`` is used as given: pass it through :func:`one_step` first. ``label`` names the
    pipeline in the title, ``clock`` is :func:`~benchmarks.harness.interleaved`'s, ``call`` more
    arguments of the call (``guidance_scale=0.0``: no CFG)."""

    def plain():
        pipe(
            "a photo of a cat",
            num_inference_steps=1,
            output_type=output_type,
            generator=torch.Generator(pipe.device).manual_seed(0),
            **call,
        )

    reused = DiffusionModelDebugger(pipe, DebugConfig(output_dir=output_dir))

    def watched_reused():
        with reused:
            plain()

    def watched_new():
        with DiffusionModelDebugger(pipe, DebugConfig(output_dir=output_dir)):
            plain()

    try:
        return interleaved(
            f"1-step {label} call, output_type={output_type!r}",
            {"plain": plain, REUSED: watched_reused, PER_CALL: watched_new},
            repeats=repeats,
            warmup=3,
            clock=clock,
        )
    finally:
        reused.close()


def markdown(results: list[Comparison]) -> str:
    """One row per call kind: medians, and the ms each watched case adds (median of the per-round
    differences)."""
    unit = "CPU ms" if results and results[0].clock == "cpu" else "ms"
    lines = [
        f"| call | plain {unit} | reused: ms added | reused: paired ratio | per call: ms added "
        "| per call: paired ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.title} | {1e3 * r.median('plain'):.1f} | {r.added_ms(REUSED):.1f} | {r.ratio(REUSED):.3f}x "
            f"| {r.added_ms(PER_CALL):.1f} | {r.ratio(PER_CALL):.3f}x |"
        )
    return "\n".join(lines)
