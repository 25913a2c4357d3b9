"""Where a reused debugger's 1-step call spends its added time, by part: the thread CPU time spent
inside each of the watched call's parts (attach, the call sites' events, the step's recording,
the VAE output check, the record's writes, detach...), inclusive, per call, over interleaved
plain and watched calls.

Counting Python calls (:func:`~.op_counts.added_python_calls`) says how much code runs; this says
where the time goes, which on a CPU is not the same: a part run right after the pipeline's own
compute finds the caches cold (``cold_attach``: an attach and detach timed right after a plain
call, and right after another one). ``python -m benchmarks.call_parts [fp32|fp16|bf16]
[--rounds N]``; figures go to stdout. Each part is timed by a wrapper put on its function for the
run and taken off after (about a microsecond each call: the figures are an upper bound).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import statistics
import tempfile
import time
from typing import Any, Callable

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger
from diffusion_debug.diffusion.components.sentinel_pace import SENTINEL_EVERY
from diffusion_debug.testing import tiny_pipeline

from .call_cost import one_step

PARTS = (
    ("attach", "diffusion_debug.diffusion.debugger:DiffusionModelDebugger._register"),
    ("  tree walk (TreeMemo.refresh)", "diffusion_debug.diffusion.components.structure:TreeMemo.refresh"),
    ("  call sites' hooks in", "diffusion_debug.diffusion.components.call_sites:CallSiteHooks.register"),
    ("  probes in", "diffusion_debug.diffusion.components.component_probes:ComponentProbes.attach"),
    ("detach", "diffusion_debug.diffusion.debugger:DiffusionModelDebugger._unregister"),
    ("  hooks out", "diffusion_debug.probes.handles:ProbeHandle.remove"),
    ("encode_prompt event", "diffusion_debug.diffusion.steps:StepPipeline.on_encode_prompt"),
    ("set_timesteps event", "diffusion_debug.diffusion.steps:StepPipeline.on_set_timesteps"),
    ("component call starts", "diffusion_debug.diffusion.call_events:CallEvents.on_call_start"),
    ("component call outputs", "diffusion_debug.diffusion.call_events:CallEvents.on_call_output"),
    ("  text encoder / VAE output checks", "diffusion_debug.diffusion.call_events:CallEvents.check_call"),
    ("    measured (ops and host read)", "diffusion_debug.diffusion.call_events:rows.measure_call"),
    ("    probe values taken", "diffusion_debug.diffusion.components.component_probes:ComponentProbes.take"),
    ("encoder calls read together", "diffusion_debug.diffusion.call_events:CallEvents.read_encoded"),
    ("scheduler.step", "diffusion_debug.diffusion.steps:StepPipeline.on_scheduler_step"),
    ("  step queued (ops)", "diffusion_debug.diffusion.steps:rows.queue_step"),
    ("  step read, checked, written", "diffusion_debug.diffusion.steps:StepPipeline._finish"),
    ("busy checks", "diffusion_debug.diffusion.debugger:DiffusionModelDebugger._is_busy"),
    ("record writes (all)", "diffusion_debug.record.run_record:RunRecord._write"),
    ("sentinel block hooks (all)", "diffusion_debug.probes.readings:Probe._read_output"),
    ("fused abs-max flushes (all)", "diffusion_debug.probes.fused:HeldAbsmax.flush"),
    ("  reductions (_absmaxes)", "diffusion_debug.probes.fused:_absmaxes"),
    ("probe takes (all)", "diffusion_debug.probes.readings:Probe.take"),
    ("  held takes", "diffusion_debug.probes.fused:HeldAbsmax.take"),
    ("sentinel hooks in (ForwardHooks)", "diffusion_debug.probes.handles:ForwardHooks.__init__"),
    ("sentinel hooks out (ForwardHooks)", "diffusion_debug.probes.handles:ForwardHooks.remove"),
    ("host reads (to_host)", "diffusion_debug.diffusion.step_values:to_host"),
    ("host reads (read_now)", "diffusion_debug.diffusion.step_values:read_now"),
    ("host reads (encoder calls' read_now)", "diffusion_debug.diffusion.call_events:read_now"),
    ("call measured (measure_call)", "diffusion_debug.diffusion.step_values:measure_call"),
)
"""(label, ``module:qualified.name``): the function timed as that part; an indented label is
part of the one above it."""


def _wrap(spec: str, totals: list[int]) -> Callable[[], None]:
    """Time calls of ``spec``'s function into ``totals`` (ns, calls); returns what takes it off."""
    module_name, qualname = spec.split(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = getattr(owner, part)
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    clock = time.thread_time_ns

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        try:
            return original(*args, **kwargs)
        finally:
            totals[0] += clock() - start
            totals[1] += 1

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, original)


def measure(dtype: torch.dtype = torch.float32, rounds: int = 30, pipe: Any = None) -> dict[str, Any]:
    """Per part: ms and calls per watched call; the plain and watched calls' median CPU ms; the
    cold and warm attach+detach (µs)."""
    pipe = one_step(pipe if pipe is not None else tiny_pipeline(dtype=dtype))
    totals = {label: [0, 0] for label, _ in PARTS}
    undo = [_wrap(spec, totals[label]) for label, spec in PARTS]
    try:
        debugger = DiffusionModelDebugger(pipe, DebugConfig(output_dir=tempfile.mkdtemp(), log_level="error"))

        def plain() -> None:
            pipe("a photo of a cat", num_inference_steps=1, generator=torch.Generator().manual_seed(0))

        def watched() -> None:
            with debugger:
                plain()

        for _ in range(SENTINEL_EVERY):
            plain()
            watched()
        # the first timed call reads every group of sentinels (an fp16 UNet's step 0, the VAE's and the text
        # encoder's calls): its pace set back to the 2nd run; from the 3rd each reads runs of its own (sentinel_pace)
        debugger._steps.probes.pace.runs = 1
        for entry in totals.values():
            entry[0] = entry[1] = 0
        clock, times = time.thread_time_ns, {"plain": [], "watched": []}
        for i in range(rounds):  # both orders, alternately
            for kind, run in (("plain", plain), ("watched", watched))[:: 1 if i % 2 else -1]:
                start = clock()
                run()
                times[kind].append(clock() - start)
        parts = {label: (ns / rounds / 1e6, calls / rounds) for label, (ns, calls) in totals.items()}
        cold, warm = [], []
        for _ in range(rounds):
            plain()
            start = clock()
            debugger.attach()
            debugger.detach()
            cold.append(clock() - start)
            start = clock()
            debugger.attach()
            debugger.detach()
            warm.append(clock() - start)
        debugger.close()
    finally:  # last on, first off: a function two parts time (measure_call) gets its own back
        for put_back in reversed(undo):
            put_back()
    return {
        "parts": parts,
        "plain_ms": statistics.median(times["plain"]) / 1e6,
        "watched_ms": statistics.median(times["watched"]) / 1e6,
        "attach_detach_us": (statistics.median(cold) / 1e3, statistics.median(warm) / 1e3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dtype", nargs="?", default="fp32", choices=("fp32", "fp16", "bf16"))
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    found = measure(dtype, args.rounds)
    print(f"tiny SD {args.dtype}, 1 step, reused debugger, {args.rounds} rounds (thread CPU time, medians)")
    print(f"plain {found['plain_ms']:.2f} ms, watched {found['watched_ms']:.2f} ms")
    print("attach+detach alone: %.0f us after a plain call, %.0f us right after another" % found["attach_detach_us"])
    for label, (ms, calls) in found["parts"].items():
        print(f"{ms:8.3f} ms {calls:5.1f}x  {label}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
