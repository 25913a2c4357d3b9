"""Fixed cost of a watched call: a 1-step tiny SD pipeline call, plain vs watched by one
DiffusionModelDebugger reused with ``with dbg:`` (the README's pattern; default config, events
streamed) vs one attached once around all the calls (a serving loop: ``dbg.attach()`` or one
``with dbg:`` around many requests) vs a debugger made per call, interleaved; the added
milliseconds are the median of the per-round differences, with its 95% interval
(:meth:`~benchmarks.harness.Comparison.added_ms_interval`). At one step the pipeline itself is
~25 ms, so what the debugger adds is its fixed cost per call (attach, bookkeeping, events), which
1-step and served pipelines pay on every request (DESIGN: <= 5 ms for the reused debugger).

The attached-once case runs a twin of the pipeline (``copy.deepcopy``: the same weights, its own
modules), watched from before the warm-up to after the last round: a plain call of the same
pipeline object would run under that debugger's hooks (they sit on the shared modules), so the
plain, reused and per-call cases run the original, which no debugger watches between calls."""

from __future__ import annotations

import copy
from typing import Callable

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger

from .harness import Comparison, interleaved

REUSED = "reused debugger (with dbg:)"
PER_CALL = "debugger made per call"
ATTACHED = "one attach, many calls"


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

    served = copy.deepcopy(pipe)  # the attached-once case's twin, copied before any debugger touches ``pipe``

    def called(target) -> Callable[[], None]:
        def case() -> None:
            target(
                "a photo of a cat",
                num_inference_steps=1,
                output_type=output_type,
                generator=torch.Generator(target.device).manual_seed(0),
                **call,
            )

        return case

    plain, served_call = called(pipe), called(served)
    reused = DiffusionModelDebugger(pipe, DebugConfig(output_dir=output_dir))
    serving = DiffusionModelDebugger(served, DebugConfig(output_dir=output_dir))

    def watched_reused():
        with reused:
            plain()

    def watched_new():
        with DiffusionModelDebugger(pipe, DebugConfig(output_dir=output_dir)):
            plain()

    try:
        serving.attach()
        return interleaved(
            f"1-step {label} call, output_type={output_type!r}",
            {"plain": plain, REUSED: watched_reused, ATTACHED: served_call, PER_CALL: watched_new},
            repeats=repeats,
            warmup=3,
            clock=clock,
        )
    finally:
        reused.close()
        serving.close()


def markdown(results: list[Comparison]) -> str:
    """One row per call kind: medians, and the ms each watched case adds (median of the per-round
    differences, and its 95% interval: a budget is met only where the interval is under it)."""
    unit = "CPU ms" if results and results[0].clock == "cpu" else "ms"
    lines = [
        f"| call | plain {unit} | reused: ms added | reused: paired ratio | reused: 95% interval of ms added "
        f"| {ATTACHED}: ms added (95% interval) | per call: ms added | per call: paired ratio |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        attached = f"{r.added_ms(ATTACHED):.1f} ({_interval(r, ATTACHED)})" if ATTACHED in r.times else "n/a"
        lines.append(
            f"| {r.title} | {1e3 * r.median('plain'):.1f} | {r.added_ms(REUSED):.1f} | {r.ratio(REUSED):.3f}x "
            f"| {_interval(r, REUSED)} | {attached} | {r.added_ms(PER_CALL):.1f} | {r.ratio(PER_CALL):.3f}x |"
        )
    return "\n".join(lines)


def _interval(result: Comparison, case: str) -> str:
    low, high = result.added_ms_interval(case)
    return f"{low:.1f} to {high:.1f}"
