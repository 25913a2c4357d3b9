"""Memory: peak RSS of a pipeline run with and without the debugger (each in its own process,
since peak RSS only grows), and the Python memory held after 1,000 ... 10,000 monitored steps
(tracemalloc): bounded means it stops growing once the ring buffers are full (history_size,
1,000 steps by default)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tracemalloc

import torch

from diffusion_debug import DebugConfig, DiffusionModelDebugger, TrainingDebugger

_CHILD = "import sys; from benchmarks.memory import _print_peaks; _print_peaks(*sys.argv[1:])"
CASES = ("plain", "debugger")


def peak_rss(model: str, steps: int, output_dir: str, *, here: bool = False) -> dict:
    """Peak RSS (MB) of one pipeline call, plain and debugged, each in its own process (both at
    once: peak RSS is per process, so running them side by side changes neither). ``here``
    (``benchmarks.run --smoke``: it runs, the figures mean nothing): both calls in this process, one
    after the other, no Python started (its import of torch and diffusers was 5 of a smoke run's
    CPU-s): the peaks are then this process's, whatever it ran before."""
    if here:
        return {found.pop("case"): found for found in _peaks(model, steps, ",".join(CASES), output_dir)}
    groups = list(CASES)
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, model, str(steps), cases, output_dir],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cases in groups
    ]
    out = {}
    for cases, child in zip(groups, children):
        stdout, stderr = child.communicate(timeout=900)
        if child.returncode != 0:
            raise RuntimeError(f"the {cases} memory run failed: {stderr[-2000:]}")
        for line in stdout.strip().splitlines()[-len(cases.split(",")) :]:
            found = json.loads(line)
            out[found.pop("case")] = found
    return out


def _peaks(model: str, steps: str | int, cases: str, output_dir: str) -> list[dict]:
    """A call of ``model``'s pipeline for each of the comma-separated ``cases``, one after the other:
    this process's peak RSS (MB) before and after each."""
    from diffusion_debug.testing import tiny_pipeline

    from .models import mid_pipeline

    pipe = mid_pipeline() if model == "mid" else tiny_pipeline("sd")

    def run() -> None:
        pipe("a cat", num_inference_steps=int(steps), generator=torch.Generator().manual_seed(0))

    found = []
    for case in cases.split(","):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        if case == "debugger":
            with DiffusionModelDebugger(pipe, DebugConfig(output_dir=output_dir, run_name="bench-memory")):
                run()
        else:
            run()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        found.append({"case": case, "peak_rss_mb": peak, "peak_before_call_mb": before})
    return found


def _print_peaks(model: str, steps: str, cases: str, output_dir: str) -> None:
    """The child process's part: :func:`_peaks`, one JSON line each."""
    for found in _peaks(model, steps, cases, output_dir):
        print(json.dumps(found))


def _retained_bytes(monitor, steps: int) -> list[int]:
    tracemalloc.start()
    sizes = []
    try:
        for step in range(steps):
            monitor(step)
            if step + 1 in (1_000, 2_000, 5_000, steps):
                sizes.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    return sizes


def record_growth(steps: int, output_dir: str) -> dict:
    config = DebugConfig(output_dir=output_dir, run_name="bench-record-training")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    tdbg = TrainingDebugger(model, config=config)
    x = torch.randn(4, 8)

    def train_step(step):
        loss = model(x).pow(2).mean()
        loss.backward()
        tdbg.monitor_training_step(loss, optimizer=optimizer, step=step)
        optimizer.step()
        optimizer.zero_grad()

    from diffusion_debug.testing import tiny_pipeline

    dbg = DiffusionModelDebugger(tiny_pipeline("sd"), config.replace(run_name="bench-record-diffusion"))
    latents = torch.randn(1, 4, 8, 8)

    def diffusion_step(step):
        dbg.monitor_diffusion_step(step, latents, timestep=999 - step % 1000)

    training = _retained_bytes(train_step, steps)
    diffusion = _retained_bytes(diffusion_step, steps)
    return {
        "steps": steps,
        "sampled_at_steps": sorted({n for n in (1_000, 2_000, 5_000, steps) if n <= steps}),
        "training_bytes": training,
        "diffusion_bytes": diffusion,
    }
